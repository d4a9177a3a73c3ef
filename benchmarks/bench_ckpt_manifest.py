"""What checkpoint manifests cost: the save of the main job's checkpoint with and without its manifest, and
the start-up check's time per injected fault.

    python benchmarks/bench_ckpt_manifest.py --out benchmarks/results/ckpt_manifest_cpu.txt
    python benchmarks/bench_ckpt_manifest.py --ckpt runs/ds4_sft_cpu/checkpoints --log runs/ds4_sft_cpu/logs/latest.log

Without ``--ckpt`` it runs the main job itself (``scripts/run_ds4_proxy_sft_cpu.sh``: the tiny DS4, CP=2 on
2 CPU processes) for 4 steps with a checkpoint every 2 (``STEPS=4 SAVE_FREQ=2 N_TRAIN=64``; the checkpoint's
files do not depend on the step count) into a temporary folder, then measures, on its checkpoints:

* **in the run**: each save's engine part (verl's log: rank 0's ``will save model shards`` to its
  ``Wrote checkpoint contents manifest``, millisecond timestamps) and the manifest's write time the save
  printed (``[verl-ds4] checkpoint manifest ... written in``): the save without the manifest and what the
  manifest adds;
* **offline, repeated** on the newest step folder (its files in the page cache, as right after a save):
  ``write_manifest`` with sampled CRC-32s (the default) and whole-file CRC-32s (``VERL_DS4_CKPT_CHECKSUM=full``),
  the start-up check's ``verify_folder`` (sizes) and the full check (``verl-ds4 doctor --checkpoint``);
* **per fault** (:mod:`verl_ds4.testing.ckpt_faults`, each injected into a fresh copy of the checkpoints):
  the start-up check's decision (:func:`verl_ds4.recipes.ckpt_resume.choose_resume`, renaming and tracker
  update included) and its time, median of ``--repeats`` copies; and once, the launcher's command
  ``python -m verl_ds4.recipes.ckpt_resume -- <overrides>`` with the Python start.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from verl_ds4 import ckpt_manifest as cm
from verl_ds4.recipes.ckpt_resume import choose_resume
from verl_ds4.testing.ckpt_faults import FAULTS, inject

REPO = Path(__file__).resolve().parents[1]
_STAMP = r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]"


def run_main_job(work: Path) -> tuple[Path, Path, float]:
    env = dict(os.environ, STEPS="4", SAVE_FREQ="2", N_TRAIN="64", WORK_DIR=str(work), PYTHON=sys.executable,
               MASTER_PORT=str(_free_port()))
    start = time.monotonic()
    proc = subprocess.run(["bash", "scripts/run_ds4_proxy_sft_cpu.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1800)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"the main job failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return work / "checkpoints", work / "logs" / "latest.log", wall


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def saves_from_log(log: Path) -> list[tuple[int, float, float]]:
    """[(step, engine save seconds, manifest seconds)] from the run's log."""
    text = log.read_text(errors="replace")
    begin = re.findall(_STAMP + r"[^\n]*\[Rank 0\] model/dist_ckpt will save model shards", text)
    ends = re.findall(_STAMP + r"[^\n]*\[Rank 0\] Wrote checkpoint contents manifest to \S*global_step_(\d+)", text)
    manifests = [float(s) for s in re.findall(r"\[verl-ds4\] checkpoint manifest \S+ written in ([0-9.]+) s", text)]
    fmt = "%Y-%m-%d %H:%M:%S,%f"
    rows = []
    for i, (end, step) in enumerate(ends):
        seconds = (dt.datetime.strptime(end, fmt) - dt.datetime.strptime(begin[i], fmt)).total_seconds()
        rows.append((int(step), seconds, manifests[i] if i < len(manifests) else float("nan")))
    return rows


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", help="a trainer.default_local_dir with >= 2 checkpoints (default: run the main job)")
    parser.add_argument("--log", help="the run's full log (for the in-run save times); with --ckpt")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args(argv)

    lines = [f"# python benchmarks/bench_ckpt_manifest.py {' '.join(argv if argv is not None else sys.argv[1:])}",
             f"# {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, load average "
             f"{os.getloadavg()[0]:.1f} at the start (other jobs ran on this machine: absolute times are inflated)"]
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp:
        tmp = Path(tmp)
        if args.ckpt:
            ckpt, log, wall = Path(args.ckpt), Path(args.log) if args.log else None, None
        else:
            ckpt, log, wall = run_main_job(tmp / "job")
            lines.append(f"main job: scripts/run_ds4_proxy_sft_cpu.sh STEPS=4 SAVE_FREQ=2 N_TRAIN=64 in {wall:.0f} s")
        steps = cm.step_folders(ckpt)
        newest = steps[max(steps)]
        files = [p for p in newest.rglob("*") if p.is_file() and p.name != cm.MANIFEST_NAME]
        size = sum(p.stat().st_size for p in files)
        lines.append(f"checkpoint: {newest.name}, {len(files)} files, {size / 1e6:.2f} MB (+ the manifest, "
                     f"{(newest / cm.MANIFEST_NAME).stat().st_size} bytes)")

        lines.append("\n## In the run: each save, without and with its manifest (rank 0; seconds)")
        if log is not None and log.is_file():
            lines.append("step  engine save (no manifest)  manifest  added")
            for step, seconds, manifest in saves_from_log(log):
                lines.append(f"{step:4d}  {seconds:25.3f}  {manifest:8.3f}  {100 * manifest / seconds:5.2f} %")
            lines.append("(the engine save: verl's log, rank 0's 'will save model shards' to its 'Wrote checkpoint "
                         "contents manifest'; the step's data_<dp>.pt files and barriers come on top, so the added "
                         "share of the whole save is smaller still)")
        else:
            lines.append("(no log given)")

        lines.append(f"\n## Offline, {newest.name}, median of {args.repeats} (ms)")
        work = tmp / "copy"
        shutil.copytree(newest, work)
        for label, fn in (
            ("write_manifest, sampled CRC-32 (default)", lambda: cm.write_manifest(work, global_step=0)),
            ("write_manifest, whole-file CRC-32 (VERL_DS4_CKPT_CHECKSUM=full)",
             lambda: cm.write_manifest(work, global_step=0, full=True)),
            ("start-up check of one step (sizes: verify_folder)", lambda: cm.verify_folder(work)),
            ("full check of one step (checksums: doctor --checkpoint)", lambda: cm.verify_folder(work, full=True)),
        ):
            lines.append(f"{label:66s} {1e3 * timed(fn, args.repeats):7.2f}")

        lines.append(f"\n## The start-up check per injected fault (choose_resume, median of {args.repeats} fresh "
                     "copies; ms)")
        lines.append(f"{'fault':32s} {'next start':42s} {'check ms':>8s}")
        for fault in ["none", *FAULTS]:
            times, decided = [], None
            for i in range(args.repeats):
                copy = tmp / f"{fault}_{i}"
                shutil.copytree(ckpt, copy)
                if fault != "none":
                    inject(fault, copy)
                result = choose_resume(copy, "auto")
                times.append(result.seconds)
                how = ", newest renamed aside" if result.moved else \
                    ", tracker set to it" if result.tracker_set is not None else ""
                decided = f"resumes from step {result.step}{how}"
                shutil.rmtree(copy)
            lines.append(f"{fault:32s} {decided:42s} {1e3 * statistics.median(times):8.2f}")
        copy = tmp / "cli"
        shutil.copytree(ckpt, copy)
        inject("shard_cut_short", copy)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "verl_ds4.recipes.ckpt_resume", "--",
                               f"trainer.default_local_dir={copy}", "trainer.resume_mode=auto"],
                              capture_output=True, text=True, cwd=REPO)
        cli = time.perf_counter() - t0
        last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
        lines.append(f"\nthe launcher's command on shard_cut_short, Python start included: {1e3 * cli:.0f} ms "
                     f"(exit {proc.returncode}): {last.replace(str(copy), '<ckpt>')}")
    report = "\n".join(lines) + "\n"
    print(report, end="")
    if args.out:
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
