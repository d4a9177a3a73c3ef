"""The ``linear`` attention path of the memory model (verl-ds4's row-chunked sparse attention in Megatron's unfused
DS4 layers, ``ds4.sparse_attention=linear``), its recipe knob and its start-up refusals.

* The linear path's attention terms grow linearly in a GPU's tokens (double T, about double the bytes) where
  Megatron's unfused core grows quadratically (negative control: the same measure on the unfused path is > 3x).
* ``plan --fit --kernel linear`` finds a 64-H200 mesh for 32k-token sequences where ``--kernel unfused`` finds none.
* The recipes carry ``ds4.sparse_attention`` into every Megatron engine block, the dry-run prints it next to
  ``dsa_kernel_backend``, and the validator refuses ``linear`` with ``cudnn`` and an unknown value (each with its
  accepted control).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from verl_ds4.recipes.compose import compose_recipe
from verl_ds4.memory.peak import CHUNK_BYTES, StepShape, layer_backward, layer_kept, path_of, step_peak
from verl_ds4.recipes.validate import RecipeValidationError, validate_recipe

REPO = Path(__file__).resolve().parents[1]
TRAINER = {"sft": "sft", "ppo": "ppo", "grpo": "ppo"}


def _flash():
    from importlib.resources import files

    import yaml

    from verl_ds4.models.ds4.sizes import DS4Sizes

    block = yaml.safe_load((files("verl_ds4.configs_data") / "ds4_model" / "flash.yaml").read_text())
    return DS4Sizes.from_hf_config({}, "flash", fallback=block)


def _attention_bytes(s, path: str, tokens: int, ratio: int = 4) -> float:
    """Bytes of one layer's attention at ``tokens``: what it keeps plus its largest backward transient."""
    shape = StepShape(tokens)
    kept = sum(t.bytes_per_token for t in layer_kept(s, ratio, path, shape))
    return (kept + max(t.bytes_per_token for t in layer_backward(s, ratio, path, shape))) * tokens


@pytest.mark.parametrize("ratio", [4, 128])
def test_linear_attention_is_linear_in_tokens_and_megatrons_is_quadratic(ratio):
    s = _flash()
    for tokens in (8192, 16384):
        linear = _attention_bytes(s, "linear", 2 * tokens, ratio) / _attention_bytes(s, "linear", tokens, ratio)
        assert 1.9 < linear < 2.1, (tokens, linear)
        unfused = _attention_bytes(s, "unfused", 2 * tokens, ratio) / _attention_bytes(s, "unfused", tokens, ratio)
        assert unfused > 3.0, (tokens, unfused)  # control: the gather's [T, n_kv, d] backward
    # the whole step too (CSA + HCA layers, the peak moment included)
    def dyn(path, tokens):
        p = step_peak(s, [4, 128], path=path, shape=StepShape(tokens), margin=False)
        return p.activations_gib + p.transient_gib

    assert 1.9 < dyn("linear", 32768) / dyn("linear", 16384) < 2.1
    assert dyn("unfused", 32768) / dyn("unfused", 16384) > 3.0


def test_linear_keeps_no_score_matrix_and_its_chunk_is_bounded():
    s = _flash()
    shape = StepShape(8192)
    names = " ".join(t.name for t in layer_kept(s, 4, "linear", shape))
    assert "kv_g" not in names and "score chain" not in names
    kept = {p: sum(t.bytes_per_token for t in layer_kept(s, 4, p, shape)) for p in ("linear", "unfused")}
    assert kept["linear"] < kept["unfused"] / 4
    # the chunk's work space never exceeds CHUNK_BYTES however many tokens: the backward term less its linear part
    for tokens in (4096, 65536):
        t = StepShape(tokens)
        core = layer_backward(s, 4, "linear", t)[0].bytes_per_token * tokens
        linear_part = (2 * s.num_attention_heads * s.head_dim + 6 * s.head_dim * t.kv_rows(4) / tokens) * tokens
        assert 0 < core - linear_part <= CHUNK_BYTES
    # the chunk size is the kernel's (the lead's core ships DEFAULT_CHUNK_BYTES beside it)
    kernels = REPO / "verl_ds4" / "kernels" / "sparse_attention.py"
    if kernels.is_file():
        assert f"DEFAULT_CHUNK_BYTES = {CHUNK_BYTES // 1024**2} * 1024**2" in kernels.read_text()


def test_path_of_backend_and_core():
    assert path_of("none", "linear") == "linear" and path_of(None, "linear") == "linear"
    assert path_of("none", "megatron") == "unfused" and path_of("none", None) == "unfused"
    assert path_of("cudnn", "megatron") == "fused"


def _plan_fit(kernel: str) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, "-m", "verl_ds4.cli", "plan", "--fit", "--model", "flash", "--gpu", "H200", "--gpus", "64",
                          "--max-seq-len", "32768", "--kernel", kernel, "--json"], capture_output=True, text=True, timeout=300, cwd=REPO)
    return out.returncode, json.loads(out.stdout)


def test_plan_fit_kernel_linear_fits_32k_on_64_h200_where_unfused_does_not():
    rc, linear = _plan_fit("linear")
    assert rc == 0 and linear["kernel"] == "linear"
    best = linear["meshes"][0]
    assert (best["pp"], best["ep"], best["cp"][0]) == (4, 16, 8) and best["peak_gib"] <= best["limit_gib"]
    rc, unfused = _plan_fit("unfused")  # control: Megatron's core at the same settings
    assert rc == 1 and unfused["meshes"] == []
    closest = unfused["not_fitting"][0]
    assert "the memory-linear sparse attention: ds4.sparse_attention=linear" in closest["levers"]


def _validate(kind: str, overrides: list[str]):
    return validate_recipe(compose_recipe(kind, overrides), TRAINER[kind], dry_run=True)


@pytest.mark.parametrize("kind", ["sft", "ppo", "grpo"])
def test_the_knob_reaches_every_megatron_engine_block(kind):
    cfg = compose_recipe(kind, ["ds4.sparse_attention=megatron"])
    blocks = {"sft": ["engine"], "ppo": ["actor_rollout_ref.actor.megatron", "actor_rollout_ref.ref.megatron", "critic.megatron"],
              "grpo": ["actor_rollout_ref.actor.megatron", "actor_rollout_ref.ref.megatron"]}[kind]
    from omegaconf import OmegaConf

    for key in blocks:
        block = OmegaConf.select(cfg, key)
        assert block["_target_"] == "verl_ds4.engine.config.DS4McoreEngineConfig", key
        assert block["sparse_attention"] == "megatron", key
    assert OmegaConf.select(compose_recipe(kind, []), blocks[-1] + ".sparse_attention") == "linear"  # the default mesh's


def test_dry_run_prints_the_core_next_to_the_backend():
    out = subprocess.run([sys.executable, "-m", "verl_ds4.cli", "recipe", "grpo", "--dry-run"], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "dsa_kernel_backend=none, sparse_attention=linear" in out.stdout
    assert " linear " in next(ln for ln in out.stdout.splitlines() if ln.strip().startswith("actor  update"))


def test_linear_with_the_fused_backend_is_refused_naming_the_conflict():
    with pytest.raises(RecipeValidationError) as info:
        _validate("sft", ["ds4.dsa_kernel_backend=cudnn"])
    text = str(info.value)
    assert "engine.sparse_attention: is linear with dsa_kernel_backend=cudnn" in text
    assert "set ds4.sparse_attention=megatron to keep the fused kernels, or ds4.dsa_kernel_backend=none" in text
    # controls: each half of the fix is accepted
    assert _validate("sft", ["ds4.dsa_kernel_backend=cudnn", "ds4.sparse_attention=megatron"]).errors == []
    assert _validate("sft", ["ds4.dsa_kernel_backend=none", "ds4.sparse_attention=linear"]).errors == []


def test_an_unknown_core_is_refused_listing_the_choices():
    with pytest.raises(RecipeValidationError, match=r"actor_rollout_ref.actor.megatron.sparse_attention: is 'flash'; "
                       r"expected one of \['megatron', 'linear'\]"):
        _validate("grpo", ["ds4.sparse_attention=flash"])
    report = _validate("grpo", ["ds4.sparse_attention=megatron", "ds4.max_token_len_per_gpu=2048",  # control, at the budget
                                "ds4.infer_max_token_len_per_gpu=4096"])  # Megatron's core fits on this mesh
    assert report.errors == [] and {rm.path for rm in report.memory.roles} == {"unfused"}


def test_the_memory_check_follows_the_knob():
    """At 8192 tokens per GPU (the default H200 mesh's budget) the linear core fits and Megatron's is refused, naming
    the lever."""
    report = _validate("sft", [])
    assert report.memory.roles[0].tokens_per_gpu == 8192
    assert report.errors == [] and report.memory.roles[0].path == "linear"
    with pytest.raises(RecipeValidationError) as info:
        _validate("sft", ["ds4.max_token_len_per_gpu=8192", "ds4.sparse_attention=megatron"])
    text = str(info.value)
    assert "unfused attention" in text and "the memory-linear sparse attention: ds4.sparse_attention=linear" in text
