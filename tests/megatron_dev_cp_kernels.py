"""Run verl_ds4.substitutes.cp_layout_kernels beside the pure-PyTorch references in Megatron-LM dev's own test file
and print the differences as JSON (``RESULT {...}``).

Run by tests/test_cp_layout_kernels_cpu_on_cpu.py in a subprocess, one per commit: it imports dev's
``megatron/core`` (found by verl_ds4.substitutes.megatron_dev) instead of the installed megatron-core, and the
references ``_native_compressor_input_compact``, ``_native_attention_indices`` and ``_native_indexer_loss_indices``
from ``tests/unit_tests/transformer/experimental_attention_variant/test_csa_cp_layout_kernels.py`` of that export.

Cases: random THD layouts (several sequences, an empty one, sequences across CP rank boundaries, tail padding),
CP 2 and 4, every rank, ratio 4, ratio 128 and window-only (ratio 0); float64 (and one bfloat16) hidden rows,
forward and gradients; the three index modes (selected ids, every visible group, indexer loss) with the production
map from dev's own ``cp_utils.prepare_cp_compressor_input`` (run on CPU through the installed patch) and with a
random map holding invalid (-1) entries. Negative control: the same functions with the rank offset one row off.

usage: python tests/megatron_dev_cp_kernels.py COMMIT
"""

import importlib
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from verl_ds4.substitutes import cp_layout_kernels as ours  # noqa: E402
from verl_ds4.substitutes import megatron_dev  # noqa: E402
from verl_ds4.substitutes.imports import triton_stand_in  # noqa: E402

CSA_UTILS = "megatron.core.transformer.experimental_attention_variant.csa_utils"


def load(commit):
    tree = megatron_dev.find(commit)
    megatron_dev.use(tree)
    with triton_stand_in():
        kernels = importlib.import_module(CSA_UTILS + ".cp_layout_kernels")
        cp_utils = importlib.import_module(CSA_UTILS + ".cp_utils")
        csa = importlib.import_module("megatron.core.transformer.experimental_attention_variant.csa")
        spec = importlib.util.spec_from_file_location("megatron_cp_layout_references",
                                                      tree.tests / "test_csa_cp_layout_kernels.py")
        refs = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(refs)
    return tree, kernels, cp_utils, csa, refs


def layout(gen, cp_size, ratio):
    """Random padded THD offsets: short and empty sequences, one longer than a rank, tail padding rows."""
    unit = max(ratio, 4)
    lengths = [int(x) for x in torch.randint(1, 3 * unit, (int(torch.randint(3, 7, (1,), generator=gen)),),
                                             generator=gen)]
    lengths.insert(int(torch.randint(0, len(lengths), (1,), generator=gen)), 0)  # an empty sequence
    lengths.insert(1, unit * (cp_size + 2) + 3)  # spans ranks
    d_window = max(16, 8 if ratio == 4 else ratio)
    while sum(lengths) < cp_size * d_window:  # every rank holds real rows
        lengths.append(int(torch.randint(1, 3 * unit, (1,), generator=gen)))
    real = sum(lengths)
    l_local = max(math.ceil(real / cp_size) + int(torch.randint(0, 6, (1,), generator=gen)), d_window)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return cu, l_local, d_window, max(lengths)


def compressed_offsets(cu, ratio):
    lengths = torch.div(cu[1:] - cu[:-1], ratio, rounding_mode="floor")
    return torch.cat((cu.new_zeros(1), torch.cumsum(lengths, 0, dtype=torch.int32)))


def diff(a, b):
    """Integer tensors: how many entries differ (shape mismatch counts every entry); floats: max |a - b|."""
    if a.shape != b.shape:
        return float(max(a.numel(), b.numel(), 1))
    if a.is_floating_point():
        return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0
    return int((a != b).sum())


def random_ids(gen, l_local, width, ratio, max_len):
    """Selected logical ids: mostly in range, some -1, past the sequence's groups, repeated."""
    top = max(max_len // max(ratio, 1), 1)
    return torch.randint(-2, top + 3, (l_local, width), generator=gen, dtype=torch.int32)


def compact_case(refs, fn, hidden, cu, start, l_local, ratio, d_window, dtype):
    """fn vs the reference: compact rows, ids, and the gradients of the local and boundary rows."""
    d_comp = 8 if ratio == 4 else ratio
    c_cap = max(1, (l_local + d_comp) // ratio)
    align = 32 // math.gcd(32, ratio)
    c_cap = -(-c_cap // align) * align
    local = hidden[start:start + l_local].detach().to(dtype)
    boundary = torch.cat((hidden.new_zeros((max(0, d_window - start),) + hidden.shape[1:]),
                          hidden[max(0, start - d_window):start])).detach().to(dtype)
    out = {}
    runs = []
    for f in (refs._native_compressor_input_compact, fn):
        a, b = local.clone().requires_grad_(True), boundary.clone().requires_grad_(True)
        reference = f is refs._native_compressor_input_compact
        args = (a, b, cu, start, l_local, ratio, d_comp, d_window, c_cap) if reference else \
            (a, b, cu, start, ratio, d_comp, c_cap)
        compact, ids = f(*args)
        weight = torch.linspace(-1, 1, compact.numel(), dtype=torch.float64).reshape(compact.shape).to(dtype)
        if compact.requires_grad:  # the reference's output has no graph when no group is visible
            (compact * weight).sum().backward()
        grads = [torch.zeros_like(x) if x.grad is None else x.grad for x in (a, b)]  # an unused input: zero
        runs.append((compact, ids, *grads))
    ref, got = runs
    out["compact"] = diff(got[0], ref[0])
    out["ids"] = diff(got[1], ref[1])
    out["grad_local"] = diff(got[2], ref[2])
    out["grad_boundary"] = diff(got[3], ref[3])
    out["dtype_kept"] = int(got[0].dtype == dtype and got[1].dtype == torch.int32)
    out["groups"] = int((ref[1] >= 0).sum())
    return out


def index_cases(refs, fns, cu, cu_comp, start, l_local, d_window, window, ratio, rank_map, gen, max_len, width_all):
    """Each of ``fns`` ({name: function}) vs the references in the three modes (the references run once);
    returns {name: {mode: entries that differ}}."""
    base = d_window + l_local
    out = {name: {} for name in fns}
    # every visible group (compress-only and window-only layers)
    ref = refs._native_attention_indices(cu, cu_comp, start, l_local, d_window, window, ratio, width_all,
                                         rank_map, base)
    for name, fn in fns.items():
        got = fn(cu, start, l_local, d_window, window, ratio, width_all, cu_seqlens_compressed=cu_comp if ratio > 1
                 else None, seq_to_rank_row=rank_map if ratio > 1 else None)
        out[name]["all_visible"] = diff(got[0], ref[0]) + diff(got[1], ref[1]) + int(got[2] is not None)
    if ratio > 1:
        width = 6 if ratio == 4 else 3
        ids = random_ids(gen, l_local, width, ratio, max_len)
        ref = refs._native_attention_indices(cu, cu_comp, start, l_local, d_window, window, ratio, width,
                                             rank_map, base, ids)
        loss_ref = refs._native_indexer_loss_indices(cu, cu_comp, start, l_local, d_window, window, ratio, ids,
                                                     rank_map, base)
        for name, fn in fns.items():
            got = fn(cu, start, l_local, d_window, window, ratio, width, ids, cu_seqlens_compressed=cu_comp,
                     seq_to_rank_row=rank_map)
            out[name]["selected"] = diff(got[0], ref[0]) + diff(got[1], ref[1]) + int(got[2] is not None)
            got = fn(cu, start, l_local, d_window, window, ratio, width, ids, cu_seqlens_compressed=cu_comp,
                     seq_to_rank_row=rank_map, for_indexer_loss=True)
            out[name]["indexer_loss"] = diff(got[0], loss_ref[0]) + diff(got[2], loss_ref[1]) + int(got[1] is not None)
    return out


def off_by_one(fn):
    """The negative control: the same function with the rank's first row one too far."""
    def broken(*args, **kwargs):
        args = list(args)
        args[1 if fn is ours.build_attention_indices else 3] += 1
        return fn(*args, **kwargs)
    return broken


def run_cases(kernels, cp_utils, refs):
    gen = torch.Generator().manual_seed(20260811)
    cases, control, mode1_invalid_map = {}, {}, {}
    n_rows = 0
    for cp_size in (2, 4):
        for ratio in (4, 128, 0):
            for seed in range(2):
                cu, l_local, d_window, max_len = layout(gen, cp_size, ratio)
                window = min(d_window, 16 if seed == 0 else 5)
                total = cp_size * l_local
                cu_comp = compressed_offsets(cu, ratio) if ratio > 1 else cu
                hidden = torch.randn(total, 2, 3, generator=gen, dtype=torch.float64)
                width_all = max_len // ratio if ratio > 1 else 0
                for rank in range(cp_size):
                    start = rank * l_local
                    key = f"cp{cp_size}_ratio{ratio}_layout{seed}_rank{rank}"
                    case = {}
                    rank_map = None
                    if ratio > 1:
                        for dtype in (torch.float64,) + ((torch.bfloat16,) if seed == 0 else ()):
                            got = compact_case(refs, ours.compressor_input_compact, hidden, cu, start, l_local,
                                               ratio, d_window, dtype)
                            case.update({f"{k}_{str(dtype)[6:]}": v for k, v in got.items()})
                        bad = compact_case(refs, off_by_one(ours.compressor_input_compact), hidden, cu, start,
                                           l_local, ratio, d_window, torch.float64)
                        control[key + "_compact"] = bad["compact"] + bad["grad_local"] + bad["grad_boundary"]
                        # dev's own prepare_cp_compressor_input on CPU (the patch installed): its compact rows
                        # equal the reference's, and its map is the production seq_to_rank_row
                        local = hidden[start:start + l_local]
                        boundary = torch.cat((hidden.new_zeros((max(0, d_window - start), 2, 3)),
                                              hidden[max(0, start - d_window):start]))
                        compact, ids, rank_map = cp_utils.prepare_cp_compressor_input(
                            local, boundary, cu, cu_comp, start, cp_size, ratio)
                        ref = refs._native_compressor_input_compact(
                            local, boundary, cu, start, l_local, ratio, 8 if ratio == 4 else ratio, d_window,
                            ids.shape[0])
                        case["prepare_cp_compressor_input"] = diff(compact, ref[0]) + diff(ids, ref[1])
                    args = (cu, cu_comp, start, l_local, d_window, window, ratio)
                    fns = {"ours": kernels.build_attention_indices, "broken": off_by_one(ours.build_attention_indices)}
                    got = index_cases(refs, fns, *args, rank_map, gen, max_len, width_all)
                    case.update({f"{mode}_production_map": v for mode, v in got["ours"].items()})
                    control[key + "_indices"] = sum(got["broken"].values())
                    if ratio > 1:  # a map with invalid rows
                        n_major = total // ratio
                        noisy = torch.randperm(n_major * 2, generator=gen)[:n_major].to(torch.int32)
                        noisy[torch.rand(n_major, generator=gen) < 0.2] = -1
                        got = index_cases(refs, {"ours": ours.build_attention_indices}, *args, noisy, gen, max_len,
                                          width_all)["ours"]
                        case["selected_noisy_map"] = got["selected"]
                        case["indexer_loss_noisy_map"] = got["indexer_loss"]
                        mode1_invalid_map[key] = got["all_visible"]
                    cases[key] = case
                    n_rows += l_local
    return cases, control, mode1_invalid_map, n_rows


def megatron_examples(kernels):
    """The padded-row example of Megatron's own test, through the patched module attribute on CPU."""
    got = kernels.build_attention_indices(torch.tensor([0, 8], dtype=torch.int32), 0, 10, 2, 2, 0, 0)
    return {"padded_rows": got[0][8:10].tolist(), "padded_lengths": got[1][8:10].tolist()}


def patch_cases(kernels, csa, cp_utils):
    originals = {name: getattr(kernels, name) for name in ours.PATCHED_NAMES}
    out = {"installed_names": ours.install(kernels), "installed_again": ours.install(kernels)}
    out["csa_calls_ours"] = csa.csa_cp_layout_kernels.build_attention_indices.megatron_original \
        is originals["build_attention_indices"]
    out["cp_utils_calls_ours"] = cp_utils.cp_layout_kernels.CompressorInputCompact.megatron_original \
        is originals["CompressorInputCompact"]
    try:
        originals["build_attention_indices"](torch.tensor([0, 8], dtype=torch.int32), 0, 8, 2, 2, 0, 0)
        out["original_raises_on_cpu"] = ""
    except RuntimeError as exc:
        out["original_raises_on_cpu"] = str(exc)
    return out, originals


def main():
    started = time.time()
    tree, kernels, cp_utils, csa, refs = load(sys.argv[1])
    result = {"commit": tree.commit, "kernels_file": kernels.__file__, "references_file": refs.__file__,
              "cute_available": bool(kernels._CUTE_AVAILABLE)}
    result["patch"], originals = patch_cases(kernels, csa, cp_utils)
    result["megatron_example"] = megatron_examples(kernels)
    result["cases"], result["control"], result["mode1_invalid_map"], result["rows"] = run_cases(kernels, cp_utils,
                                                                                                 refs)
    ours.uninstall()
    result["restored"] = all(getattr(kernels, n) is o for n, o in originals.items())
    result["seconds"] = round(time.time() - started, 2)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
