"""The peak half of the memory model (verl_ds4/memory/peak.py) and what the start-up check and the CLIs do with it.

* The ``reference`` path's kept tensors are what autograd really saves for this project's pure-PyTorch DS4 layer
  (saved-tensor hooks, tiny widths, CSA and HCA), and the calibration against the committed H200 measurements is
  within tolerance (``memory_calibration.py --compare``); each with a negative control.
* Megatron's unfused path is quadratic in a GPU's tokens (the gather's backward), the fused one is not; full
  recompute lowers the peak; a forward-only pass keeps nothing.
* ``verl-ds4 recipe NAME --dry-run --json`` prints the memory per role; host RAM per node is refused when short;
  DeepSeek-V4.1 refuses PP > 1 (Megatron-Bridge's provider).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))

import memory_calibration as mc  # noqa: E402

from verl_ds4.memory.peak import StepShape, layer_kept, step_peak  # noqa: E402

TINY = dataclasses.replace(
    mc.Shape(), vocab_size=50, hidden_size=40, num_attention_heads=5, head_dim=24, qk_rope_head_dim=8, q_lora_rank=11,
    o_groups=4, o_lora_rank=7, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=13, index_n_heads=9,
    index_head_dim=16, index_topk=17, hc_mult=3, compress_ratios=(4, 128), window=10, tokens=512,
)


def _saved_bytes_per_layer(shape) -> list[float]:
    """Bytes per token autograd keeps for each decoder layer of the calibration model (storages counted once)."""
    import torch

    torch.manual_seed(0)
    model = mc.build(shape, torch.bfloat16, "cpu")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    t = shape.tokens
    ids = torch.randint(0, shape.vocab_size, (t,))
    cu = torch.tensor([0, t // 2, t], dtype=torch.int32)
    out = []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        streams = model.embedding(ids).unsqueeze(-2).expand(-1, shape.hc_mult, -1).contiguous()
        for layer in model.layers:
            seen.clear()
            streams = layer(streams, cu)
            out.append(sum(seen.values()) / t)
    return out


def test_reference_terms_are_what_autograd_saves():
    measured = _saved_bytes_per_layer(TINY)
    sizes = mc.model_sizes(TINY)
    step = StepShape(TINY.tokens, 1, TINY.tokens // 2, TINY.window)
    model = [sum(t.bytes_per_token for t in layer_kept(sizes, r, "reference", step)) for r in TINY.compress_ratios]
    for ratio, got, want in zip(TINY.compress_ratios, model, measured):
        assert got == pytest.approx(want, rel=0.04), (ratio, got, want)
    # negative control: without the window keys' copy ([T, d, W]) the CSA layer is outside the bound
    terms = [t for t in layer_kept(sizes, 4, "reference", step) if not t.name.startswith("window keys")]
    assert sum(t.bytes_per_token for t in terms) < 0.96 * measured[0]


def test_calibration_reproduces_the_committed_h200_measurements(tmp_path):
    results = REPO / "benchmarks" / "results" / "memory_calibration_h200.json"
    assert mc.compare(str(results)) == 0
    data = json.loads(results.read_text())
    reference = [r for r in data["records"] if r["path"] == "reference"]
    assert len(reference) == 4 and all(abs(mc.model_figure(r) / r["measured_gib"] - 1) <= 0.10 for r in reference)
    # negative control: a measurement 15% away from the model is outside the 10% tolerance, and the exit says so
    off = next(r for r in data["records"] if r["id"] == "reference-8192-none")
    off["measured_gib"] *= 1.15
    (tmp_path / "off.json").write_text(json.dumps(data))
    assert mc.compare(str(tmp_path / "off.json")) == 1
    cli = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "memory_calibration.py"), "--compare", str(results)],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0 and "9 of 9 within tolerance" in cli.stdout


def _flash():
    return mc.model_sizes(mc.Shape())


def test_unfused_backward_is_quadratic_in_tokens_and_fused_is_linear():
    s = _flash()

    def peak(path, tokens):
        p = step_peak(s, [4, 128], path=path, shape=StepShape(tokens), margin=False)
        return p.activations_gib + p.transient_gib

    assert peak("unfused", 8192) / peak("unfused", 4096) > 3.0  # [T, 1.25 T, 512] bf16 per CSA layer
    assert peak("fused", 8192) / peak("fused", 4096) < 2.2
    assert peak("unfused", 8192) > 3 * peak("fused", 8192)


def test_recompute_and_passes():
    s = _flash()
    ratios = [4, 128] * 5
    none = step_peak(s, ratios, path="unfused", shape=StepShape(2048), in_flight=4, recompute=frozenset())
    full = step_peak(s, ratios, path="unfused", shape=StepShape(2048), in_flight=4, recompute=None)
    selective = step_peak(s, ratios, path="unfused", shape=StepShape(2048), in_flight=4, recompute=frozenset({"moe_act", "mhc"}))
    assert full.dynamic_gib < selective.dynamic_gib < none.dynamic_gib
    forward = step_peak(s, ratios, path="unfused", shape=StepShape(2048), training=False, logits="ref")
    assert forward.activations_gib == 0 and forward.logits_gib > 0
    fused, unfused = (sum(t.bytes_per_token for t in layer_kept(s, 4, path, StepShape(2048))) for path in ("fused", "unfused"))
    assert 0 < fused < unfused  # the fused kernel keeps no score matrix for backward
    with pytest.raises(ValueError, match="unknown attention path"):
        layer_kept(s, 4, "flash", StepShape(2048))


def _recipe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "verl_ds4.cli", "recipe", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def test_recipe_dry_run_json_has_the_memory_per_role():
    out = _recipe("sft", "--dry-run", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout)
    memory = plan["memory"]
    assert memory["gpu_gib"] == 139.8 and memory["headroom"] == 0.1 and plan["valid"] is True
    sft = memory["roles"]["sft"]
    assert {"states_gib", "activations_gib", "logits_gib", "peak_gib", "fits"} <= set(sft)
    assert sft["fits"] is True and sft["peak_gib"] <= memory["limit_gib"] and sft["logits_gib_max"] > 0
    assert sft["attention_kernel"] == "linear" and sft["recompute"] == "full"
    refused = _recipe("sft", "--dry-run", "--json", "ds4_mesh=h200_64gpu_pp4_ep8", "ds4.sparse_attention=megatron")
    assert refused.returncode == 1
    bad = json.loads(refused.stdout)
    assert bad["valid"] is False and bad["memory"]["roles"]["sft"]["fits"] is False
    assert any(e.startswith("sft memory: ") for e in bad["errors"])
    alone = _recipe("sft", "--json")  # --json is the dry-run's plan: refused without --dry-run, before composing
    assert alone.returncode == 2 and "expected --dry-run with it" in alone.stderr and alone.stdout == ""


def test_host_ram_per_node_is_checked_and_the_explicit_figure_wins():
    from verl_ds4.recipes.compose import compose_recipe
    from verl_ds4.recipes.validate import RecipeValidationError, validate_recipe

    def validate(*overrides):
        return validate_recipe(compose_recipe("ppo", ["ds4_mesh=h200_64gpu_pp4_ep8_cp4", *overrides]), "ppo", dry_run=True)

    with pytest.raises(RecipeValidationError, match=r"host memory: a node needs 2040 GiB of RAM \(offloaded states 1797, "
                       r"checkpoint staging 164, processes 64, data loader 16\) but has 1863 GiB \(H200 node"):
        validate()
    assert validate("ds4.mesh.host_memory_gib=2100").memory.host_capacity_gib == 2100
    with pytest.raises(RecipeValidationError, match="host memory"):  # control: 10 GiB short of the need is refused
        validate("ds4.mesh.host_memory_gib=2030")


def test_v41_refuses_pipeline_parallelism_of_its_provider():
    from verl_ds4.recipes.compose import compose_recipe
    from verl_ds4.recipes.validate import RecipeValidationError, validate_recipe

    with pytest.raises(RecipeValidationError, match=r"engine.pipeline_model_parallel_size: is 2 \(VPP None\) for DeepSeek-V4.1"):
        validate_recipe(compose_recipe("deepseek_v41_sft", ["ds4.mesh.pp=2", "ds4.mesh.nnodes=96"]), "sft", dry_run=True)
    report = validate_recipe(compose_recipe("deepseek_v41_sft", []), "sft", dry_run=True)  # the shipped PP 1 mesh
    assert report.errors == []
