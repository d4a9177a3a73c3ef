"""``verl-ds4 verify --device cuda``: the tiny DS4 on GPUs against the fp64 CPU reference.

CP = N on N GPUs (one nccl process each; N = 1: one GPU) runs the same training step as the CPU
check (:mod:`.parity`: THD path with the contiguous layout, loss, log-probs, entropy, MTP and indexer
losses, every gradient group, critic values and gradients) in each precision of ``--dtype`` (default
fp32 and bf16), and compares it with CP = 1 on the CPU in fp64 with the same weights, batch and
config (a precision's config changes apply to both: bf16 keeps every indexer block). Routing: every
router's choice is recorded in the reference; fp32 routes natively, bf16 replays the reference's
routes (:mod:`.routes`); the report counts, per precision, the rows whose experts the device would
pick differently natively. At CP > 1 the negative controls of the CPU check run on the GPUs too.

Refused before any model is built (:func:`verl_ds4.verify.cli.run`): no visible GPU, or ``--cp`` above the
visible GPU count.
"""

from __future__ import annotations

import json
import time

from . import parity
from .parity import RunOptions, compare, format_table, rows_passed

__all__ = ["DEVICE_DTYPES", "DEVICE_TOLERANCES", "run_against_fp64", "routing_notes", "run_cli"]

#: Precisions a device run checks when ``--dtype`` is not given.
DEVICE_DTYPES = ("fp32", "bf16")
#: Max relative differences (max|x - ref| / max|ref|) against the fp64 CPU reference.
DEVICE_TOLERANCES = {"fp64": 1e-10, "fp32": 1e-3, "bf16": 2e-1}


def run_against_fp64(cp: int, device: str = "cuda", dtypes=DEVICE_DTYPES, model: str = "ds4", cfg=None, seed: int = 1234,
                     layout_checks: bool = True, timeout: float = 600.0, batches=None, tolerances=None):  # fmt: skip
    """``(rows, notes, seconds)``: CP = ``cp`` on ``device`` in ``dtypes`` against the fp64 CPU reference."""
    start = time.perf_counter()
    common = dict(cfg=cfg, seed=seed, timeout=timeout, model=model, dtypes=tuple(dtypes), batches=batches)
    reference = parity.run_parity(1, layout_checks=False, options=RunOptions(reference=True, record_routes=True), **common)
    replay = {key: {role: {n: r["native"] for n, r in rs.items()} for role, rs in roles.items()}
              for key, roles in reference.routes.items() if key[0] == "bf16"}  # fmt: skip
    result = parity.run_parity(cp, layout_checks=layout_checks, options=RunOptions(device=device, record_routes=True, replay=replay), **common)
    rows = compare(result, reference, tolerances={**DEVICE_TOLERANCES, **(tolerances or {})})
    return rows, routing_notes(result, reference), time.perf_counter() - start


def routing_notes(result, reference) -> list[str]:
    """One line per (precision, batch): how the routes were chosen and how many differ natively."""
    from .routes import count_differences

    lines = []
    for key, roles in result.routes.items():
        differ = total = 0
        for role, ours in roles.items():
            d, t = count_differences(ours, reference.routes[key][role])
            differ, total = differ + d, total + t
        how = "replayed from the fp64 reference" if key[0] == "bf16" else "native"
        lines.append(f"routing {key[0]} {key[1]}: {how}; {differ} of {total} expert choices (rows x routers, actor + critic) "
                     "differ natively from the reference's")  # fmt: skip
    return lines


def run_cli(args) -> int:
    """``verify --device cuda`` (the arguments are checked by :func:`verl_ds4.verify.cli.run`)."""
    dtypes = tuple(args.dtype) if args.dtype else DEVICE_DTYPES
    tolerances = {"fp64": args.fp64_rtol, "fp32": args.fp32_rtol, "bf16": args.bf16_rtol}
    rows, notes, seconds = run_against_fp64(args.cp, dtypes=dtypes, model=args.model, cfg=args.config, seed=args.seed,
                                            layout_checks=not args.no_layout_checks, timeout=args.timeout,
                                            tolerances=tolerances)  # fmt: skip
    import torch

    ok = rows_passed(rows)
    gpu = torch.cuda.get_device_name(0)
    name = {"ds4": "DS4 (full tiny model)", "ds4_proxy": "DS4 proxy (attention only)"}[args.model]
    title = f"{name}: CP={args.cp} on {args.cp} x {gpu} ({', '.join(dtypes)}) vs CP=1 on the CPU in fp64"
    notes = [
        "rel = max|x_gpu - x_ref| / max|x_ref| per quantity (a gradient group: over all its parameters); "
        f"tolerances {', '.join(f'{d} {tolerances[d]:g}' for d in dtypes)}; bf16 keeps every indexer block.",
        *notes,
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), nccl ranks: {args.cp}.",
    ]
    print(format_table(rows, title, notes=notes))
    print(f"{'PASSED' if ok else 'FAILED'} in {seconds:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cp": args.cp, "model": args.model, "device": "cuda", "gpu": gpu, "torch": torch.__version__,
                       "passed": ok, "seconds": seconds, "notes": notes,
                       "rows": [{"quantity": r.quantity, "max_abs": r.max_abs, "max_rel": r.max_rel, "tol": r.tol,
                                 "expect": r.expect} for r in rows]}, f, indent=2)  # fmt: skip
    return 0 if ok else 1
