"""Whole-model checks of the device check (``device_checks.py --checks ds4,ds41``): DS4 and V4.1 as verify
and the trainers build them, one training step on the device against the same step on the CPU in fp64.

* ``ds4``: the full tiny DS4 of ``verl-ds4 verify`` (``build_ds4_model``: mHC, sliding / CSA / HCA
  attention, DS4 MoE with a hash layer, one MTP depth, the indexer loss; actor and critic), through the
  THD data path at CP = 1 (:func:`verl_ds4.verify.parity._worker`, in this process on one rank).
* ``ds41``: the tiny DeepSeek-V4.1 in Megatron-Core (``DS41MegatronModel``: Engram, CSA2 Full / Reindex /
  Reuse layers, single-pass mHC, V4's MoE), seeded weights, the same THD step (loss, log-probs, entropy,
  every gradient).

Each runs fp32 natively and bf16 with the reference's expert choices replayed and every indexer block
kept (a bf16 near-tie is a different function, not an error); the reference is our own model on the
CPU in fp64 (NeMo Automodel is not on the GPU machine). One ``PASS``/``FAIL`` line per model (the word
``ds4`` / ``ds41`` in it) with both precisions' figures. Needs torch, numpy, megatron-core (carried as a
wheel) and, for V4.1's Engram table, tokenizers + transformers; never verl.
"""

from __future__ import annotations

import time

#: Max relative differences (max|x - ref| / max|ref|) of the logits-side quantities and the worst
#: gradient group, per precision.
TOLERANCE = {"float32": 1e-3, "bfloat16": 2e-1}
DS4_LENGTHS = (5, 127, 300, 23, 129)  # ragged: shorter than a window, several windows, HCA blocks
DS4_QUICK = (5, 40, 131)
DS41_LENGTHS = (5, 27, 40, 9, 33, 3, 17, 200)
DS41_QUICK = (5, 27, 40)
_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


def _single_rank(device: str):
    """A one-rank gloo group (Megatron's parallel state needs one; at CP = 1 nothing is communicated, and
    the CPU reference runs in the same process); returns a closer."""
    import torch.distributed as dist

    from verl_ds4.mcore.distributed import free_port

    if dist.is_initialized():
        return lambda: None
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return dist.destroy_process_group


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _summary(rows, tol) -> tuple[bool, str]:
    """Worst row among the output quantities and among the gradient groups."""
    outputs = [r for r in rows if " grads " not in r.quantity and "value_grads" not in r.quantity]
    grads = [r for r in rows if r not in outputs]
    worst_out = max(outputs, key=lambda r: r.max_rel)
    worst_grad = max(grads, key=lambda r: r.max_rel)
    ok = all(r.max_rel <= tol for r in rows)
    label = lambda r: r.quantity.split(" ", 2)[-1].split(" (")[0]  # noqa: E731
    return ok, (f"worst output: {label(worst_out)} {worst_out.max_rel:.1e}, worst gradient group: {label(worst_grad)} "
                f"{worst_grad.max_rel:.1e} (rel <= {tol:g}, {len(rows)} rows)")  # fmt: skip


def check_ds4(device: str, quick: bool = False):
    """The full tiny DS4 (actor with MTP and indexer loss, critic) vs CPU fp64."""
    from verl_ds4.verify import parity
    from verl_ds4.verify.routes import count_differences

    close = _single_rank(device)
    lengths = DS4_QUICK if quick else DS4_LENGTHS
    batches = {"ragged": lengths}
    dtypes = ("fp32", "bf16")
    args = ("ds4", None, dtypes, batches, 1234, False, 0)
    results = []
    try:
        reference = parity._worker(0, 1, *args, parity.RunOptions(reference=True, record_routes=True))
        replay = {k: {role: {n: r["native"] for n, r in rs.items()} for role, rs in v.items()}
                  for k, v in reference.routes.items() if k[0] == "bf16"}  # fmt: skip
        opts = parity.RunOptions(device="cuda" if device.startswith("cuda") else "cpu", record_routes=True, replay=replay)
        _sync(device)
        t0 = time.perf_counter()
        ours = parity._worker(0, 1, *args, opts)
        _sync(device)
        seconds = time.perf_counter() - t0
    finally:
        close()
    rows = parity.compare(ours, reference, tolerances={d: TOLERANCE[_NAMES[d]] for d in dtypes})
    for d in dtypes:
        mine = [r for r in rows if r.quantity.startswith(d + " ")]
        ok, detail = _summary(mine, TOLERANCE[_NAMES[d]])
        differ = total = 0
        for role, got in ours.routes[(d, "ragged")].items():
            a, b = count_differences(got, reference.routes[(d, "ragged")][role])
            differ, total = differ + a, total + b
        how = "replayed" if d == "bf16" else "native"
        results.append((ok, f"{_NAMES[d]}: {detail}; routes {how}, {differ} of {total} choices differ natively"))
    tail = f"{sum(lengths)} tokens, actor (MTP, indexer loss) + critic; both precisions' steps {seconds:.1f} s"
    return [_one_line(f"ds4 whole model on {device}", results, tail)]


def _one_line(name: str, parts, tail: str):
    """One PASS/FAIL line per model: every precision's figures in it."""
    from device_checks import CheckResult

    return CheckResult(name, all(ok for ok, _ in parts), " | ".join(text for _, text in parts) + f" | {tail}")


def _ds41_case(quick: bool):
    import torch

    from verl_ds4.models.ds4.model import init_ds4_weights
    from verl_ds4.models.ds41 import reference as ref
    from verl_ds4.models.ds41.engram import engram_token_map
    from verl_ds4.models.ds41.model import DS41Model

    text = ref.tiny_text_config()
    table = engram_token_map(ref.local_tokenizer())[0]
    weights = DS41Model(text, table, dtype=torch.float64)
    init_ds4_weights(weights, seed=41)  # matrices N(0, 0.02), as the CPU jobs' V4.1 folder
    return text, table, weights.state_dict(), DS41_QUICK if quick else DS41_LENGTHS


def _ds41_step(text, table, state, lengths, dtype, device, replay=None):
    """One THD training step of ``DS41MegatronModel`` -> (quantities, routes, seconds)."""
    import numpy as np
    import torch

    from verl_ds4.layout import PlanOptions
    from verl_ds4.mcore.thd import make_plan
    from verl_ds4.models.ds41.mcore_model import DS41MegatronModel, ds41_transformer_config
    from verl_ds4.verify import parity, routes

    config = ds41_transformer_config(text, dtype, 1, device=device)
    model = DS41MegatronModel(config, table)
    bad = [k for k in model.load_state_dict(state, strict=False).missing_keys if not k.endswith("_extra_state")]
    if bad:
        raise RuntimeError(f"the V4.1 weights do not fit the Megatron model: {bad[:5]}")
    model.train()
    input_ids, _ = parity._batch(lengths, int(text["vocab_size"]), 7, device)
    rows = int(config.min_local_rows)
    plan = make_plan(input_ids, PlanOptions(layout="contiguous", cp_size=1, min_local_rows=rows))
    tapes = routes.attach(model, plan, 0, replay)
    _sync(str(device))
    t0 = time.perf_counter()
    per_token, loss = parity._actor_step(model, input_ids, "contiguous", 0, rows, 1, None)
    loss.backward()
    _sync(str(device))
    seconds = time.perf_counter() - t0
    out = {"log_probs": parity._np(per_token[:, 0]), "entropy": parity._np(per_token[:, 1]),
           "loss": np.array([loss.item()]), "grads": parity._grads(model, None)}  # fmt: skip
    return out, routes.collect(tapes, plan, None), seconds


#: Why bf16 does not judge the Engram gradients (fp32 does): its gate is sigmoid(sign(d) sqrt(|d|)), whose
#: slope 1 / (2 sqrt|d|) reaches 500 near d = 0, and d is a dot product that bf16 rounds by more than
#: its size when it nearly cancels (measured on CPU: 0.55 at 334 tokens, 0.06 at 72).
ENGRAM_NOTE = "the gate's sign*sqrt slope 1/(2 sqrt|d|) is ill-conditioned near d = 0"


def _ds41_group(name: str) -> str:
    from verl_ds4.verify import parity

    return "engram" if ".engram." in name else parity.param_group(name)


def check_ds41(device: str, quick: bool = False):
    """The tiny V4.1 in Megatron-Core (Engram, CSA2, mHC, MoE) vs CPU fp64."""
    import torch
    from megatron.core import parallel_state

    from verl_ds4.verify.routes import count_differences
    from verl_ds4.verify.table import Row, group_diff, max_diff

    text, table, state, lengths = _ds41_case(quick)
    close = _single_rank(device)
    parallel_state.initialize_model_parallel()
    results = []
    try:
        for d, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            # bf16 keeps every indexer block (own top-k and the hierarchical candidates), in the reference too.
            case_text = {**text, "index_topk": 1 << 16, "candidate_topk_blocks": 1 << 16} if d == "bf16" else text
            ref, ref_routes, _ = _ds41_step(case_text, table, state, lengths, torch.float64, "cpu")
            replay = {n: r["native"] for n, r in ref_routes.items()} if d == "bf16" else None
            dev_state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
            ours, our_routes, ms = _ds41_step(case_text, table, dev_state, lengths, dtype, device, replay)
            tol = TOLERANCE[_NAMES[d]]
            rows = [Row(f"{d} ragged {q}", *max_diff(ours[q], ref[q]), tol) for q in ("loss", "log_probs", "entropy")]
            unjudged = []
            for g in sorted({_ds41_group(n) for n in ref["grads"]}):
                pick = lambda gr: {n: v for n, v in gr.items() if _ds41_group(n) == g}  # noqa: E731
                a, r, n, _ = group_diff(pick(ours["grads"]), pick(ref["grads"]))
                row = Row(f"{d} ragged grads {g} ({n} params)", a, r, tol)
                (unjudged if g == "engram" and d == "bf16" else rows).append(row)
            ok, detail = _summary(rows, tol)
            for row in unjudged:
                detail += f"; engram grads {row.max_rel:.1e} (reported, not judged: {ENGRAM_NOTE})"
            differ, total = count_differences(our_routes, ref_routes)
            how = "replayed" if d == "bf16" else "native"
            results.append((ok, f"{_NAMES[d]}: {detail}; routes {how}, {differ} of {total} choices differ natively; "
                                f"fwd+bwd {ms * 1e3:.0f} ms"))  # fmt: skip
    finally:
        parallel_state.destroy_model_parallel()
        close()
    return [_one_line(f"ds41 whole model on {device}", results, f"{sum(lengths)} tokens, DS41MegatronModel (LM head)")]
