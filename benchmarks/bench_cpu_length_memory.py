"""Each rank's peak memory against the tokens it holds: the CPU SFT job (tiny DS4) at several lengths and CP sizes.

For every ``LENGTH:CP`` case it runs ``scripts/run_ds4_proxy_sft_cpu.sh`` (verl's SFT trainer under torchrun) with
``TASK=long MAX_SEQ_LEN=LENGTH`` (one row of about LENGTH tokens per step, ``BATCH=1``), ``NPROC=CP CP=CP`` (each
rank holds LENGTH / CP tokens of the one sequence) for ``--steps`` steps, and samples every rank's ``VmHWM`` (the
kernel's high-water mark of the process's resident set, /proc/<pid>/status) every 0.2 s while it runs: a rank's peak
is the largest value read (VmHWM never falls, so only a peak in the last 0.2 s before the rank exits could be
missed). The ranks are the launcher's descendants whose environment has torchrun's ``RANK``.

Run it under ``MALLOC_MMAP_THRESHOLD_=131072`` (glibc) to measure what the ranks hold: with glibc's default the row
chunks' many transient buffers fragment the heap, and the resident set grows with T x T/CP beyond it (recorded in each
row). It writes a markdown table (peak per rank, MiB) and a least-squares line ``peak = a + b x tokens per rank`` over the
cases (with each case's residual), and a JSON-lines file of the raw numbers.

    python benchmarks/bench_cpu_length_memory.py --cases 2048:4,4096:4,8192:4,16384:4,16384:2 \\
        --out benchmarks/results/cpu_length_memory
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _descendants(pid: int) -> list[int]:
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in _children(p):
            seen.append(c)
            todo.append(c)
    return seen


def _rank_and_hwm(pid: int) -> tuple[int, int] | None:
    """(torchrun RANK, VmHWM in KiB) of a rank process, None for any other process."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    if b"verl.trainer.sft_trainer" not in cmd or b"torch.distributed.run" in cmd:
        return None
    rank = next((int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"RANK=")), None)
    hwm = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
    return None if rank is None or hwm is None else (rank, int(hwm.group(1)))


def run_case(length: int, cp: int, steps: int, python: str, port: int, work: Path) -> dict:
    env = dict(os.environ, PYTHON=python, NPROC=str(cp), CP=str(cp), MAX_SEQ_LEN=str(length),
               MAX_POSITIONS=str(max(length, 4096)), TASK="long", N_TRAIN="2", BATCH="1", MICRO_BATCH="1",
               STEPS=str(steps), SAVE_FREQ="1000", RESUME_MODE="disable", MASTER_PORT=str(port),
               WORK_DIR=str(work / f"len{length}_cp{cp}"), PYTHONPATH=str(ROOT))
    cmd = ["bash", str(ROOT / "scripts" / "run_ds4_proxy_sft_cpu.sh")]
    start = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, int] = {}
    import threading

    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None:
        for pid in _descendants(proc.pid):
            got = _rank_and_hwm(pid)
            if got:
                peaks[got[0]] = max(peaks.get(got[0], 0), got[1])
        time.sleep(0.2)
    reader.join(timeout=10)
    text = "".join(lines)
    if proc.returncode != 0:
        raise RuntimeError(f"case {length}:{cp} failed (exit {proc.returncode}):\n{text[-3000:]}")
    speed = re.search(r"speed\s+(\d+) tokens/s", text)
    losses = [float(x) for x in re.findall(r"step \d+/\d+ \| loss ([0-9.]+)", text)]
    return {"length": length, "cp": cp, "tokens_per_rank": length / cp, "steps": steps,
            "peak_mib": {r: round(k / 1024, 1) for r, k in sorted(peaks.items())},
            "tokens_per_s": int(speed.group(1)) if speed else None, "losses": losses,
            "wall_s": round(time.time() - start, 1), "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_")}


def fit(columns: list[list[float]], ys: list[float]) -> tuple[list[float], list[float]]:
    """Least squares ``y = sum_k c_k x_k``: (coefficients, residuals)."""
    import numpy as np

    x = np.array(columns, dtype=float).T
    coef, *_ = np.linalg.lstsq(x, np.array(ys, dtype=float), rcond=None)
    return coef.tolist(), (np.array(ys) - x @ coef).tolist()


def table(rows: list[dict], command: str) -> str:
    t = [float(r["length"]) for r in rows]
    per = [r["tokens_per_rank"] for r in rows]
    ys = [max(r["peak_mib"].values()) for r in rows]
    ones = [1.0] * len(rows)
    (a1, b1), res1 = fit([ones, per], ys)
    (a2, b2, c2), res2 = fit([ones, per, [x * n for x, n in zip(t, per)]], ys)
    out = [
        "# CPU SFT (tiny DS4): each rank's peak memory against the tokens it holds",
        "",
        "Commands: " + ", ".join(f"`{c}`" for c in dict.fromkeys(r.get("command", command) for r in rows)),
        "",
        "Peak = VmHWM (the kernel's resident-set high-water mark) of each torchrun rank, sampled every 0.2 s; one row "
        "of about LENGTH tokens per step (TASK=long, BATCH=1), spread over CP ranks (NPROC=CP, DP 1), fp32, "
        "2 CPU cores shared with other jobs (times are loaded-machine times). glibc's MALLOC_MMAP_THRESHOLD_: "
        + ", ".join(sorted({str(r.get("MALLOC_MMAP_THRESHOLD_")) for r in rows}))
        + " (None: glibc's dynamic default; 131072: every block above 128 KiB is mmap-ed and returned when freed).",
        "",
        "| length T | CP | tokens per rank T/CP | peak per rank (MiB, rank 0..CP-1) | max | linear fit | residual "
        "| fit with T x T/CP | residual | tokens/s |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r, x, y, e1, e2 in zip(rows, per, ys, res1, res2):
        ranks = ", ".join(f"{v:.0f}" for v in r["peak_mib"].values())
        out.append(f"| {r['length']} | {r['cp']} | {x:.0f} | {ranks} | {y:.0f} | {y - e1:.0f} | {e1:+.0f} | {y - e2:.0f} | "
                   f"{e2:+.0f} | {r['tokens_per_s']} |")
    out += [
        "",
        f"Linear in tokens per rank: peak = {a1:.0f} MiB + {b1 * 1024:.1f} MiB per 1,024 tokens per rank (largest "
        f"residual {max(res1, key=abs):+.0f} MiB).",
        "",
        f"With a term in T x T/CP (each of a rank's rows against every token of the sequence): peak = {a2:.0f} MiB + "
        f"{b2 * 1024:.1f} MiB per 1,024 tokens per rank + {c2 * 2**20:.2f} bytes x T x T/CP (largest residual "
        f"{max(res2, key=abs):+.0f} MiB).",
    ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="2048:4,4096:4,8192:4,16384:4",
                        help="comma-separated LENGTH:CP (default 2048:4,4096:4,8192:4,16384:4)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--port", type=int, default=29891)
    parser.add_argument("--work", default="runs/bench_cpu_length_memory")
    parser.add_argument("--out", default="benchmarks/results/cpu_length_memory", help="writes OUT.md and OUT.jsonl")
    parser.add_argument("--table-only", action="store_true", help="write OUT.md from the rows already in OUT.jsonl")
    args = parser.parse_args(argv)
    command = "python benchmarks/bench_cpu_length_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.table_only:
        rows = [json.loads(line) for line in Path(args.out).with_suffix(".jsonl").read_text().splitlines() if line.strip()]
        Path(args.out).with_suffix(".md").write_text(table(rows, command))
        print(Path(args.out).with_suffix(".md").read_text())
        return 0
    cases = [tuple(int(v) for v in c.split(":")) for c in args.cases.split(",")]
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    jsonl = out.with_suffix(".jsonl")
    for length, cp in cases:
        row = run_case(length, cp, args.steps, args.python, args.port, Path(args.work)) | {"command": command}
        print(json.dumps(row), flush=True)
        rows.append(row)
        with jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
    if len(rows) >= 2:
        out.with_suffix(".md").write_text(table(rows, command))
        print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
