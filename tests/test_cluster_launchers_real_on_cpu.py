"""The cluster launchers for real, on this one machine: a real Slurm and a real two-node Ray cluster.

Nothing here is a stand-in: Debian's Slurm (``scripts/local_slurm.sh up``: munged, slurmctld and two
``slurmd -N`` logical nodes on this host, installed with apt when missing), real ``ray start`` nodes,
verl's own trainers. The launchers are the ones a user submits on GPUs, with the CPU switch
``DS4_DEVICE=cpu`` (device, local launcher and process counts; nothing else):

* ``slurm_submit.sh sft``: the tiny DS4 SFT job (the CPU main job's settings, CP=2 contiguous) on 2
  nodes x 1 process, torchrun's rendezvous from the job's node list; an uninterrupted run, then the chaos run
  (``verl_ds4.testing.slurm_chaos``): one run hit, in an order and at moments a seed draws, by a SIGKILL of
  every rank inside a save, a rank SIGKILLed during a step, the pre-timeout USR1 and a ``scancel`` followed by
  the same submission. The launcher restarts the run (or the job requeues itself) after each; at the end every
  step's loss equals the uninterrupted run's bit for bit, every intact checkpoint is still there, and nothing of
  any job survives.
* ``ray_cluster.sh``: a head and a worker node on this host (own ports, temp dir, logical resources),
  ``wait-nodes 2``, ``submit grpo`` with ``MAX_RESTARTS=1``: the worker node is lost at a moment a seed draws
  (``verl_ds4.testing.ray_chaos``: every process of it SIGKILLed, a replacement node started), the launcher in the
  job restarts the driver, which resumes from the newest intact checkpoint; the step trained before and after the
  fault gives the same metrics bit for bit; actor and rollout workers ran on both nodes (by node id, from Ray's
  state API); a third node that never joins makes ``wait-nodes`` time out naming the count and the address;
  ``stop`` leaves no process.
* ``slurm_submit.sh ppo``: the Ray head on the first node, a worker on the second, the CPU PPO recipe,
  Ray torn down; the job's exit status is the trainer's (a failing trainer's status comes back); a worker
  whose ``ray start`` exits ends the job within seconds with its log tail.
* Bad input refused before any node starts: no MODEL_PATH on a GPU run, NNODES against the
  allocation, a node list that does not parse, a port in use.

Every job and node runs with a marker in its environment; after each, no process carrying it may be
left. The daemons the fixture started are stopped by PID at the end, whatever happened.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from verl_ds4.ckpt_manifest import MANIFEST_NAME, verify_folder
from verl_ds4.cpu.sft_run import parse_losses
from verl_ds4.rollout.cpu_ppo_run import parse_step_metrics
from verl_ds4.testing.ray_chaos import RESUME_KEYS as RAY_RESUME_KEYS
from verl_ds4.testing.ray_chaos import RayChaos, attempt_metrics, intact_checkpoints
from verl_ds4.testing.ray_chaos import expect as ray_expect
from verl_ds4.testing.ray_chaos import plan as ray_plan
from verl_ds4.testing.slurm_chaos import (SIGKILL_REASON, ChaosJob, LocalSlurm, expect, free_port,
                                          marked_processes, plan, save_steps)

REPO = Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = int(os.environ.get("VERL_DS4_CLUSTER_TEST_TIMEOUT_S", "600"))
# 128 conversations, batch 16: the 6 steps stay in the first epoch. (Resuming from a checkpoint written at the end
# of an epoch does not continue exactly in verl 0.9.1's SFT trainer: with 64 conversations, a resume from step 4
# gave step 5 a loss of 3.3643 against 3.3984 uninterrupted, the same on one node without Slurm.)
SFT = {"STEPS": "6", "SAVE_FREQ": "2", "N_TRAIN": "128"}
PPO = {"STEPS": "2", "N_TRAIN": "32"}
# The chaos test's faults: their order and moments come from the seed (VERL_DS4_CHAOS_SEED picks another schedule).
CHAOS_SEED = int(os.environ.get("VERL_DS4_CHAOS_SEED", "1"))
# CI draws three kinds; the extended proof (bash benchmarks/extended_proofs.sh) adds scancel and the same command
# submitted again (a second job that resumes), which costs CI a job's start for a resume the other faults prove.
CHAOS_KINDS = ("kill_in_save", "kill_rank", "usr1")
CHAOS_KINDS_EXTENDED = (*CHAOS_KINDS, "scancel")
# The Ray chaos test: GRPO, 4 steps, a checkpoint every 2, the worker node lost at a moment the seed draws
# (VERL_DS4_RAY_CHAOS_SEED picks another).
RAY_CHAOS_SEED = int(os.environ.get("VERL_DS4_RAY_CHAOS_SEED", "0"))
RAY_STEPS = 4

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Slurm and the /proc checks need Linux")


def _assert_nothing_left(marker: str, what: str, wait_s: float = 120.0) -> None:
    deadline = time.monotonic() + wait_s
    while (left := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes of {what} still running:\n" + "\n".join(left)


def _run(cmd: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------------------------ Slurm


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """``scripts/local_slurm.sh up`` with 2 logical nodes (installing Slurm and munge with apt when missing);
    ``down`` afterwards, and the daemons it started must then be gone."""
    if os.geteuid() != 0:
        pytest.skip("the local Slurm runs its daemons as root (scripts/local_slurm.sh up needs root, as CI has)")
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"), nodes=2, timeout=JOB_TIMEOUT_S)
    start = time.monotonic()
    up = cluster.up()
    print(f"\nlocal Slurm up in {time.monotonic() - start:.1f} s:\n{up.stdout}{up.stderr}")
    pids = {}
    try:
        assert up.returncode == 0, f"local_slurm.sh up failed:\n{up.stdout}{up.stderr}"
        pids = cluster.daemon_pids()
        assert set(pids) == {"munged.pid", "slurmctld.pid", "slurmd.ds4n1.pid", "slurmd.ds4n2.pid"}, pids
        yield cluster
    finally:
        down = cluster.down()
        print(f"\nlocal Slurm down:\n{down.stdout}{down.stderr}")
        alive = [name for name, pid in pids.items() if Path(f"/proc/{pid}").exists()]
        assert not alive, f"daemons still running after down: {alive}"


def test_local_slurm_has_two_idle_nodes_that_run_a_step_each(slurm):
    env = slurm.env("none")
    sinfo = _run(["sinfo", "-h", "-N", "-o", "%N %t"], env)
    assert sorted(sinfo.stdout.splitlines()) == ["ds4n1 idle", "ds4n2 idle"], sinfo.stdout + sinfo.stderr
    step = _run(["srun", "-N2", "--ntasks-per-node=1", "bash", "-c", "echo $SLURMD_NODENAME $SLURM_NODEID"], env)
    assert step.returncode == 0, step.stderr
    assert sorted(step.stdout.split("\n")[:2]) == ["ds4n1 0", "ds4n2 1"], step.stdout


# --------------------------------------------------------------------------------------------- Slurm SFT


def _sft_env(slurm, work: Path, marker: str, port: int, **extra: str) -> dict[str, str]:
    return slurm.env(marker, DS4_DEVICE="cpu", NNODES="2", WORK_DIR=str(work), CLUSTER_LOG_DIR=str(work / "slurm"),
                     MASTER_PORT=str(port), **{**SFT, **extra})


def _node0_losses(work: Path) -> dict[int, float]:
    logs = sorted((work / "logs").glob("*-node0.log"))
    assert logs, f"no node-0 log in {work / 'logs'}"
    return parse_losses(logs[-1].read_text(errors="replace"))


@pytest.fixture(scope="module")
def sft_reference(slurm, tmp_path_factory):
    """``slurm_submit.sh sft``, uninterrupted, 6 steps, a checkpoint every 2."""
    work = tmp_path_factory.mktemp("sft_ref")
    marker = uuid.uuid4().hex
    port = free_port()
    start = time.monotonic()
    job_id, submitted = slurm.submit(["sft"], _sft_env(slurm, work, marker, port, JOB_NAME="ds4-sft-ref"))
    info = slurm.wait(job_id)
    wall = time.monotonic() - start
    out = (work / "slurm" / f"ds4-sft-ref-{job_id}.out").read_text()
    print(f"\nSlurm SFT job {job_id}: {info.get('JobState')} in {wall:.0f} s\n{submitted}{out}")
    return {"work": work, "job": job_id, "info": info, "out": out, "submitted": submitted, "port": port,
            "marker": marker, "losses": _node0_losses(work), "wall_s": wall}


def test_slurm_sft_runs_on_two_nodes_and_leaves_its_checkpoint(sft_reference):
    ref = sft_reference
    assert ref["info"]["JobState"] == "COMPLETED" and ref["info"]["ExitCode"] == "0:0", (ref["info"], ref["out"])
    # What the submitter and the job print before anything starts.
    assert "[verl-ds4] submit      sft (cpu): scripts/run_ds4_proxy_sft_cpu.sh on 2 node(s) x 1 process(es)" in \
        ref["submitted"]
    out = ref["out"]
    assert "[verl-ds4] nodes       ds4n1 ds4n2 (2)" in out
    assert f"[verl-ds4] rendezvous  127.0.0.1:{ref['port']} (torchrun static rendezvous" in out
    assert "[verl-ds4] processes   1 per node, world size 2" in out
    node_logs = ref["work"] / "slurm" / f"ds4-sft-ref-{ref['job']}"
    assert f"[verl-ds4] logs        {node_logs}/node<N>.log" in out
    assert out.index("[verl-ds4] nodes") < out.index("[verl-ds4] all 2 node(s) finished")
    # One task per node, each a torchrun of the 2-node rendezvous with its own node rank.
    for rank in (0, 1):
        assert (node_logs / f"node{rank}.status").read_text().strip() == "0"
    node1 = (node_logs / "node1.log").read_text()
    assert f"node        1 of 2 (1 processes), rendezvous 127.0.0.1:{ref['port']}" in node1
    # Each node checked that the checkpoint folder is one folder both see (verl_ds4.recipes.shared_folder).
    shared = f"[verl-ds4] checkpoint folder {ref['work'] / 'checkpoints'} (shared: every one of the 2 nodes saw"
    assert shared in node1 and shared in (node_logs / "node0.log").read_text()
    assert not (ref["work"] / "checkpoints" / ".verl_ds4_nodes").exists()
    node0_full = sorted((ref["work"] / "logs").glob("*-node0.log"))[-1].read_text(errors="replace")
    assert "contiguous CP layout (cp=2" in node0_full or "contiguous (cp=2" in node0_full
    assert sorted(ref["losses"]) == [1, 2, 3, 4, 5, 6], ref["losses"]
    assert ref["losses"][6] < ref["losses"][1]
    ckpt = ref["work"] / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert (ckpt / "global_step_6").is_dir()
    _assert_nothing_left(ref["marker"], "the finished SFT job")


def _final_budget(wants) -> tuple[int, int]:
    """(restarts used, Slurm requeues) of the job that finishes: the last fault's job, or a fresh one after a
    scancel and the submission again."""
    last = wants[-1]
    return (0, 0) if last.action == "resubmit" else (last.used, last.requeues)


@pytest.mark.parametrize("kinds", [CHAOS_KINDS, pytest.param(CHAOS_KINDS_EXTENDED, marks=pytest.mark.extended)],
                         ids=["ci", "with_scancel"])
def test_chaos_seeded_faults_each_restarted_by_the_launcher_and_the_run_ends_as_if_uninterrupted(
        slurm, sft_reference, tmp_path, kinds):
    """Issue 44 on the local Slurm: one 6-step SFT job (checkpoints every 2, MAX_RESTARTS=3) hit by a fault of each
    kind in ``kinds``, in an order and at moments drawn from a seed (``verl_ds4.testing.slurm_chaos``; the CI seed is
    1; CI draws the first three kinds, the extended proof all four):

    * ``kill_in_save``: every trainer rank frozen where ``global_step_N`` holds files and no manifest (the tracker
      still on the step before), then SIGKILLed: the batch script's supervisor restarts the step on both nodes and the
      launcher's start-up check names the unfinished step, renames it aside and resumes from the one before;
    * ``kill_rank``: one node's rank SIGKILLed during a step: the supervisor restarts from the newest intact
      checkpoint, naming the SIGKILL (torchrun's ``exitcode -9``, not srun's SIGTERM of the other node);
    * ``usr1``: USR1 to the batch shell (``scancel --batch --signal=USR1``, what ``--signal=B:USR1@N`` sends before the
      time limit): the run stops, the job requeues itself (Slurm's Restarts goes up) and resumes;
    * ``scancel`` during a step, then the same ``slurm_submit.sh`` command again: the new job resumes.

    After each: the launcher's action and its message, where the next attempt starts (the first step it prints), and
    every process of the stopped attempt gone. At the end: every step trained, each attempt's loss of each step equal
    to the uninterrupted run's (``sft_reference``) bit for bit, every checkpoint seen intact still there and unchanged
    (the damaged ones renamed, not deleted), and no process of either job left."""
    ref = sft_reference["losses"]
    steps, freq, budget = int(SFT["STEPS"]), int(SFT["SAVE_FREQ"]), 3
    faults = plan(CHAOS_SEED, steps=steps, save_freq=freq, max_restarts=budget, kinds=kinds)
    wants = expect(faults, steps=steps, save_freq=freq, max_restarts=budget)
    print(f"\nchaos seed {CHAOS_SEED}: " + "; ".join(map(str, faults)))
    work = tmp_path / "work"
    marker = uuid.uuid4().hex
    run = ChaosJob(slurm, _sft_env(slurm, work, marker, free_port(), JOB_NAME="ds4-sft-chaos"), timeout=JOB_TIMEOUT_S,
                   faults=faults)
    ckpt = run.ckpt
    start = time.monotonic()
    try:
        run.submit()
        assert "[verl-ds4] restarts    MAX_RESTARTS=3: the job restarts a run that dies" in run.submitted[0]
        for fault, want in zip(faults, wants):
            run.hit(fault, want)
        info = run.finish()
    finally:
        for job in run.jobs:
            slurm.cancel(job)
    wall = time.monotonic() - start
    print(f"chaos run: {len(faults)} faults, {len(run.jobs)} job(s), {wall:.0f} s")
    for r in run.records:
        print(f"  {r['fault']:40s} -> {r['action']:8s} acted after {r['action_s']:5.1f} s, step {r['first_step_after']} "
              f"trained {r['first_step_s']:5.1f} s after the fault")

    # The job that finished: completed, with the restarts and requeues the faults in it asked for.
    used, requeues = _final_budget(wants)
    out = run.out()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, out[-4000:])
    assert info.get("Restarts") == str(requeues), info
    assert "all 2 node(s) finished" in out, out[-4000:]
    assert (f"[verl-ds4] finished after {used} restart(s)" in out) == (used > 0), out[-4000:]
    assert len(run.jobs) == 1 + sum(w.action == "resubmit" for w in wants)

    for fault, want, rec in zip(faults, wants, run.records):
        where = f"{fault} (seed {CHAOS_SEED})"
        # The fault landed where the schedule put it, and the next attempt began after the newest intact checkpoint.
        assert rec["landed_after_step"] == want.failed_at - 1, (where, rec["landed_after_step"])
        assert rec["first_step_after"] == (want.newest or 0) + 1, (where, rec["first_step_after"], want)
        # Nothing of the stopped attempt is left (the scan saw its processes: the control of an empty list).
        assert rec["processes_then"] > 0 and rec["left_behind"] == [], (where, rec["left_behind"])
        attempts = run.restarts(rec["job"])["attempts"]
        job_out = run.out(rec["job"])
        if fault.kind == "scancel":
            # scancel stops the batch script with the run: whether its supervisor records the attempt first is a race
            # (a loaded CI machine lost it once); the job's end is checked above and below instead.
            assert len(attempts) <= want.attempt and rec["cancelled"] == "CANCELLED", (where, attempts, rec)
            continue
        mine = attempts[want.attempt - 1]
        assert mine["resumed_from"] == want.resumed_from and mine["returncode"] != 0, (where, attempts)
        assert mine["last_step"] == want.failed_at - 1, (where, attempts)
        if fault.kind in ("kill_rank", "kill_in_save"):
            assert mine["reason"] == SIGKILL_REASON, (where, attempts)
            start = (f"step {want.newest} (the newest intact checkpoint in {ckpt}), resume_mode=auto"
                     if want.newest is not None else "the start (no checkpoint yet)")
            assert (f"[verl-ds4] restart     {want.used} of {budget}: attempt {want.attempt} failed at step "
                    f"{want.failed_at} ({SIGKILL_REASON}); starting again from {start}; {budget - want.used} tries "
                    "left") in job_out, (where, job_out[-4000:])
        if fault.kind == "kill_in_save":
            assert rec["ranks_on_nodes"] == [0, 1], (where, rec)  # a rank frozen on each node
            assert not rec["manifest_then"] and rec["files_then"], (where, rec)  # inside the save: files, no manifest
            assert rec["tracker_then"] == (None if want.newest is None else str(want.newest)), (where, rec)
            damaged = ckpt / f"global_step_{fault.step}"
            assert f"checkpoint {damaged} is damaged or unfinished" in rec["node0_log"], (where, rec["node0_log"])
            if want.newest is not None:
                assert (f"resume_mode=auto: resuming from {ckpt / f'global_step_{want.newest}'} (step {want.newest}), "
                        "the newest intact checkpoint") in rec["node0_log"], (where, rec["node0_log"])
        if fault.kind == "usr1":
            assert (f"[verl-ds4] restart     {want.used} of {budget}: Slurm's pre-timeout signal (USR1) at step "
                    f"{want.failed_at}; the job is requeued") in job_out, (where, job_out[-4000:])
            assert (f"[verl-ds4] requeue     Slurm job {rec['job']} (the pre-timeout signal): it resumes from the newest "
                    "intact checkpoint") in job_out, (where, job_out[-4000:])
            assert f"[verl-ds4] restart     {want.requeues} of this job (requeued)" in job_out, (where, job_out[-4000:])

    # Every step trained; each attempt's loss of each step it trained is the uninterrupted run's, bit for bit.
    runs = [parse_losses(log.read_text(errors="replace")) for log in run.attempt_logs()]
    assert len(runs) == len(faults) + 1, [sorted(r) for r in runs]
    print("\n".join(f"  attempt {i + 1}: " + ", ".join(f"step {s} {v!r}" for s, v in sorted(r.items()))
                    for i, r in enumerate(runs)))
    print("  uninterrupted: " + ", ".join(f"step {s} {v!r}" for s, v in sorted(ref.items())))
    for i, losses in enumerate(runs):
        assert losses and {s: ref[s] for s in losses} == losses, (i + 1, losses, ref)
    assert min(runs[0]) == 1 and max(runs[-1]) == steps
    assert set().union(*runs) == set(range(1, steps + 1))
    # Negative control: the compared losses are not constants (each step's differs from the others').
    assert len({ref[s] for s in range(1, steps + 1)}) == steps

    # Nothing intact deleted or changed: every step folder seen intact (at each fault and at the end) is there with the
    # same manifest and passes the full check; each unfinished save was renamed aside, and the check finds its damage
    # (the control).
    assert {f"global_step_{s}" for s in range(freq, steps + 1, freq)} <= set(run.intact), sorted(run.intact)
    for name, manifest in run.intact.items():
        assert (ckpt / name / MANIFEST_NAME).read_bytes() == manifest, name
        assert verify_folder(ckpt / name, full=True, require_manifest=True) == [], name
    for fault in faults:
        if fault.kind == "kill_in_save":
            aside = sorted(ckpt.glob(f"damaged_global_step_{fault.step}_*"))
            assert len(aside) == sum(f == fault for f in faults), sorted(p.name for p in ckpt.iterdir())
            assert all(verify_folder(p, require_manifest=True) for p in aside), aside
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(steps)
    _assert_nothing_left(marker, f"the chaos run's jobs {run.jobs}")


def test_a_failing_sft_job_prints_each_failed_nodes_log_tail(slurm, tmp_path):
    work = tmp_path / "work"
    marker = uuid.uuid4().hex
    job_id, _ = slurm.submit(["sft", "trainer.no_such_knob=1"],
                             _sft_env(slurm, work, marker, free_port(), JOB_NAME="ds4-sft-bad", STEPS="2"))
    info = slurm.wait(job_id)
    out = (work / "slurm" / f"ds4-sft-bad-{job_id}.out").read_text(errors="replace")
    print(f"\nfailing SFT job {job_id}: {info['JobState']} {info['ExitCode']}\n{out[-2500:]}")
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", info
    node_logs = work / "slurm" / f"ds4-sft-bad-{job_id}"
    # Each node's task fails on the bad override; whichever fails first, srun stops the other before it reports.
    statuses = {rank: (node_logs / f"node{rank}.status").read_text().strip()
                for rank in (0, 1) if (node_logs / f"node{rank}.status").exists()}
    assert statuses and all(rc != "0" for rc in statuses.values()), statuses
    for rank, node in ((0, "ds4n1"), (1, "ds4n2")):
        if rank in statuses:
            assert f"[verl-ds4] node {rank} ({node}) failed: exit status {statuses[rank]}" in out, out[-4000:]
            assert f"---- node {rank} ({node}): last 40 lines of {node_logs}/node{rank}.log ----" in out
        else:
            assert f"[verl-ds4] node {rank} ({node}) was stopped before it finished" in out, out[-4000:]
    assert "no_such_knob" in out  # the tail shows why
    # A refusal at start-up is not retried (issue 44): one attempt, though srun ended the other node with SIGTERM.
    assert "[verl-ds4] not restarted: attempt 1 failed at start-up, before its first training step" in out, out[-4000:]
    assert "[verl-ds4] restart     1 of" not in out
    first = next(iter(statuses.values()))
    assert f"[verl-ds4] FAILED (exit {first})" in out and "all 2 node(s) finished" not in out
    assert info["ExitCode"] == f"{first}:0", info
    _assert_nothing_left(marker, f"the failed SFT job {job_id}")


# ------------------------------------------------------------------------------------- Ray, two nodes


def _actors_by_class(dashboard: str, env: dict[str, str]) -> dict[str, set[str]]:
    """Ray's state API in a child process with the cluster's auth mode: {actor class: node ids it ran on}."""
    code = (
        "import json, sys\n"
        "from ray.util.state import list_actors\n"
        "print(json.dumps([[a.class_name, a.node_id] for a in list_actors(address=sys.argv[1], limit=10000, "
        "detail=True, raise_on_missing_output=False)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, dashboard], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    by_class: dict[str, set[str]] = {}
    for class_name, node_id in json.loads(out.stdout.strip().splitlines()[-1]):
        by_class.setdefault(class_name.rsplit(".", 1)[-1], set()).add(node_id)
    return by_class


def test_ray_cluster_two_nodes_grpo_loses_its_worker_node_and_the_launcher_resumes_it_bit_for_bit(tmp_path):
    """The two-node Ray cluster on this host runs the GRPO job; a seeded moment kills its worker node (every process
    of it: a lost node), a replacement node is started (as a cluster manager would), and the launcher in the job
    restarts the driver, which waits for its 2 nodes and resumes from the newest intact checkpoint. The steps trained
    twice give the same metrics bit for bit (:data:`RAY_RESUME_KEYS`); the longer run, against an uninterrupted
    one, with a rank killed and a kill inside a save too, is ``benchmarks/chaos_ray_grpo.py``."""
    faults = ray_plan(RAY_CHAOS_SEED, steps=RAY_STEPS, save_freq=2, max_restarts=1, kinds=("kill_node",), retrain=True)
    chaos = RayChaos(tmp_path, steps=RAY_STEPS, save_freq=2, max_restarts=1, timeout=JOB_TIMEOUT_S)
    env, gcs = chaos.env, chaos.env["RAY_PORT"]
    work = tmp_path / "work"
    try:
        started = time.monotonic()
        chaos.start("head")
        assert "--num-gpus=1 --num-cpus=16" in chaos.outputs["head"]
        assert f"{tmp_path / 'head'}/ray_start.log" in chaos.outputs["head"]
        # A second head on the same port is refused with the port, before Ray runs.
        again = _run(["bash", "scripts/ray_cluster.sh", "start-head"], dict(env, RAY_NODE_DIR=str(tmp_path / "h2")))
        assert again.returncode == 2 and f"RAY_PORT={gcs} is in use" in again.stderr, again.stderr
        chaos.start("worker")
        assert "2 of 2 nodes alive" in chaos.wait_nodes()
        print(f"\ntwo Ray nodes up in {time.monotonic() - started:.0f} s; faults (seed {RAY_CHAOS_SEED}): "
              f"{', '.join(map(str, faults))}")
        # A third node that never joins: wait-nodes times out with the count it saw and the address.
        short = _run(["bash", "scripts/ray_cluster.sh", "wait-nodes"], dict(env, NNODES="3", RAY_WAIT_TIMEOUT="3"))
        assert short.returncode == 1, short.stdout + short.stderr
        assert f"only 2 of 3 nodes alive at 127.0.0.1:{gcs} after 3s" in short.stderr, short.stderr
        # The RL launchers' wait at each start (a restart after a lost node): silent when the nodes are there, else it
        # says what it waits for.
        auth = re.search(r"\[verl-ds4\] auth +(\w+)", chaos.outputs["head"]).group(1)  # the cluster's token mode
        quiet = [sys.executable, "scripts/ray_wait_nodes.py", "--address", f"127.0.0.1:{gcs}", "--quiet", "--timeout"]
        there = _run([*quiet, "3", "--nodes", "2"], dict(env, RAY_AUTH_MODE=auth))
        assert there.returncode == 0 and not there.stdout.strip(), there.stdout + there.stderr
        short = _run([*quiet, "2", "--nodes", "3"], dict(env, RAY_AUTH_MODE=auth))
        assert short.returncode == 1, short.stdout + short.stderr
        assert (f"[verl-ds4] waiting up to 2s for 3 Ray nodes (2 alive at 127.0.0.1:{gcs}): a lost node must be "
                "started again") in short.stdout, short.stdout

        # A node lost moments before a start (a restart after a fast failure) is still listed alive until Ray's health
        # check gives up (~15 s): the launcher's folder check must leave it out, not pin its task there (with the pinned
        # task on every listed node, this start failed with TaskUnschedulableError and was not retried: CI, stop 49).
        spare = chaos.start("worker")
        three = _run(["bash", "scripts/ray_cluster.sh", "wait-nodes"], dict(env, NNODES="3"))
        assert "3 of 3 nodes alive" in three.stdout, three.stdout + three.stderr
        for pid in chaos.node_pids(spare):
            os.kill(pid, signal.SIGKILL)
        folder = [sys.executable, "-m", "verl_ds4.recipes.shared_folder", "--ray", "--dir", str(tmp_path / "probe")]
        near = dict(env, RAY_AUTH_MODE=auth, RAY_ADDRESS=f"127.0.0.1:{gcs}")
        lost = _run([*folder, "--nodes", "2"], near)
        assert lost.returncode == 0, lost.stdout + lost.stderr
        assert "is listed alive but runs no task (TaskUnschedulableError): left out of the check" in lost.stdout
        assert "(shared: every one of the 2 nodes saw every node's marker)" in lost.stdout, lost.stdout
        # Control: it counts the nodes that answer; it cannot pass for 3 with one lost.
        short = _run([*folder, "--nodes", "3", "--timeout", "20"], near)
        assert short.returncode == 2, short.stdout + short.stderr
        assert "2 node(s) of the Ray cluster answered within 20 s, the run needs 3" in short.stderr, short.stderr

        start = time.monotonic()
        status, [record], out = chaos.submit(work, faults=faults, name="chaos")
        print(f"ray_cluster.sh submit grpo on 2 nodes, {faults[0]}: exit {status} in {time.monotonic() - start:.0f} s; "
              f"the launcher acted {record.acted_s} s after the fault, the next attempt trained its first step "
              f"{record.next_step_s} s after it\n{out[-3000:]}")
        assert status == 0, out[-6000:]
        assert "[verl-ds4] processes   2 node(s) x 1 per node" in out
        # One task on each Ray node checked that the checkpoint folder is one folder both see (every attempt).
        assert out.count(f"[verl-ds4] checkpoint folder {work / 'checkpoints'} (shared: every one of the 2 nodes saw "
                         "every node's marker)") == 2, out[-4000:]
        # When the fault hit, the trainer's ranks ran on both nodes; the worker node was lost whole.
        assert record.ranks == {"head": 1, "worker-0": 1}, record.ranks
        assert record.killed and not record.left, record.left
        # What the launcher did: one restart, from the newest intact checkpoint before the fault.
        [want_from] = ray_expect(faults, steps=RAY_STEPS, save_freq=2, max_restarts=1)
        assert f"[verl-ds4] restart     1 of 1: attempt 1 failed at step {faults[0].step} (" in record.restart
        assert record.resumed_from == want_from, (record.restart, want_from)
        assert "[verl-ds4] finished after 1 restart(s)" in out

        attempts = attempt_metrics(work)
        assert len(attempts) == 2, [sorted(a) for a in attempts]
        first, second = attempts
        assert sorted(first) == list(range(1, faults[0].step)), sorted(first)
        assert sorted(second) == list(range((want_from or 0) + 1, RAY_STEPS + 1)), sorted(second)
        again = sorted(set(first) & set(second))
        assert again, "no step was trained before and after the restart"
        for step in again:
            got = {k: second[step][k] for k in RAY_RESUME_KEYS}
            want = {k: first[step][k] for k in RAY_RESUME_KEYS}
            print(f"step {step}: before the fault {want}\n        after the restart {got}")
            assert got == want, {k: (want[k], got[k]) for k in RAY_RESUME_KEYS if got[k] != want[k]}
        # Negative control: the compared metrics change from step to step (a constant would compare equal).
        steps = {**first, **second}
        assert any(steps[1][k] != steps[RAY_STEPS][k] for k in RAY_RESUME_KEYS), steps
        _assert_a_grpo_run(out, work, steps)
        assert sorted(intact_checkpoints(work / "checkpoints")) == [f"global_step_{s}" for s in
                                                                    save_steps(RAY_STEPS, 2)]
        # The plugin travelled in the runtime env: the workers ran the shipped copy of this checkout.
        log = (work / "logs" / "latest.log").read_text(errors="replace")
        assert re.search(r"code from \S*runtime_resources/working_dir_files/\S+/verl_ds4", log), "no shipped code"
        by_class = _actors_by_class(f"http://127.0.0.1:{env['RAY_DASHBOARD_PORT']}", dict(env, RAY_AUTH_MODE=auth))
        print({k: sorted(n[:8] for n in v) for k, v in by_class.items()})
        assert len(by_class["WorkerDict"]) >= 2, "actor (WorkerDict) workers did not run on both nodes"
        assert len(by_class["CPURolloutServer"]) >= 2, "rollout servers did not run on both nodes"
    finally:
        chaos.stop()
    _assert_nothing_left(chaos.marker, "the Ray nodes and the GRPO job")
    shutil.rmtree(chaos.temp, ignore_errors=True)


def _assert_a_grpo_run(console: str, work: Path, metrics: dict[int, dict[str, float]]) -> None:
    """What makes the run GRPO (the suite's GRPO run is this one; ``tests/test_cpu_grpo_on_cpu.py`` has the
    launcher's refusals): group-relative advantages, no critic, KL to the reference, the console's summary."""
    log = (work / "logs" / "latest.log").read_text(errors="replace")
    assert "'adv_estimator': 'grpo'" in log and "'n': 2" in log, "the resolved config: adv_estimator grpo, rollout.n=2"
    assert "recipe ds4_proxy_grpo_cpu" in console and "batch 4 (updates of 4)" in console
    assert "[verl-ds4] result      the RL path ran: " in console and "GRPO steps (rollout, reward, group-relative" \
        in console, console[-3000:]
    assert "[verl-ds4] reward: first " in console and "lp_diff_max" in console and "k3_kl" in console
    for step, m in metrics.items():
        for key in ("critic/score/mean", "actor/kl_loss", "actor/pg_loss", "critic/advantages/mean", "timing_s/step"):
            assert key in m and math.isfinite(m[key]), f"step {step}: {key} missing or not finite"
        assert 0.0 <= m["critic/score/min"] <= m["critic/score/mean"] <= m["critic/score/max"] <= 1.0
        # verl-ds4's straggler ratios of the actor update (verl_ds4/engine/straggler.py), as verl's trainer logs them
        cp_ratio, worst = m["actor/perf/cp_straggler_ratio"], m["actor/perf/cp_straggler_ratio_max"]
        assert 1.0 <= cp_ratio <= worst and m["actor/perf/dp_straggler_ratio"] >= 1.0, (step, cp_ratio, worst)
        assert m["actor/perf/cp_straggler_ratio_batch_order"] == cp_ratio  # the recipe's cp_balance=null
        # No critic: verl reports no value loss and no values (the PPO runs report both).
        assert not any(k.startswith(("critic/vf_", "critic/values/", "timing_s/update_critic")) for k in m), sorted(m)
        # Each response is sampled with its own seed (verl_ds4/rollout/agent_loop.py), so a group's responses differ
        # and their group-relative advantages are not all 0 (with verl's single_turn_agent every request of the v1
        # trainer was "det-0": identical responses in a group, every advantage exactly 0, no policy gradient).
        assert m["critic/advantages/max"] > 0 > m["critic/advantages/min"], f"step {step}: all advantages 0"
    assert metrics[1]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
    # fp32 actor and reference: step 1's advantages moved the actor away from the reference
    assert metrics[2]["actor/kl_loss"] > 1e-6, "step 1 had non-zero advantages, yet the actor did not move"
    # rollout and trainer agree on the log-probs after the weight sync (verl's mismatch metric)
    assert all(m["training/rollout_probs_diff_max"] < 0.05 for s, m in metrics.items() if s > 1)
    assert "CPUMegatronEngineWithLMHead: contiguous CP layout (cp=2" in log
    assert "CPUMegatronEngineWithValueHead" not in log, "GRPO must not build a critic"
    step_dir = work / "checkpoints" / f"global_step_{max(metrics)}"
    assert (step_dir / "actor" / "model").is_dir() and not (step_dir / "critic").exists()


# ----------------------------------------------------------------------------------------- Slurm PPO


def _ppo_env(slurm, work: Path, marker: str, **extra: str) -> dict[str, str]:
    return slurm.env(marker, DS4_DEVICE="cpu", NNODES="2", WORK_DIR=str(work), CLUSTER_LOG_DIR=str(work / "slurm"),
                     RAY_NODE_PORTS="auto", RAY_TEMP_DIR=f"/tmp/ds4ray-{marker[:8]}", RAY_PORT=str(free_port()),
                     RAY_DASHBOARD_PORT=str(free_port()), **{**PPO, **extra})


# CI: the Slurm PPO failure paths below start Ray on both Slurm nodes; the Ray chaos run trains RL on two nodes
@pytest.mark.extended
def test_slurm_ppo_runs_ray_on_two_nodes_and_tears_it_down(slurm, tmp_path):
    work = tmp_path / "work"
    marker = uuid.uuid4().hex
    start = time.monotonic()
    job_id, _ = slurm.submit(["ppo"], _ppo_env(slurm, work, marker, JOB_NAME="ds4-ppo"))
    info = slurm.wait(job_id)
    wall = time.monotonic() - start
    out = (work / "slurm" / f"ds4-ppo-{job_id}.out").read_text(errors="replace")
    print(f"\nSlurm PPO job {job_id}: {info['JobState']} {info['ExitCode']} in {wall:.0f} s\n{out[-3000:]}")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out[-6000:]
    assert "[verl-ds4] nodes       ds4n1 ds4n2 (2); Ray head on ds4n1" in out
    assert "ray cluster: 2 of 2 nodes alive" in out and f"Job 'ds4-ppo-{job_id}' succeeded" in out
    assert out.index("[verl-ds4] nodes") < out.index("ray cluster: 2 of 2")
    metrics = parse_step_metrics((work / "logs" / "latest.log").read_text(errors="replace"))
    assert sorted(metrics) == [1, 2]
    assert (work / "checkpoints" / "global_step_2" / "actor").is_dir()
    for log in ("ray-head.log", "ray-worker-0.log"):
        assert "Ray runtime started" in (work / "slurm" / f"ds4-ppo-{job_id}" / log).read_text(errors="replace")
    _assert_nothing_left(marker, f"the Slurm PPO job {job_id}")
    shutil.rmtree(f"/tmp/ds4ray-{marker[:8]}", ignore_errors=True)


def test_slurm_ppo_job_exits_with_the_trainers_status_and_the_node_log_tails(slurm, tmp_path):
    # Negative control of the exit status: the CPU launcher refuses MINI_BATCH=3 of BATCH=8 with exit 2.
    work = tmp_path / "work"
    marker = uuid.uuid4().hex
    job_id, _ = slurm.submit(["ppo"], _ppo_env(slurm, work, marker, JOB_NAME="ds4-ppo-bad", MINI_BATCH="3"))
    info = slurm.wait(job_id)
    out = (work / "slurm" / f"ds4-ppo-bad-{job_id}.out").read_text(errors="replace")
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", f"{info}\n{out[-6000:]}"
    # The status comes from Ray's job record (`ray job submit` itself exits 1 for any failed job).
    assert "entrypoint exit code 2" in out, out[-6000:]
    assert "MINI_BATCH=3, BATCH=8: expected positive integers with MINI_BATCH dividing BATCH" in out
    assert "---- Ray head (ds4n1): last 40 lines of" in out and "---- Ray worker 0 (ds4n2): last 40 lines" in out
    assert "[verl-ds4] FAILED (exit 2)" in out
    _assert_nothing_left(marker, f"the failed Slurm PPO job {job_id}")
    shutil.rmtree(f"/tmp/ds4ray-{marker[:8]}", ignore_errors=True)


FAIL_START_HOOK = '''
def refuse_worker(ray_params, head):
    """Ray's RAY_START_HOOK, called by `ray start` before it starts anything: the workers refuse."""
    if not head:
        raise SystemExit("injected by the test: this worker's ray start refuses to start")
'''


def test_slurm_ppo_job_ends_within_seconds_when_a_worker_fails_to_start(slurm, tmp_path):
    """A worker node whose ``ray start`` exits (here Ray's own RAY_START_HOOK refuses it; in the CI run that
    prompted this, a port clash) ends the job in seconds, not after wait-nodes' 600 s: non-zero status, that
    node's log tail, the head torn down. (Negative control, run by hand: the batch script before the node steps
    were watched made this job wait the 600 s; see docs/troubleshooting.md.)"""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "ds4_fail_start.py").write_text(FAIL_START_HOOK)
    work = tmp_path / "work"
    marker = uuid.uuid4().hex
    # wait-nodes' own limit stated (600 s): the job must end long before it (bounds generous for a loaded machine:
    # about 30 s on quiet cores, Ray's head start-up, the steps' stop and the head's teardown included).
    env = _ppo_env(slurm, work, marker, JOB_NAME="ds4-ppo-nostart", RAY_START_HOOK="ds4_fail_start.refuse_worker",
                   RAY_WAIT_TIMEOUT="600")
    env["PYTHONPATH"] = f"{hook}{os.pathsep}{env['PYTHONPATH']}"
    start = time.monotonic()
    job_id, _ = slurm.submit(["ppo"], env)
    info = slurm.wait(job_id, timeout=500)
    wall = time.monotonic() - start
    out = (work / "slurm" / f"ds4-ppo-nostart-{job_id}.out").read_text(errors="replace")
    print(f"\nSlurm PPO job {job_id} with a worker that cannot start: {info['JobState']} {info['ExitCode']} in "
          f"{wall:.1f} s\n{out[-2500:]}")
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", f"{info}\n{out[-4000:]}"
    assert wall < 300, f"the job took {wall:.0f} s to end: not in seconds, as if it waited for wait-nodes' 600 s"
    node_logs = work / "slurm" / f"ds4-ppo-nostart-{job_id}"
    assert ("[verl-ds4] Ray worker 0 on ds4n2 stopped while the job waited for the nodes (its ray start exited "
            "with status 1): ending the job") in out, out[-4000:]
    assert f"---- Ray worker 0 (ds4n2): last 40 lines of {node_logs}/ray-worker-0.log ----" in out
    assert "injected by the test: this worker's ray start refuses to start" in out  # the tail shows why
    assert f"[verl-ds4] FAILED (exit 1); Ray node logs: {node_logs}" in out
    assert "[verl-ds4] ray head    GCS" in (node_logs / "ray-head.log").read_text(errors="replace")  # it did start
    assert "ray cluster: 2 of 2" not in out and "[verl-ds4] submit" not in out
    _assert_nothing_left(marker, f"the Slurm PPO job {job_id} whose worker did not start")
    shutil.rmtree(f"/tmp/ds4ray-{marker[:8]}", ignore_errors=True)


# ------------------------------------------------------------------------------------------- bad input


def test_bad_input_is_refused_before_any_node_starts(slurm, tmp_path):
    marker = uuid.uuid4().hex
    before = slurm.queued()
    # A GPU job without MODEL_PATH: refused by the submitter, nothing queued.
    out = _run(["bash", "scripts/slurm_submit.sh", "sft"], slurm.env(marker, NNODES="2",
                                                                    CLUSTER_LOG_DIR=str(tmp_path / "logs")))
    assert out.returncode == 2 and "MODEL_PATH is not set" in out.stderr, out.stderr
    assert "Submitted batch job" not in out.stdout
    out = _run(["bash", "scripts/slurm_submit.sh", "ppo"], slurm.env(marker, MODEL_PATH="/ckpt/x"))
    assert out.returncode == 2 and "TRAIN_FILES is not set" in out.stderr, out.stderr
    assert "Submitted batch job" not in out.stdout
    assert set(slurm.queued()) <= set(before), "a refused submission queued a job"

    # sbatch directly (as a user may): the job itself refuses before any srun step, naming the variable.
    logs = tmp_path / "direct"
    sub = _run(["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", f"--output={tmp_path}/direct-%j.out",
                "scripts/slurm_sft.sbatch"], slurm.env(marker, CLUSTER_LOG_DIR=str(logs)))
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip()
    info = slurm.wait(job_id, timeout=120)
    text = (tmp_path / f"direct-{job_id}.out").read_text()
    assert info["JobState"] == "FAILED" and "MODEL_PATH is not set" in text, (info, text)
    assert not logs.exists(), "no node may have started"

    # NNODES against the allocation, with the numbers.
    sub = _run(["sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0", f"--output={tmp_path}/nn-%j.out",
                "scripts/slurm_sft.sbatch"], slurm.env(marker, NNODES="1", DS4_DEVICE="cpu"))
    job_id = sub.stdout.strip()
    slurm.wait(job_id, timeout=120)
    assert "NNODES=1 but the Slurm allocation has 2 nodes" in (tmp_path / f"nn-{job_id}.out").read_text()

    # A node list that does not parse, and a rendezvous port in use (the batch script run as Slurm would).
    inside = dict(slurm.env(marker, DS4_DEVICE="cpu"), SLURM_JOB_ID="999", SLURM_JOB_NUM_NODES="2",
                  SLURM_JOB_NODELIST="ds4n[1-")
    out = _run(["bash", "scripts/slurm_sft.sbatch"], inside)
    assert out.returncode == 2 and "cannot parse the node list SLURM_JOB_NODELIST='ds4n[1-'" in out.stderr, out.stderr
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        inside.update(SLURM_JOB_NODELIST="ds4n[1-2]", MASTER_PORT=str(port))
        out = _run(["bash", "scripts/slurm_sft.sbatch"], inside)
    assert out.returncode == 2 and f"MASTER_PORT={port} is in use on ds4n1" in out.stderr, out.stderr
    # Negative control: the same script with a free port gets past the checks (and then needs a real job).
    inside.update(MASTER_PORT=str(free_port()))
    out = _run(["bash", "scripts/slurm_sft.sbatch", "--dry-run"], inside)
    assert out.returncode == 0 and "[verl-ds4] nodes       node1 node2 (2)" in out.stdout, out.stderr
    _assert_nothing_left(marker, "the refused jobs")
