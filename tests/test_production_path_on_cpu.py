"""The production path on CPU, at the pinned Megatron-LM dev commit (every proven commit in the extended proofs,
``bash benchmarks/extended_proofs.sh``): Megatron-LM dev's own DeepSeek-V4, built by
Megatron-Bridge 0.6.2's provider from a tiny HF folder (verl_ds4.verify.production.ProductionBuilder), against
transformers' ``DeepseekV4ForCausalLM`` and verl-ds4's own CPU model on the same folder, at CP 1 and 2; and Bridge's
HF -> Megatron -> HF round trip of that folder, plain and in the hub's FP8 / FP4 form.

The folder (written here, once, by verl-ds4's model on the released megatron-core: DeepSeek-native names): every DS4
layer kind (window-only, CSA ratio 4 with the indexer, HCA ratio 128), a hash-routed first layer and learned-routed
MoE, mHC with 4 streams, MTP depth 1 (MTP does not enter the logits; the round trip covers its tensors). Three
sequences of 300 / 170 / 45 tokens, so HCA's 128-row blocks complete.

tests/production_path_checks.py runs the production model in one subprocess per commit (it imports Megatron-LM dev in
place of the installed megatron-core; the commits at once) and saves its logits; transformers and verl-ds4's model run
here. Tolerances (each the largest |difference| over all rows and the vocabulary of a sequence, relative to the
reference's largest |value|, worst sequence):

* float32, 1e-4: two float32 implementations that round differently; both under ``StableTopK`` (the tiny model's
  indexer ReLU scores tie at 0 and the tie order must agree);
* float64, 1e-10: the same function (measured ~2e-15); Megatron's hard float32 casts promoted by ``fp64_reference``.

Both run Megatron's mHC RMS factor in the reference form (``reference_mhc_rms=True``): dev's own form (eps outside
the square root) differs from it by 8.3e-5 in these logits (the tiny model's mHC inputs are small), which would use
up the float32 bound; its control shows that it exceeds the float64 bound.

Skipped where the production path cannot run: a Python other than 3.12 or no Megatron-Bridge with its DS4 bridge
(lane 1; the reason is require_bridge()'s), or no Megatron-LM dev export (the reason names the command that makes
one; with CI=true and the archives beside the repository that is an error, not a skip).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_ds4.substitutes import megatron_dev
from verl_ds4.testing import extended
from verl_ds4.testing.megatron_dev_export import production_marks

REPO = Path(__file__).resolve().parents[1]
# CI runs at the pin; the extended proofs (bash benchmarks/extended_proofs.sh) at every proven commit.
COMMITS = extended.proven_commits()
LENGTHS = (300, 170, 45)
VOCAB = 64
SEED = 1234
#: the tensor the perturbed folder changes (a CSA layer's query down-projection) and the one the missing folder lacks
PERTURBED_TENSOR = "layers.1.attn.wq_a.weight"
MISSING_TENSOR = "layers.2.ffn.shared_experts.w2.weight"
#: a tensor of a mapping Megatron-Bridge marks optional (allow_hf_name_mismatch: compressors and indexer)
MISSING_OPTIONAL_TENSOR = "layers.3.attn.indexer.wq_b.weight"
#: the Megatron parameter the round trip's control nudges after the load
PERTURBED_PARAMETER = "decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight"
FP32_BOUND, FP64_BOUND = 1e-4, 1e-10


pytestmark = production_marks(*COMMITS)


# ---------------------------------------------------------------- the folders (released megatron-core, this process)


def tiny_config() -> dict:
    from verl_ds4.cpu.ds4_model_dir import ds4_tiny_hf_config

    # FP4 experts pack 32 inputs per scale: the expert width is 32 (the CPU jobs' 24 is not a multiple)
    return ds4_tiny_hf_config(VOCAB, num_nextn_predict_layers=1, moe_intermediate_size=32).to_dict()


def _write_rank(rank: int, world: int, config: dict, root: str) -> None:
    import torch
    from megatron.core import parallel_state

    from verl_ds4.cpu.ds4_model_dir import hash_table
    from verl_ds4.models.ds4.hf_checkpoint import save_hf_checkpoint
    from verl_ds4.models.ds4.model import build_ds4_model
    from verl_ds4.testing.ds4_hub_format import write_hub_folders

    parallel_state.initialize_model_parallel()
    try:
        model = build_ds4_model(config, dtype=torch.float32, seed=SEED)
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith("tid2eid"):
                    buf.copy_(hash_table(config["vocab_size"], config["n_routed_experts"], config["num_experts_per_tok"], SEED + 1))
        save_hf_checkpoint(model, Path(root) / "base", family="native", config=config)
        write_hub_folders(model, config, Path(root) / "hub128", block_size=(128, 128))  # the hub's blocks
        write_hub_folders(model, config, Path(root) / "hub_small", block_size=(8, 16))  # several blocks per matrix
    finally:
        parallel_state.destroy_model_parallel()


def write_folders(root: str | Path) -> dict[str, Path]:
    """base (float32, native names), perturbed (one tensor changed), missing (one tensor left out), hub (FP8 128 x 128
    blocks + FP4 experts, sharded), dequantised (the hub folder as verl-ds4's reader dequantises it, plain), and
    hub_small_blocks (FP8 8 x 16 blocks)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from verl_ds4.mcore.distributed import run_distributed
    from verl_ds4.models.ds4.hf_checkpoint import read_hf_tensors

    root = Path(root)
    config = tiny_config()
    run_distributed(_write_rank, world_size=1, args=(config, str(root)), timeout=300)
    base = root / "base"
    tensors = load_file(str(base / "model.safetensors"))

    def variant(name: str, changed: dict) -> Path:
        folder = root / name
        folder.mkdir()
        shutil.copyfile(base / "config.json", folder / "config.json")
        save_file(changed, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder

    bumped = dict(tensors)
    bumped[PERTURBED_TENSOR] = tensors[PERTURBED_TENSOR].clone()
    bumped[PERTURBED_TENSOR][0, 0] += 0.05
    assert {MISSING_TENSOR, MISSING_OPTIONAL_TENSOR, PERTURBED_TENSOR} <= set(tensors), sorted(tensors)[:20]
    hub = root / "hub128" / "hub"
    dequantised = {n: t.contiguous() for n, t in read_hf_tensors(hub).items()}
    return {"base": base, "perturbed": variant("perturbed", bumped),
            "missing": variant("missing", {n: t for n, t in tensors.items() if n != MISSING_TENSOR}),
            "missing_optional": variant("missing_optional", {n: t for n, t in tensors.items() if n != MISSING_OPTIONAL_TENSOR}),
            "hub": hub, "dequantised": variant("dequantised", dequantised),
            "hub_small_blocks": root / "hub_small" / "hub"}


def sequences():
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, VOCAB, (n,), generator=gen) for n in LENGTHS]


# ---------------------------------------------------------------- the references (this process)


def transformers_logits(folder, seqs, dtype):
    """transformers' DeepseekV4ForCausalLM on the folder: float32 under StableTopK, float64 under fp64_reference
    (its float32 casts promoted, built and run inside the mode)."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    from verl_ds4.substitutes.precision import StableTopK, fp64_reference

    precision = fp64_reference if dtype == torch.float64 else StableTopK
    with precision():
        model = DeepseekV4ForCausalLM.from_pretrained(str(folder), dtype=dtype, experts_implementation="eager",
                                                      attn_implementation="eager").to(dtype).eval()
        with torch.no_grad():
            return [model(input_ids=s[None]).logits[0] for s in seqs]


def rel(got, ref) -> float:
    """Worst sequence: max |got - ref| / max |ref| (in float64)."""
    return max(float((a.double() - b.double()).abs().max() / b.double().abs().max()) for a, b in zip(got, ref))


def log_probs(logits):
    import torch

    return [torch.log_softmax(x.double(), dim=-1) for x in logits]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Both commits' subprocess results and logits, and the references (computed while the subprocesses run)."""
    import torch

    from verl_ds4.models.ds4.hf_check import hf_logits

    trees = {c: megatron_dev.find(c) for c in COMMITS}  # unpack here, once, before the subprocesses start
    root = tmp_path_factory.mktemp("production")
    folders = write_folders(root / "folders")
    seqs = sequences()
    torch.save(seqs, root / "sequences.pt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    procs = {}
    for commit in COMMITS:
        out = root / commit[:8]
        out.mkdir()
        args = {"folders": {k: str(v) for k, v in folders.items()}, "sequences": str(root / "sequences.pt"), "out": str(out),
                "perturbed_parameter": PERTURBED_PARAMETER}
        procs[commit] = (out, subprocess.Popen([sys.executable, str(REPO / "tests" / "production_path_checks.py"), commit,
                                                json.dumps(args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                               text=True, cwd=REPO, env=env))
    refs = {"transformers_fp32": transformers_logits(folders["base"], seqs, torch.float32),
            "transformers_fp64": transformers_logits(folders["base"], seqs, torch.float64),
            "ours_fp64": hf_logits(folders["base"], seqs, cp=1, dtype=torch.float64)}
    results = {}
    for commit, (out, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, stderr[-4000:]
        result = json.loads(lines[-1][len("RESULT "):])
        result["tree"] = str(trees[commit].root)
        result["logits"] = torch.load(out / "logits.pt")
        results[commit] = result
    return {"results": results, "refs": refs, "folders": folders}


@pytest.fixture(params=extended.commit_params(COMMITS), ids=lambda c: c[:8])
def result(request, run):
    return run["results"][request.param]


@pytest.fixture
def refs(run):
    return run["refs"]


def test_the_checks_import_megatron_dev_of_the_commit(result):
    assert Path(result["tree"]).resolve() in Path(result["megatron_file"]).resolve().parents
    assert result["commit"] in COMMITS


# ---------------------------------------------------------------- (a) production = transformers


def test_float32_logits_and_log_probs_equal_transformers(result, refs):
    got, ref = result["logits"]["fp32"], refs["transformers_fp32"]
    assert [tuple(x.shape) for x in got] == [(n, VOCAB) for n in LENGTHS]
    print(f"{result['commit'][:8]} fp32 vs transformers: logits {rel(got, ref):.2e}, log-probs {rel(log_probs(got), log_probs(ref)):.2e}")
    assert rel(got, ref) <= FP32_BOUND and rel(log_probs(got), log_probs(ref)) <= FP32_BOUND


def test_float64_logits_and_log_probs_equal_transformers(result, refs):
    got, ref = result["logits"]["fp64"], refs["transformers_fp64"]
    assert all(x.dtype.is_floating_point and x.dtype.itemsize == 8 for x in got)
    print(f"{result['commit'][:8]} fp64 vs transformers: logits {rel(got, ref):.2e}, log-probs {rel(log_probs(got), log_probs(ref)):.2e}")
    assert rel(got, ref) <= FP64_BOUND and rel(log_probs(got), log_probs(ref)) <= FP64_BOUND
    assert max(float(x.abs().max()) for x in ref) > 0.1  # not a degenerate (all-zero) model


def test_control_megatron_mhc_rms_form_exceeds_the_float64_bound(result, refs):
    """dev's native_proj_rms puts eps outside the square root (verl_ds4.substitutes.upstream_fixes): without the fix
    the float64 logits differ from the reference by 8.3e-5 here, far above 1e-10 (and small: relative ~eps / rms)."""
    diff = rel(result["logits"]["fp64_megatron_mhc_rms"], refs["transformers_fp64"])
    print(f"{result['commit'][:8]} fp64 without the mHC fix vs transformers: {diff:.2e}")
    assert FP64_BOUND * 1e3 < diff < 1e-3


def test_control_a_perturbed_folder_differs(result, refs):
    diff = rel(result["logits"]["fp64_perturbed_folder"], refs["transformers_fp64"])
    print(f"{result['commit'][:8]} fp64, {PERTURBED_TENSOR}[0, 0] + 0.05 vs transformers on the original: {diff:.2e}")
    assert diff > 1e-6


# ---------------------------------------------------------------- (c) production = verl-ds4's model; CP 2 = CP 1


def test_float64_logits_equal_the_projects_model(result, refs):
    got, ref = result["logits"]["fp64"], refs["ours_fp64"]
    print(f"{result['commit'][:8]} fp64 vs verl-ds4's model: {rel(got, ref):.2e}; "
          f"perturbed folder: {rel(result['logits']['fp64_perturbed_folder'], ref):.2e}")
    assert rel(got, ref) <= FP64_BOUND
    assert rel(result["logits"]["fp64_perturbed_folder"], ref) > 1e-6  # the control, against this reference too


def test_context_parallel_2_equals_1(result):
    """CP 2 with verl's DS4 settings (contiguous partition, default_dynamic_cp), each rank a forked gloo process."""
    diff = rel(result["logits"]["fp64_cp2"], result["logits"]["fp64"])
    print(f"{result['commit'][:8]} fp64 CP 2 vs CP 1: {diff:.2e}")
    assert diff <= FP64_BOUND


# ---------------------------------------------------------------- (d) Bridge's round trip; bad input


#: Bridge exports the hash table as Megatron holds it (int32); the folder stores int64 (as the hub does)
TID2EID_DTYPE = {"layers.0.ffn.gate.tid2eid": "torch.int32 != torch.int64"}


def test_round_trip_returns_every_tensor_bit_for_bit(result):
    """HF -> Megatron (Bridge's load) -> HF (Bridge's export_hf_weights): the same 203 names, MTP's included, and
    every value bit for bit; the one dtype change is the hash table's (values equal)."""
    base = result["round_trip"]["base"]
    assert base["only_exported"] == [] and base["only_stored"] == [], base
    assert base["values"] == {} and base["dtype"] == TID2EID_DTYPE, base
    assert base["compared"] == base["names"] == 203, base


def test_round_trip_notices_a_perturbed_parameter(result):
    perturbed = result["round_trip"]["base_perturbed"]
    assert not perturbed["equal"] and list(perturbed["values"]) == ["layers.2.ffn.experts.1.w2.weight"], perturbed


def test_hub_fp8_fp4_folder_loads_as_the_project_dequantises_it(result):
    """Bridge's FP8 (128 x 128 blocks) / FP4 dequantisation on load = verl-ds4's reader (every value an FP8 / FP4
    number times a power of two: exact in both), parameter for parameter, bit for bit; the control is the
    unquantised folder, whose parameters differ by the quantisation."""
    rt = result["round_trip"]
    assert rt["hub_vs_dequantised_load"]["equal"] and rt["hub_vs_dequantised_load"]["compared"] >= 200, rt["hub_vs_dequantised_load"]
    control = rt["hub_vs_unquantised_load"]
    assert not control["equal"] and len(control["values"]) >= 60, control


def test_hub_folder_round_trip_keeps_every_value(result):
    """Bridge re-quantises on export with the source's scale layout: every name comes back (each X.weight with its
    X.scale), and read back as the config declares, every value is the stored one. The FP4 encodings differ (Bridge
    takes the smallest power-of-two scale that holds a block, and writes a -0.0 weight as +0); the tensors the hub
    keeps in bfloat16 come back in the model's float32, with their values."""
    rt = result["round_trip"]
    exported, values = rt["hub_export"], rt["hub_export_dequantised"]
    assert exported["only_exported"] == [] and exported["only_stored"] == [] and exported["compared"] == 305, exported
    assert values["only_exported"] == [] and values["only_stored"] == [] and values["values"] == {}, values
    assert set(exported["values"]) <= {n for n in exported["values"] if ".ffn.experts." in n}, exported["values"]
    recoded = {n for n in exported["values"] if n.endswith(".weight")}
    print(f"{result['commit'][:8]} hub folder: {len(recoded)} FP4 expert weights re-encoded, values equal")
    assert all("bfloat16" in v or n.endswith("tid2eid") for n, v in exported["dtype"].items()), exported["dtype"]


def test_a_folder_missing_a_tensor_is_refused_naming_it(result):
    missing = result["round_trip"]["missing"]
    assert missing["refused"] and missing["type"] == "UnmappableFolder", missing
    assert MISSING_TENSOR in missing["message"], missing


def test_a_folder_missing_an_indexer_tensor_is_refused_naming_it(result):
    """Bridge marks the compressor / indexer mappings optional (allow_hf_name_mismatch) and would end in a bare
    KeyError; check_mappable requires them once the model has the parameter."""
    missing = result["round_trip"]["missing_optional"]
    assert missing["refused"] and MISSING_OPTIONAL_TENSOR in missing["message"], missing
    assert missing["type"] == "UnmappableFolder", missing


def test_bridge_reads_fp8_blocks_as_128_by_128_whatever_the_config_says(result):
    """Upstream: Bridge 0.6.2's FP8 reader (quantization_utils.dequantize_fp8_e4m3fn_with_scale) tiles the scales in
    128 x 128 blocks and ignores the config's weight_block_size; with 8 x 16 blocks its values differ from the
    config's (verl-ds4's reader follows the config). Pinned so that a fix upstream shows."""
    small = result["small_block_dequant"]
    print(f"{result['commit'][:8]} FP8 8x16 blocks, Bridge vs the config's blocks: {small}")
    assert small["fp8_tensors"] >= 20 and small["max_rel"] > 1e-3, small
