#!/usr/bin/env python3
"""Memory of the logits step (LM head -> per-token log-probs and entropy, forward + backward) on CPU, per token:
the full ``[T, V]`` logits as verl 0.9.1's non-fused path computes them, beside verl-ds4's chunked function.

DS4's vocabulary (V = 129,280), a small hidden size (H = 256), float32, T = 256 ... 4096 tokens. Paths:

* ``full``: ``logits = h W^T / t``, verl's non-fused processor's steps (a clone of the logits for the entropy,
  ``log_softmax`` for the label's log-prob and the entropy), backward of ``sum(lp * a + ent * b)``;
* ``chunked``: :func:`verl_ds4.kernels.chunked_linear_logprobs` (the same loss) with 128-row chunks. It is
  also what the CPU tests run in place of verl's fused Triton kernel (which has no CPU build); the Triton
  kernel's own buffers are counted from its source in :mod:`verl_ds4.memory.terms`.

Each case runs in its own process (``--case``) and reports ``peak`` (resident high-water mark during one
forward + backward above what the process held before, ``/proc/self/clear_refs`` reset first) and ``largest``
(the largest single allocation of an op, torch.profiler). The table gives bytes per token, the log-log slope
of ``peak`` over T (linear ~1; a flat ~0 means a fixed work space) and the full / chunked ratio.

    python benchmarks/bench_logits_memory.py --out benchmarks/results/logits_memory_cpu.md
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
VOCAB, HIDDEN, CHUNK_ROWS, TEMPERATURE = 129_280, 256, 128, 0.7
MIB = 1024**2


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def run_case(path: str, tokens: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(REPO))
    from verl_ds4.kernels import chunked_linear_logprobs

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, HIDDEN, generator=gen, requires_grad=True)
    w = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05).requires_grad_()
    labels = torch.randint(0, VOCAB, (tokens,), generator=gen)
    a, b = torch.randn(tokens, generator=gen), torch.randn(tokens, generator=gen)

    def full():
        logits = (h @ w.t()) / TEMPERATURE
        clone = logits.clone()  # verl's processor keeps a copy for the entropy
        logp = torch.log_softmax(clone, dim=-1)
        ent = -(logp.exp() * logp).sum(-1)
        lp = torch.log_softmax(logits, dim=-1).gather(1, labels[:, None]).squeeze(1)
        return lp, ent

    def chunked():
        return chunked_linear_logprobs(h, w, labels, TEMPERATURE, chunk_rows=CHUNK_ROWS)

    fn = {"full": full, "chunked": chunked}[path]

    def step():
        lp, ent = fn()
        (lp * a + ent * b).sum().backward()
        h.grad = w.grad = None

    step()  # warm-up
    Path("/proc/self/clear_refs").write_text("5")
    base = _rss_kib("VmRSS")
    step()
    peak = (_rss_kib("VmHWM") - base) * 1024
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    largest = max((e.self_cpu_memory_usage, e.name) for e in prof.events())
    return {"path": path, "tokens": tokens, "peak": peak, "largest": largest[0], "largest_op": largest[1]}


def _slope(points):
    pts = [(math.log(t), math.log(v)) for t, v in points if v > 0]
    if len(pts) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs=2, metavar=("PATH", "T"), help="run one case, print JSON (internal)")
    parser.add_argument("--tokens", default="256,512,1024,2048", help="T for both paths")
    parser.add_argument("--chunked-tokens", default="4096", help="extra T for the chunked path only")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rows", type=Path, help="format the case results saved in this JSON-lines file instead")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case[0], int(args.case[1]))))
        return
    both = [int(t) for t in args.tokens.split(",")]
    extra = [int(t) for t in args.chunked_tokens.split(",") if t]
    rows = [json.loads(ln) for ln in args.rows.read_text().splitlines() if ln.strip()] if args.rows else []
    for path, ts in () if args.rows else (("full", both), ("chunked", both + extra)):
        for t in ts:
            out = subprocess.run([sys.executable, __file__, "--case", path, str(t)], capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    by = {(r["path"], r["tokens"]): r for r in rows}
    lines = [
        f"# Logits step memory on CPU (V = {VOCAB:,}, H = {HIDDEN}, float32, forward + backward, chunk {CHUNK_ROWS} rows)",
        "",
        "| T | full peak MiB | full peak B/token | full largest MiB | chunked peak MiB | chunked peak B/token | chunked largest MiB | full / chunked peak |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in sorted({r["tokens"] for r in rows}):
        f, c = by.get(("full", t)), by.get(("chunked", t))
        cell = lambda r, k, d=MIB: f"{r[k] / d:,.1f}" if r else "-"  # noqa: E731
        ratio = f"{f['peak'] / c['peak']:.1f}" if f and c and c["peak"] > 0 else "-"
        lines.append(f"| {t} | {cell(f, 'peak')} | {cell(f, 'peak', t)} | {cell(f, 'largest')} | {cell(c, 'peak')} | "
                     f"{cell(c, 'peak', t)} | {cell(c, 'largest')} | {ratio} |")  # fmt: skip
    lines.append("")
    for path in ("full", "chunked"):
        pts = [(r["tokens"], r["peak"]) for r in rows if r["path"] == path]
        big = [(r["tokens"], r["largest"]) for r in rows if r["path"] == path]
        lines.append(f"- log-log slope over T, {path}: peak {_slope(pts):.2f}, largest allocation {_slope(big):.2f} "
                     f"(largest by `{max(rows, key=lambda r: (r['path'] == path, r['tokens']))['largest_op']}` at the longest T)")  # fmt: skip
    lines += [
        "",
        "peak = resident high-water mark above the inputs during one forward + backward; largest = the largest single",
        "allocation of an op (torch.profiler). The chunked path's work space is a fixed few 128-row chunks of fp32",
        "logits plus the fp32 weight gradient [V, H] (126 MiB here), so its per-token bytes fall as T grows.",
        f"Command: `python benchmarks/bench_logits_memory.py --out benchmarks/results/logits_memory_cpu.md`",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
