"""What async saves cost on the CPU: the same CPU SFT job with synchronous and with Megatron's async saves.

    .venv/bin/python benchmarks/async_save_cpu.py --out benchmarks/results/async_save_cpu.txt
    .venv/bin/python benchmarks/async_save_cpu.py --steps 12 --save-freq 3      # more saves

Issue 44, item 2. Runs verl's SFT trainer on the tiny DS4 (2 processes, CP 2, ``SAVE_FREQ`` steps between saves)
twice in one invocation, ``checkpoint.async_save`` False then True, the same seed and data, and reports for each save
how long it held the ranks before training went on (verl-ds4 prints it: ``save of step N returned to training after
X s``), for the async run how long after it was scheduled the save was finalised on every rank (Megatron's
``.metadata``, verl's contents file, the manifest, the tracker), the run's wall time, and whether the two runs' losses
are equal bit for bit (they must be: async saves change when the files are written, not the training). The
checkpoints of both runs are verified in full at the end. Exit status 1 when the losses differ or a checkpoint is
not intact.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from verl_ds4.ckpt_manifest import step_folders, verify_step
from verl_ds4.cpu.sft_data import prepare_cpu_sft_assets
from verl_ds4.cpu.sft_run import cpu_env, parse_losses, sft_command

REPO = Path(__file__).resolve().parents[1]
RETURNED = re.compile(r"save of step (\d+) returned to training after ([0-9.]+) s \((sync|async)\)")
FINALISED = re.compile(r"async save of step (\d+) finalised on every rank ([0-9.]+) s after it was scheduled")


def run(assets: dict, ckpt: Path, steps: int, save_freq: int, async_save: bool) -> dict:
    extra = ["checkpoint.save_contents=[model,optimizer,extra]"] + (["+checkpoint.async_save=True"] if async_save else [])
    cmd = sft_command(assets, ckpt_dir=ckpt, steps=steps, cp=2, save_freq=save_freq, extra=extra)
    start = time.monotonic()
    done = subprocess.run(cmd, env=cpu_env(), cwd=REPO, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - start
    text = done.stdout + done.stderr
    if done.returncode != 0:
        raise SystemExit(f"the {'async' if async_save else 'sync'} run failed (exit {done.returncode}):\n{text[-4000:]}")
    return {"wall": wall, "losses": parse_losses(done.stdout),
            "returned": {int(s): float(t) for s, t, _ in RETURNED.findall(text)},
            "finalised": {int(s): float(t) for s, t in FINALISED.findall(text)},
            "intact": {s: verify_step(ckpt, s, full=True) == [] for s in step_folders(ckpt)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-freq", type=int, default=2)
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args(argv)
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    with tempfile.TemporaryDirectory(prefix="ds4-async-bench-") as tmp:
        assets = prepare_cpu_sft_assets(Path(tmp) / "assets", model="ds4", n_train=16 * (args.steps + 1))
        results = {}
        for kind in ("sync", "async"):
            print(f"[bench] {kind} saves: {args.steps} steps, a save every {args.save_freq} ...", flush=True)
            results[kind] = run(assets, Path(tmp) / kind, args.steps, args.save_freq, kind == "async")
    sync, asyn = results["sync"], results["async"]
    say(f"CPU SFT job (tiny DS4, 2 processes, CP 2), {args.steps} steps, a save every {args.save_freq} steps "
        "(model, optimizer, extra); one invocation, sync run first")
    say(f"{'save of step':>12}  {'sync: held the ranks':>21}  {'async: held the ranks':>22}  {'async: finalised after':>23}")
    for step in sorted(set(sync["returned"]) | set(asyn["returned"])):
        s, a, f = sync["returned"].get(step), asyn["returned"].get(step), asyn["finalised"].get(step)
        say(f"{step:>12}  {s if s is not None else float('nan'):>19.2f} s  {a if a is not None else float('nan'):>20.2f} s"
            f"  {f if f is not None else float('nan'):>21.2f} s")
    held = {k: statistics.median(r["returned"].values()) for k, r in results.items() if r["returned"]}
    say(f"median time a save held the ranks: sync {held.get('sync', float('nan')):.2f} s, async "
        f"{held.get('async', float('nan')):.2f} s (ratio async / sync {held.get('async', 0) / held.get('sync', 1):.2f})")
    say(f"run wall time: sync {sync['wall']:.1f} s, async {asyn['wall']:.1f} s (ratio {asyn['wall'] / sync['wall']:.2f})")
    equal = sync["losses"] == asyn["losses"] and sorted(sync["losses"]) == list(range(1, args.steps + 1))
    say(f"losses equal bit for bit: {equal} ({ {k: repr(v) for k, v in asyn['losses'].items()} })")
    intact = all(sync["intact"].values()) and all(asyn["intact"].values()) and sync["intact"].keys() == asyn["intact"].keys()
    say(f"every checkpoint intact (full check): {intact} (sync steps {sorted(sync['intact'])}, async steps "
        f"{sorted(asyn['intact'])}); every async save finalised: {sorted(asyn['finalised']) == sorted(asyn['returned'])}")
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0 if equal and intact and sorted(asyn["finalised"]) == sorted(asyn["returned"]) else 1


if __name__ == "__main__":
    sys.exit(main())
