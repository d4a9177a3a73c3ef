"""A chaos run on the local Slurm: a tiny DS4 SFT job hit by seeded faults, restarted by the launcher after each.

    sudo .venv/bin/python benchmarks/chaos_slurm_sft.py --out benchmarks/results/chaos_slurm_sft.txt
    sudo .venv/bin/python benchmarks/chaos_slurm_sft.py --seed 7 --faults 4 --steps 12   # a shorter one

Issue 44, item 4 (the Slurm half). Brings up the local Slurm (``scripts/local_slurm.sh up``, 2 logical nodes; root,
as CI), runs ``scripts/slurm_submit.sh sft`` (``DS4_DEVICE=cpu``: the tiny DS4, CP=2 on 2 nodes x 1 process, a
checkpoint every ``--save-freq`` steps) once uninterrupted for the reference losses, then once more under
``--faults`` faults drawn from ``--seed`` (printed; a fresh one when not given) among the kinds the job must come
back from by itself (:data:`verl_ds4.testing.slurm_chaos.LAUNCHER_KINDS`): a rank SIGKILLed during a step, every
rank SIGKILLed inside a save, the pre-timeout USR1 (the job requeues itself) and ``scontrol requeue`` (as after a
node failure). The moments are events (a step printed, a save's files appearing), the ranks frozen while a fault
is injected, so the same seed gives the same schedule and the same landing steps.

It reports, per fault: the launcher's action, the attempt and the checkpoint the next one started from, how long
after the fault the launcher acted (the supervisor's restart written to ``restarts.json``, or the job back in
PENDING after a requeue) and how long until the next attempt trained its first step; then each step's loss in every
attempt against the uninterrupted run's (bit for bit, ``repr``), the checkpoints seen intact (all still there,
manifests unchanged, the full check passing), the unfinished saves renamed aside, and the processes left (none may
be). Exit status 1 when a check fails. The steps stay in the first epoch (``--n-train`` >= 16 x (steps + 1)): a
resume from a checkpoint written at an epoch's end does not continue exactly in verl 0.9.1's SFT trainer.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

from verl_ds4.ckpt_manifest import MANIFEST_NAME, verify_folder
from verl_ds4.cpu.sft_run import parse_losses
from verl_ds4.testing.slurm_chaos import ChaosJob, LocalSlurm, expect, free_port, marked_processes, plan

REPO = Path(__file__).resolve().parents[1]


def _env(slurm: LocalSlurm, work: Path, marker: str, args, name: str, max_restarts: int) -> dict[str, str]:
    return slurm.env(marker, DS4_DEVICE="cpu", NNODES="2", WORK_DIR=str(work), CLUSTER_LOG_DIR=str(work / "slurm"),
                     MASTER_PORT=str(free_port()), STEPS=str(args.steps), SAVE_FREQ=str(args.save_freq),
                     N_TRAIN=str(args.n_train), JOB_NAME=name, MAX_RESTARTS=str(max_restarts))


def _reference(slurm: LocalSlurm, root: Path, args, max_restarts: int) -> tuple[dict[int, float], float]:
    work = root / "reference"
    marker = uuid.uuid4().hex
    start = time.monotonic()
    job_id, _ = slurm.submit(["sft"], _env(slurm, work, marker, args, "ds4-sft-ref", max_restarts))
    info = slurm.wait(job_id)
    wall = time.monotonic() - start
    if info.get("JobState") != "COMPLETED":
        out = (work / "slurm" / f"ds4-sft-ref-{job_id}.out").read_text(errors="replace")
        raise SystemExit(f"the uninterrupted run failed: {info.get('JobState')}\n{out[-3000:]}")
    logs = sorted((work / "logs").glob("*-node0.log"))
    return parse_losses(logs[-1].read_text(errors="replace")), wall


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, help="the fault schedule's seed (default: a fresh one, printed)")
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-freq", type=int, default=2)
    parser.add_argument("--n-train", type=int, help="conversations (default 16 x (steps + 1): one epoch)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds any one wait may take")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (printed)")
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("the local Slurm runs its daemons as root: run this as root (scripts/local_slurm.sh up)", file=sys.stderr)
        return 2
    args.seed = random.SystemRandom().randrange(1 << 20) if args.seed is None else args.seed
    args.n_train = args.n_train or 16 * (args.steps + 1)
    faults = plan(args.seed, steps=args.steps, save_freq=args.save_freq, max_restarts=args.faults, n=args.faults)
    wants = expect(faults, steps=args.steps, save_freq=args.save_freq, max_restarts=args.faults)
    budget = max(1, sum(w.action in ("restart", "requeue") for w in wants))  # MAX_RESTARTS: exactly what it needs
    wants = expect(faults, steps=args.steps, save_freq=args.save_freq, max_restarts=budget)
    command = "python benchmarks/chaos_slurm_sft.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"seed {args.seed}: {len(faults)} faults in {args.steps} steps (a checkpoint every {args.save_freq}), "
          f"MAX_RESTARTS={budget}", flush=True)
    for i, f in enumerate(faults, 1):
        print(f"  {i:2d}. {f}", flush=True)

    root = Path(tempfile.mkdtemp(prefix="ds4-chaos-"))
    slurm = LocalSlurm(root / "slurm", nodes=2, timeout=args.timeout)
    load_start = os.getloadavg()[0]
    up = slurm.up()
    if up.returncode != 0:
        print(f"local_slurm.sh up failed:\n{up.stdout}{up.stderr}", file=sys.stderr)
        return 2
    marker = uuid.uuid4().hex
    run = ChaosJob(slurm, _env(slurm, root / "chaos", marker, args, "ds4-sft-chaos", budget), timeout=args.timeout,
                   say=lambda line: print(line, flush=True), faults=faults)
    failures: list[str] = []
    try:
        ref, ref_wall = _reference(slurm, root, args, budget)
        print(f"uninterrupted run: {len(ref)} steps in {ref_wall:.0f} s", flush=True)
        run.t0 = start = time.monotonic()
        run.submit()
        for fault, want in zip(faults, wants):
            run.hit(fault, want)
        info = run.finish()
        chaos_wall = time.monotonic() - start
    finally:
        for job in run.jobs:
            slurm.cancel(job)
        left_at_end = marked_processes(marker)
        down = slurm.down()
    load_end = os.getloadavg()[0]

    if info.get("JobState") != "COMPLETED" or info.get("ExitCode") != "0:0":
        failures.append(f"the chaos job ended {info.get('JobState')} {info.get('ExitCode')}")
    runs = [parse_losses(log.read_text(errors="replace")) for log in run.attempt_logs()]
    trained = [s for r in runs for s in r]
    unequal = [(i + 1, s, v, ref.get(s)) for i, r in enumerate(runs) for s, v in r.items() if ref.get(s) != v]
    if unequal:
        failures.append(f"{len(unequal)} step loss(es) differ from the uninterrupted run's: {unequal[:5]}")
    if set(trained) != set(ref):
        failures.append(f"steps trained {sorted(set(trained))} != {sorted(ref)}")
    for r, f, w in zip(run.records, faults, wants):
        if r["landed_after_step"] != w.failed_at - 1 or r["first_step_after"] != (w.newest or 0) + 1:
            failures.append(f"{f}: landed after step {r['landed_after_step']}, next attempt began at step "
                            f"{r['first_step_after']} (expected {w.failed_at - 1}, {(w.newest or 0) + 1})")
        if r["left_behind"]:
            failures.append(f"{f}: processes of the stopped attempt left: {r['left_behind']}")
    ckpt = run.ckpt
    changed = [name for name, manifest in run.intact.items()
               if not (ckpt / name / MANIFEST_NAME).is_file() or (ckpt / name / MANIFEST_NAME).read_bytes() != manifest
               or verify_folder(ckpt / name, full=True, require_manifest=True)]
    if changed:
        failures.append(f"intact checkpoints deleted or changed: {changed}")
    aside = sorted(p.name for p in ckpt.glob("damaged_global_step_*"))
    kills_in_save = sum(f.kind == "kill_in_save" for f in faults)
    if len(aside) != kills_in_save:
        failures.append(f"{len(aside)} damaged step folder(s) renamed aside for {kills_in_save} kill(s) in a save")
    if left_at_end:
        failures.append(f"processes left after the run: {left_at_end}")
    daemons = [n for n, pid in slurm.daemon_pids().items() if Path(f"/proc/{pid}").exists()]

    lines = [f"# {command}",
             f"# {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, load average {load_start:.1f} at the start, "
             f"{load_end:.1f} at the end (other jobs shared this machine: absolute times are inflated)",
             f"seed {args.seed}: {len(faults)} faults; scripts/slurm_submit.sh sft, DS4_DEVICE=cpu, 2 nodes x 1 process, "
             f"CP=2, STEPS={args.steps} SAVE_FREQ={args.save_freq} N_TRAIN={args.n_train} MAX_RESTARTS={budget}",
             f"uninterrupted run: {ref_wall:.0f} s (submission to the end); the chaos run: {chaos_wall:.0f} s, "
             f"{len(run.jobs)} job(s), {len(runs)} attempts, {len(trained)} steps trained for {len(ref)}",
             "",
             "## Each fault, the launcher's action and the restart time",
             "(acted: the fault to the supervisor's restart in restarts.json, or to the job PENDING again after a "
             "requeue; next step: the fault to the next attempt's first training step printed)",
             f"{'#':>2}  {'fault':38s} {'after':>5}  {'action':36s} {'from':>4}  {'acted s':>7}  {'next step s':>11}"]
    actions = {"restart": "supervisor restarts the srun step", "requeue": "stopped; the job requeues itself",
               "slurm requeue": "Slurm requeues the job", "resubmit": "cancelled; submitted again"}
    for i, (r, f, w) in enumerate(zip(run.records, faults, wants), 1):
        lines.append(f"{i:>2}  {str(f):38s} {r['landed_after_step']:>5}  {actions[w.action]:36s} "
                     f"{w.newest or 0:>4}  {r['action_s']:>7.1f}  {r['first_step_s']:>11.1f}")
    acted = sorted(r["action_s"] for r in run.records)
    nexts = sorted(r["first_step_s"] for r in run.records)
    by_kind = {k: sorted(r["first_step_s"] for r, f in zip(run.records, faults) if f.kind == k)
               for k in sorted({f.kind for f in faults})}
    lines += [f"(after: the last step printed when the fault hit; from: the checkpoint step the next attempt resumed "
              f"from, 0 = scratch)",
              f"median: acted {acted[len(acted) // 2]:.1f} s, next step {nexts[len(nexts) // 2]:.1f} s; next step by "
              "kind, min-max s: " + ", ".join(f"{k} {v[0]:.1f}-{v[-1]:.1f} ({len(v)})" for k, v in by_kind.items()),
              "",
              "## Each step's loss: the uninterrupted run's, and every attempt that trained it",
              f"{'step':>4}  {'uninterrupted':>20}  {'trained':>7}  equal"]
    for step in sorted(ref):
        seen = [r[step] for r in runs if step in r]
        lines.append(f"{step:>4}  {ref[step]!r:>20}  {len(seen):>7}  "
                     f"{'yes (bit for bit)' if seen and all(v == ref[step] for v in seen) else 'NO'}")
    lines += ["",
              "## What is left",
              f"intact checkpoints seen: {len(run.intact)} ({', '.join(sorted(run.intact, key=lambda n: int(n.split('_')[-1])))}): "
              f"{'all there, manifests unchanged, full check passing' if not changed else 'CHANGED: ' + ', '.join(changed)}",
              f"unfinished saves renamed aside: {len(aside)} ({', '.join(aside) or 'none'})",
              f"processes of the jobs left: {len(left_at_end)} at the end; after each fault, of the stopped attempt: "
              f"{sum(len(r['left_behind']) for r in run.records)}",
              f"local Slurm down: {'its daemons stopped' if not daemons else 'STILL RUNNING: ' + ', '.join(daemons)}",
              "",
              "result: " + ("every check passed" if not failures else "FAILED:\n  " + "\n  ".join(failures))]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    if args.keep:
        print(f"work folder kept: {root}")
    else:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    if down.returncode != 0:
        print(down.stdout + down.stderr, file=sys.stderr)
    return 1 if failures or daemons else 0


if __name__ == "__main__":
    raise SystemExit(main())
