"""A chaos run on a real two-node Ray cluster: a tiny DS4 GRPO job hit by seeded faults, restarted by the launcher.

    python benchmarks/chaos_ray_grpo.py --out benchmarks/results/chaos_ray_grpo.txt
    python benchmarks/chaos_ray_grpo.py --seed 7 --faults 3 --steps 8     # a shorter one

Issue 44, item 4 (the Ray half). Starts a head and a worker node on this host (``scripts/ray_cluster.sh``), runs
``ray_cluster.sh submit grpo`` (``DS4_DEVICE=cpu``: the tiny DS4, CP=2 on 2 nodes x 1 process, a checkpoint every
``--save-freq`` steps) once uninterrupted for the reference metrics, then once more under ``--faults`` faults drawn
from ``--seed`` (printed; a fresh one when not given) among :data:`verl_ds4.testing.ray_chaos.KINDS`: the worker node
lost (every process of it SIGKILLed, then a replacement node started), one trainer rank SIGKILLed during a step,
the actor's rank 0 SIGKILLed inside a save. The moments are events (the driver held where it moves to a step, rank 0
held inside a save), so the same seed gives the same schedule.

It reports, per fault: the launcher's action, the checkpoint the next attempt started from, how long after the fault
the launcher acted (its restart line) and how long until the next attempt trained its first step; then each step's
metrics in every attempt against the uninterrupted run's (bit for bit, ``==``), the checkpoints left intact, the
unfinished saves renamed aside, and the processes left (none may be). Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from verl_ds4.testing.ray_chaos import KINDS, RESUME_KEYS, RayChaos, attempt_metrics, expect, intact_checkpoints, plan


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, help="the fault schedule's seed (default: a fresh one, printed)")
    parser.add_argument("--faults", type=int, default=6)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--save-freq", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900, help="seconds any one wait may take")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (printed)")
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args(argv)
    args.seed = random.SystemRandom().randrange(1 << 20) if args.seed is None else args.seed
    rng = random.Random(args.seed)
    kinds = list(KINDS) * (args.faults // len(KINDS)) + rng.sample(KINDS, args.faults % len(KINDS))
    faults = plan(args.seed, steps=args.steps, save_freq=args.save_freq, max_restarts=args.faults, kinds=kinds)
    froms = expect(faults, steps=args.steps, save_freq=args.save_freq, max_restarts=args.faults)
    root = Path(tempfile.mkdtemp(prefix="ds4-ray-chaos-"))
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    say(f"seed {args.seed}: {len(faults)} faults; scripts/ray_cluster.sh submit grpo, DS4_DEVICE=cpu, 2 Ray nodes x 1 "
        f"process, CP=2, STEPS={args.steps} SAVE_FREQ={args.save_freq} MAX_RESTARTS={args.faults}")
    ok = True
    chaos = RayChaos(root, steps=args.steps, save_freq=args.save_freq, max_restarts=args.faults, timeout=args.timeout)
    try:
        chaos.start("head")
        chaos.start("worker")
        chaos.wait_nodes()
        start = time.monotonic()
        status, _, out = chaos.submit(root / "reference", name="reference", max_restarts=0)  # one attempt, no fault
        ref_wall = time.monotonic() - start
        if status != 0:
            raise SystemExit(f"the uninterrupted run failed (exit {status}):\n{out[-4000:]}")
        [ref] = attempt_metrics(root / "reference")
        start = time.monotonic()
        status, records, out = chaos.submit(root / "chaos", faults=faults, name="chaos")
        wall = time.monotonic() - start
        attempts = attempt_metrics(root / "chaos")
        trained = sum(len(a) for a in attempts)
        say(f"uninterrupted run: {ref_wall:.0f} s (submission to the end); the chaos run: {wall:.0f} s, exit {status}, "
            f"{len(attempts)} attempts, {trained} steps trained for {args.steps}")
        ok &= status == 0

        say("\n## Each fault, the launcher's action and the restart time")
        say("(acted: the fault to the supervisor's restart line; next step: the fault to the next attempt's first "
            "training step printed)")
        say(f"{'#':>2}  {'fault':<36} {'after':>5}  {'action':<40} {'from':>4}  {'acted s':>7}  {'next step s':>11}")
        for i, (record, want) in enumerate(zip(records, froms), 1):
            action = "driver restarted" + (", replacement node started" if record.fault.kind == "kill_node" else "")
            got = record.resumed_from
            say(f"{i:>2}  {str(record.fault):<36} {record.after or 0:>5}  {action:<40} {got or 0:>4}  "
                f"{record.acted_s:>7}  {record.next_step_s:>11}")
            if got != want:
                say(f"    expected the next attempt to start from {want or 0}, it started from {got or 0}")
                ok = False
            if record.left:
                say(f"    processes the fault killed still alive: {record.left}")
                ok = False
        say("(after: the last step printed when the fault hit; from: the checkpoint step the next attempt resumed from, "
            "0 = scratch)")
        by_kind: dict[str, list[float]] = {}
        for record in records:
            by_kind.setdefault(record.fault.kind, []).append(record.next_step_s)
        say("next step by kind, min-max s: " + ", ".join(f"{k} {min(v)}-{max(v)} ({len(v)})"
                                                        for k, v in sorted(by_kind.items())))

        say("\n## Each step's metrics: the uninterrupted run's, and every attempt that trained it")
        say(f"compared bit for bit (==): {', '.join(RESUME_KEYS)}")
        say(f"{'step':>4}  {'reward (uninterrupted)':>22}  {'pg_loss (uninterrupted)':>24}  trained  equal")
        for step in range(1, args.steps + 1):
            runs = [a[step] for a in attempts if step in a]
            equal = bool(runs) and all(all(r[k] == ref[step][k] for k in RESUME_KEYS) for r in runs)
            ok &= equal
            say(f"{step:>4}  {ref[step]['critic/score/mean']!r:>22}  {ref[step]['actor/pg_loss']!r:>24}  "
                f"{len(runs):>7}  {'yes (bit for bit)' if equal else 'NO'}")
            if not equal:
                for r in runs:
                    say(f"        {({k: (ref[step][k], r[k]) for k in RESUME_KEYS if r[k] != ref[step][k]})}")

        say("\n## What is left")
        intact = intact_checkpoints(root / "chaos" / "checkpoints")
        want_intact = [f"global_step_{s}" for s in range(args.save_freq, args.steps + 1, args.save_freq)]
        if args.steps % args.save_freq:
            want_intact.append(f"global_step_{args.steps}")
        say(f"intact checkpoints: {len(intact)} ({', '.join(intact)})"
            f"{'' if sorted(intact) == sorted(want_intact) else f'; expected {want_intact}'}")
        ok &= sorted(intact) == sorted(want_intact)
        aside = sorted(p.name for p in (root / "chaos" / "checkpoints").iterdir() if p.name.startswith("damaged_"))
        say(f"unfinished saves renamed aside: {len(aside)} ({', '.join(aside)})")
        ok &= len(aside) == sum(f.kind == "kill_in_save" for f in faults)
    finally:
        chaos.stop()
    deadline = time.monotonic() + 120
    while (left := chaos.left()) and time.monotonic() < deadline:
        time.sleep(0.5)
    say(f"processes of the cluster and the jobs left after the nodes stopped: {len(left)}")
    ok &= not left
    shutil.rmtree(chaos.temp, ignore_errors=True)
    say(f"\nresult: {'every check passed' if ok else 'a check FAILED'}")
    if args.keep:
        print(f"work folder kept: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    if args.out:
        header = (f"# python benchmarks/chaos_ray_grpo.py --seed {args.seed} --faults {args.faults} --steps "
                  f"{args.steps} --out {args.out}\n# {time.strftime('%Y-%m-%d')}, "
                  f"{len(os.sched_getaffinity(0))} CPU cores, load average {os.getloadavg()[0]:.1f} at the end\n")
        Path(args.out).write_text(header + "\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
