"""The production model (Megatron-LM dev's DS4 built by Megatron-Bridge's provider) on tiny DS4 folders: its logits,
and Bridge's HF -> Megatron -> HF round trip. Prints ``RESULT {json}`` and saves the logits to ``OUT/logits.pt``.

Run by tests/test_production_path_on_cpu.py in a subprocess per commit (this process imports Megatron-LM ``dev``'s
``megatron/core`` in place of the installed megatron-core; the comparisons with transformers and with verl-ds4's own
model are made by the test, in its own process). The forwards run on forked gloo ranks
(:func:`verl_ds4.models.ds4.hf_check.run_on_cp_ranks`); dev and Bridge are imported here once, before the forks.

usage: python tests/production_path_checks.py COMMIT ARGS_JSON
  ARGS_JSON: {"folders": {"base", "perturbed", "missing", "missing_optional", "hub", "dequantised", "hub_small_blocks"},
              "sequences": PATH, "out": DIR, "perturbed_parameter": MEGATRON_NAME}
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def _round_trip_rank(rank: int, world: int, args: dict) -> dict:
    """One gloo rank: the builds and exports of the round trip (CP 1, float32)."""
    from megatron.core import parallel_state

    from verl_ds4.verify.production import ProductionBuilder, UnmappableFolder
    from verl_ds4.verify.production_roundtrip import (compare_parameters, compare_tensors, dequantised, export_tensors, parameters_of,
                                                     stored_tensors)

    folders = args["folders"]
    parallel_state.initialize_model_parallel(context_parallel_size=1)
    out: dict = {}
    try:
        # 1. the plain folder (float32, as written): HF -> Megatron -> HF
        base = ProductionBuilder(folders["base"], torch.float32)(1)
        exported = export_tensors(folders["base"], base)
        out["base"] = compare_tensors(exported, stored_tensors(folders["base"])).to_dict()
        out["base"]["names"] = len(exported)
        # negative control: one parameter nudged by 1e-3 of its largest entry, then exported again
        name = args["perturbed_parameter"]
        param = dict(base.gpt.named_parameters())[name]
        with torch.no_grad():
            param.view(-1)[0] += 1e-3 * float(param.detach().abs().max())
        out["base_perturbed"] = compare_tensors(export_tensors(folders["base"], base), stored_tensors(folders["base"])).to_dict()
        with torch.no_grad():
            param.view(-1)[0] -= 1e-3 * float(param.detach().abs().max())
        base_params = parameters_of(base)
        del base

        # 2. the hub's form (FP8 block-scaled + FP4 experts): Bridge's dequantised load = the project's dequantised
        # load (the same weights written as a plain native folder by verl-ds4's reader, then loaded by Bridge)
        hub = ProductionBuilder(folders["hub"], torch.float32)(1)
        plain = ProductionBuilder(folders["dequantised"], torch.float32)(1)
        hub_params, plain_params = parameters_of(hub), parameters_of(plain)
        out["hub_vs_dequantised_load"] = compare_parameters(hub_params, plain_params).to_dict()
        out["hub_vs_unquantised_load"] = compare_parameters(hub_params, base_params).to_dict()  # control: FP8 / FP4 rounding seen
        # Bridge's export of the hub-form model: as stored (encodings), and as read (dequantised values)
        hub_exported, hub_stored = export_tensors(folders["hub"], hub), stored_tensors(folders["hub"])
        out["hub_export"] = compare_tensors(hub_exported, hub_stored).to_dict()
        # (as numbers: Bridge re-quantises a -0.0 weight as +0 and may pick a smaller power-of-two scale for a block)
        out["hub_export_dequantised"] = compare_tensors(dequantised(hub_exported, folders["hub"]),
                                                        dequantised(hub_stored, folders["hub"]), numeric=True).to_dict()
        del hub, plain

        # 3. a folder without one tensor is refused, naming it; "missing_optional" lacks a tensor of a mapping Bridge
        # marks optional (allow_hf_name_mismatch: the compressors and the indexer)
        for key in ("missing", "missing_optional"):
            try:
                ProductionBuilder(folders[key], torch.float32)(1)
                out[key] = {"refused": False}
            except Exception as e:  # noqa: BLE001 - which exception is what the test checks
                out[key] = {"refused": True, "type": type(e).__name__, "message": str(e)[:2000],
                            "unmappable": isinstance(e, UnmappableFolder)}
    finally:
        parallel_state.destroy_model_parallel()
    return out


def _small_block_dequant(folder: str) -> dict:
    """Bridge's dequantisation of each FP8 weight of a folder whose ``weight_block_size`` is not 128 x 128, against
    verl-ds4's reader (no model: the tensors alone). Bridge's reader ignores ``weight_block_size``."""
    from megatron.bridge.models.conversion import quantization_utils

    from verl_ds4.models.ds4.hf_checkpoint import read_hf_tensors
    from verl_ds4.verify.production_roundtrip import stored_tensors

    raw, ours = stored_tensors(folder), read_hf_tensors(folder)
    worst, names = 0.0, 0
    for name, tensor in raw.items():
        if tensor.dtype != torch.float8_e4m3fn:
            continue
        theirs = quantization_utils.maybe_dequantize_hf_quantized_weight(name, raw, dtype=torch.float32)
        scale = float(ours[name].abs().max()) or 1.0
        worst = max(worst, float((theirs.double() - ours[name].double()).abs().max()) / scale)
        names += 1
    return {"fp8_tensors": names, "max_rel": worst}


def main(commit: str, args: dict) -> dict:
    from verl_ds4.substitutes import megatron_dev

    tree = megatron_dev.find(commit)
    megatron_dev.use(tree)
    from verl_ds4.substitutes import imports

    imports.import_bridge()  # once here: the forked ranks inherit dev and Bridge
    import megatron.core

    from verl_ds4.models.ds4.hf_check import run_on_cp_ranks
    from verl_ds4.mcore.distributed import run_distributed
    from verl_ds4.verify.production import ProductionBuilder

    folders = args["folders"]
    seqs = torch.load(args["sequences"])
    result: dict = {"commit": tree.commit, "megatron_file": megatron.core.__file__, "seconds": {}}
    logits: dict[str, list[torch.Tensor]] = {}
    runs = {
        "fp32": (folders["base"], torch.float32, True, 1),
        "fp64": (folders["base"], torch.float64, True, 1),
        "fp64_megatron_mhc_rms": (folders["base"], torch.float64, False, 1),
        "fp64_perturbed_folder": (folders["perturbed"], torch.float64, True, 1),
        "fp64_cp2": (folders["base"], torch.float64, True, 2),
    }
    for key, (folder, dtype, mhc_fix, cp) in runs.items():
        start = time.monotonic()
        logits[key] = run_on_cp_ranks(ProductionBuilder(folder, dtype, reference_mhc_rms=mhc_fix), seqs, cp, dtype=dtype)
        result["seconds"][key] = round(time.monotonic() - start, 1)
    start = time.monotonic()
    result["round_trip"] = run_distributed(_round_trip_rank, world_size=1, args=(args,), timeout=300)[0]
    result["seconds"]["round_trip"] = round(time.monotonic() - start, 1)
    result["small_block_dequant"] = _small_block_dequant(folders["hub_small_blocks"])
    torch.save(logits, Path(args["out"]) / "logits.pt")
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], json.loads(sys.argv[2]))), flush=True)
