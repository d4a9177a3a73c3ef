#!/usr/bin/env python3
"""Memory and time of one DS4 CSA sparse attention forward + backward on CPU: Megatron-LM dev's
``unfused_compressed_sparse_attn`` beside verl-ds4's ``linear_sparse_attn``, in one run, T = 1k ... 16k tokens.

Reduced widths (8 heads, head dim 64, float32), one packed sequence of T tokens, DS4-shaped ids: 128 window
keys + the top 160 of the query's completed ratio-4 blocks (random scores), ``n_kv = T + T / 4``. Each case runs
in its own process (``--case``) and reports:

* ``largest``: the largest single allocation of an op (torch.profiler, ``self_cpu_memory_usage``, forward +
  backward; Megatron's is ``aten::gather_backward``, the expanded ``[T, n_kv, d]`` block);
* ``peak``: the process's peak resident memory during forward + backward above what it held before (the
  inputs; ``/proc/self/clear_refs`` resets the high-water mark first);
* ``seconds``: forward + backward wall time (median of 3, after one warm-up).

The table (markdown, ``--out``) gives each column per T, the log-log slope of each over the T's both ran
(quadratic ~2, linear ~1) and the time ratio. Cases whose expanded block alone would exceed ``--max-gib`` are
not run for Megatron's function (named in the table with the bytes it would ask for). Megatron-LM dev's source
comes from ``benchmarks/gpu/prepare_megatron_dev.sh`` (``--megatron``); without it only the linear core runs.

    python benchmarks/bench_linear_sparse_attn.py --out benchmarks/results/linear_sparse_attn_cpu.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MIB = 1024**2
HEADS, DIM, TOPK, WINDOW, RATIO = 8, 64, 160, 128, 4


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _inputs(tokens: int, seed: int = 0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    blocks = tokens // RATIO
    n_kv = tokens + blocks
    rows = torch.arange(tokens)
    window = rows.unsqueeze(1) - torch.arange(WINDOW)
    window = torch.where(window >= 0, window, -1)
    comp = torch.full((tokens, TOPK), -1, dtype=torch.int64)
    for start in range(0, tokens, 1024):  # random scores over the visible blocks, top-k, in row chunks
        end = min(start + 1024, tokens)
        visible = torch.arange(blocks).unsqueeze(0) < ((rows[start:end] + 1) // RATIO).unsqueeze(1)
        scores = torch.rand(end - start, blocks, generator=gen).masked_fill(~visible, -1.0)
        values, ids = scores.topk(min(TOPK, blocks), dim=1)
        comp[start:end, : ids.shape[1]] = torch.where(values >= 0, ids + tokens, -1)
    ids = torch.cat([comp, window], dim=1).to(torch.int32)
    q = torch.randn(tokens, HEADS, DIM, generator=gen, requires_grad=True)
    kv = torch.randn(n_kv, DIM, generator=gen, requires_grad=True)
    sink = torch.randn(HEADS, generator=gen, requires_grad=True)
    return q, kv, sink, ids


def _function(name: str, megatron: str):
    if name == "linear":
        sys.path.insert(0, str(REPO))
        from verl_ds4.kernels import linear_sparse_attn

        return linear_sparse_attn
    import importlib.util

    sys.path.insert(0, megatron)
    spec = importlib.util.spec_from_file_location("megatron_dsv4_memory", HERE / "gpu" / "megatron_dsv4_memory.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    harness.import_megatron("cpu")
    from megatron.core.transformer.experimental_attention_variant import csa

    return csa.unfused_compressed_sparse_attn


def run_case(name: str, tokens: int, megatron: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    fn = _function(name, megatron)
    q, kv, sink, ids = _inputs(tokens)
    grad = torch.randn(tokens, HEADS * DIM)

    def step():
        out = fn(q, kv, sink, ids, DIM**-0.5)
        out.backward(grad)
        q.grad = kv.grad = sink.grad = None

    step()  # warm-up
    Path("/proc/self/clear_refs").write_text("5")  # reset the resident high-water mark
    base = _rss_kib("VmRSS")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = (_rss_kib("VmHWM") - base) * 1024
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    largest = max((e.self_cpu_memory_usage, e.name) for e in prof.events())
    return {"fn": name, "tokens": tokens, "peak": peak, "largest": largest[0], "largest_op": largest[1],
            "seconds": statistics.median(times)}  # fmt: skip


def kept_per_token(name: str, megatron: str, tokens: int = 256, heads: int = 64, dim: int = 512, keys: int = 640) -> float:
    """Bytes autograd keeps for backward per query token at DS4-Flash widths (bf16 inputs; CSA: 512 compressed +
    128 window ids a row), by distinct storage, the inputs (query, kv_full, sink) and the ids left out."""
    import torch

    fn = _function(name, megatron)
    gen = torch.Generator().manual_seed(0)
    n_kv = tokens + tokens // RATIO
    q = torch.randn(tokens, heads, dim, generator=gen).bfloat16().requires_grad_()
    kv = torch.randn(n_kv, dim, generator=gen).bfloat16().requires_grad_()
    sink = torch.randn(heads, generator=gen, requires_grad=True)
    ids = torch.randint(0, n_kv, (tokens, keys), generator=gen, dtype=torch.int32)
    own = {t.untyped_storage().data_ptr() for t in (q, kv, sink, ids)}
    kept = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(q, kv, sink, ids, dim**-0.5)
    return sum(kept.values()) / tokens


def _slope(points: list[tuple[int, float]]) -> float | None:
    pts = [(math.log(t), math.log(v)) for t, v in points if v and v > 0]
    if len(pts) < 2:
        return None
    mx, my = statistics.mean(p[0] for p in pts), statistics.mean(p[1] for p in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def expanded_block_bytes(tokens: int) -> int:
    """Megatron's gather backward: the expanded ``[T, n_kv, d]`` input, float32."""
    return tokens * (tokens + tokens // RATIO) * DIM * 4


def table(rows: list[dict], skipped: dict[int, int], tokens: list[int]) -> str:
    by = {(r["fn"], r["tokens"]): r for r in rows}
    lines = [
        f"DS4 CSA sparse attention, forward + backward on CPU (float32, {HEADS} heads, head dim {DIM}, top-{TOPK} "
        f"compressed + {WINDOW} window keys per row, n_kv = 1.25 T, one thread): Megatron-LM dev's "
        "`unfused_compressed_sparse_attn` (megatron) vs verl-ds4's `linear_sparse_attn` (linear). "
        "largest = the largest single allocation of an op (torch.profiler); peak = peak resident memory above the "
        "inputs during forward + backward; s = wall time (median of 3).",
        "",
        "| T | megatron largest MiB | linear largest MiB | megatron peak MiB | linear peak MiB | megatron s | linear s | time ratio (linear / megatron) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in tokens:
        m, lin = by.get(("megatron", t)), by.get(("linear", t))
        if m is None and t in skipped:
            mcols = [f"not run (its gather backward alone asks {skipped[t] / MIB:,.0f})", "-", "-"]
        elif m is None:
            mcols = ["-", "-", "-"]
        else:
            mcols = [f"{m['largest'] / MIB:,.1f}", f"{m['peak'] / MIB:,.1f}", f"{m['seconds']:.2f}"]
        lcols = ["-", "-", "-"] if lin is None else [f"{lin['largest'] / MIB:,.1f}", f"{lin['peak'] / MIB:,.1f}", f"{lin['seconds']:.2f}"]
        ratio = f"{lin['seconds'] / m['seconds']:.2f}" if m and lin else "-"
        lines.append(f"| {t:,} | {mcols[0]} | {lcols[0]} | {mcols[1]} | {lcols[1]} | {mcols[2]} | {lcols[2]} | {ratio} |")
    lines.append("")
    for fn in ("megatron", "linear"):
        pts = [(t, by[(fn, t)]) for t in tokens if (fn, t) in by]
        if pts:
            span = f"T = {pts[0][0]:,} ... {pts[-1][0]:,}"
            slopes = ", ".join(f"{key} {s:.2f}" for key in ("largest", "peak", "seconds")
                               if (s := _slope([(t, r[key]) for t, r in pts])) is not None)  # fmt: skip
            op = pts[-1][1]["largest_op"]
            lines.append(f"- log-log slope, {fn} ({span}): {slopes} (largest allocation by `{op}` at the longest T)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1024,2048,4096,8192,16384", help="comma-separated T (default 1k ... 16k)")
    p.add_argument("--megatron", default=str(HERE / "gpu" / "carry" / "megatron_dev"), help="folder holding Megatron-LM dev's megatron/core")
    p.add_argument("--max-gib", type=float, default=6.0, help="skip Megatron's function where its expanded block exceeds this (default 6)")
    p.add_argument("--out", default=None, help="write the markdown table here (default: print it)")
    p.add_argument("--case", nargs=2, metavar=("FN", "T"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        if args.case[1] == "kept":
            print("CASE " + json.dumps({"fn": args.case[0], "kept_per_token": kept_per_token(args.case[0], args.megatron)}))
        else:
            print("CASE " + json.dumps(run_case(args.case[0], int(args.case[1]), args.megatron)))
        return 0
    tokens = [int(t) for t in args.tokens.split(",") if t]
    have_megatron = (Path(args.megatron) / "megatron" / "core" / "transformer" / "experimental_attention_variant" / "csa.py").exists()
    if not have_megatron:
        print(f"[bench] no Megatron-LM dev at {args.megatron} (benchmarks/gpu/prepare_megatron_dev.sh): the linear core only", file=sys.stderr)
    rows, skipped = [], {}
    for t in tokens:
        for fn in ("megatron", "linear"):
            if fn == "megatron" and not have_megatron:
                continue
            if fn == "megatron" and expanded_block_bytes(t) > args.max_gib * 1024**3:
                skipped[t] = expanded_block_bytes(t)
                print(f"[bench] {fn} T={t}: not run, its gather backward asks {expanded_block_bytes(t) / 1024**3:.1f} GiB", file=sys.stderr)
                continue
            t0 = time.time()
            out = subprocess.run([sys.executable, __file__, "--megatron", args.megatron, "--case", fn, str(t)],
                                 capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
            line = [x for x in out.stdout.splitlines() if x.startswith("CASE ")]
            if out.returncode or not line:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            rows.append(json.loads(line[-1][5:]))
            r = rows[-1]
            print(f"[bench] {fn:8s} T={t:6d}: largest {r['largest'] / MIB:9.1f} MiB, peak {r['peak'] / MIB:9.1f} MiB, "
                  f"{r['seconds']:.2f} s ({time.time() - t0:.0f} s with start-up)", file=sys.stderr)  # fmt: skip
    text = table(rows, skipped, tokens)
    kept = {}
    for fn in ("megatron", "linear") if have_megatron else ("linear",):
        out = subprocess.run([sys.executable, __file__, "--megatron", args.megatron, "--case", fn, "kept"], capture_output=True, text=True)
        line = [x for x in out.stdout.splitlines() if x.startswith("CASE ")]
        if line:
            kept[fn] = json.loads(line[-1][5:])["kept_per_token"]
    text += ("\nKept for backward per query token by the attention core alone, DS4-Flash CSA widths (64 heads, head dim 512, "
             "640 ids a row, bf16 inputs; the inputs and ids themselves left out): "
             + ", ".join(f"{fn} {v / 1024:,.1f} KiB" for fn, v in kept.items())
             + (f" (linear / megatron = {kept['linear'] / kept['megatron']:.4f})" if len(kept) == 2 else "") + ".\n")
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps({"rows": rows, "skipped": skipped, "kept_per_token": kept}, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
