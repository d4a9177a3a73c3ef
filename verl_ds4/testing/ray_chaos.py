"""Faults at seeded moments in a GRPO job on a real two-node Ray cluster: the chaos test and benchmark of the RL
launcher's restarts.

Issue 44 on Ray (``scripts/ray_cluster.sh`` on one host: a head and a worker node, each ``ray start --block`` of its
own): the tiny DS4 GRPO job of ``scripts/ray_cluster.sh submit grpo`` (2 nodes x 1 process, CP=2, the project's CPU
engine) is hit by faults at moments a seed picks; the launcher in the job (its supervisor, ``MAX_RESTARTS``) starts
the driver again after each, from the newest intact checkpoint, and at the end the run has all its steps, each
step's metrics equal to an uninterrupted run's bit for bit (or, in the short CI case, to the same step trained
before the fault), no intact checkpoint deleted or changed, and no process of the job left.

The kinds (:data:`KINDS`), each during step N (the driver held where verl's trainer moves to step N: step N-1 logged,
its save ended) or inside step N's save:

``kill_node``     every process of the worker node SIGKILLed (its ``ray start``, raylet, agents and workers: a lost
                  node), then a replacement worker node started, as a cluster manager would; the restarted driver
                  waits for the run's nodes (``RAY_WAIT_TIMEOUT``) and resumes.
``kill_rank``     one trainer rank (a ``WorkerDict`` actor process, on the node the seed picks) SIGKILLed.
``kill_in_save``  the actor's rank 0 SIGKILLed inside step N's save, held where every rank's files are written and
                  the actor's manifest is not: the unfinished step is renamed aside at the next start, which resumes
                  from the one before.

The moments are events, not times: the run is held at each fault's moment until the fault is in
(:mod:`verl_ds4.testing.hold_steps`, imported by the driver and the workers through ``VERL_DS4_TEST_MODULES``), so
a seed gives the same schedule on a loaded machine.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from verl_ds4.ckpt_manifest import MANIFEST_NAME, step_folders, verify_folder
from verl_ds4.recipes.supervise import Attempt, decide
from verl_ds4.rollout.cpu_ppo_run import parse_step_metrics
from verl_ds4.testing.slurm_chaos import (PlanError, base_env, draw_schedule, free_port, marked_processes,
                                         save_steps)

__all__ = ["GRPO", "KINDS", "RESUME_KEYS", "Fault", "RayChaos", "expect", "plan"]

REPO = Path(__file__).resolve().parents[2]
KINDS = ("kill_node", "kill_rank", "kill_in_save")
#: The job's small settings: 4 prompts x 2 responses, 8 tokens, the steps in the first epoch.
GRPO = {"DS4_RL_RECIPE": "grpo", "BATCH": "4", "RESPONSE_LENGTH": "8", "N_TRAIN": "64"}
GRPO_ARGS = ("actor_rollout_ref.rollout.n=2",)
#: The metrics a step trained again after a restart must reproduce exactly (==, fp32); see tests/test_cpu_ppo_on_cpu.py
#: for why they are bit-reproducible and why the rollout's own log-prob figures are not among them.
RESUME_KEYS = ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/advantages/max",
               "critic/advantages/min")
_RESTART = re.compile(r"\[verl-ds4\] restart +(\d+) of (\d+): .*starting again from (step (\d+)|scratch)")
_STEP = re.compile(r"\[verl-ds4\] step (\d+)/\d+")


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    step: int  # kill_in_save: the save of this step; the others: during this step
    node: int | None = None  # kill_rank: the node (0: head, 1: worker) whose rank is killed

    def __str__(self) -> str:
        if self.kind == "kill_in_save":
            return f"kill_in_save at the step-{self.step} save"
        return f"{self.kind} during step {self.step}" + (f" (node {self.node})" if self.node is not None else "")


def _valid_steps(kind: str, start: int, steps: int, saves: list[int]) -> list[int]:
    """Where a fault of ``kind`` can hit an attempt that started from checkpoint ``start`` (0: scratch): after the
    attempt's first step is printed (a failure before it, without a signal, is not restarted)."""
    return [s for s in saves if s >= start + 2] if kind == "kill_in_save" else list(range(start + 2, steps + 1))


def expect(faults: Sequence[Fault], *, steps: int, save_freq: int, max_restarts: int) -> list[int | None]:
    """The checkpoint each fault's next attempt starts from (None: scratch), by the supervisor's own rules
    (:func:`verl_ds4.recipes.supervise.decide`); :class:`PlanError` if the launcher would stop instead, or a fault
    cannot happen where it is placed. Every kind fails the attempt during step N with the same kind of error (an
    actor died), so two faults at one step would be "the same step failing the same way twice"."""
    saves = save_steps(steps, save_freq)
    history: list[Attempt] = []
    newest: int | None = None
    out = []
    for fault in faults:
        if fault.kind not in KINDS:
            raise PlanError(f"unknown fault kind {fault.kind!r}: expected one of {', '.join(KINDS)}")
        start = newest or 0
        if fault.step not in _valid_steps(fault.kind, start, steps, saves):
            raise PlanError(f"{fault}: the attempt it hits starts from step {start}")
        done = [s for s in saves if start < s < fault.step]
        after = done[-1] if done else newest
        history.append(Attempt(len(history) + 1, newest, returncode=1, last_step=fault.step - 1,
                               reason="ActorDiedError: a Ray actor died"))
        # a kill in the first save leaves checkpoints of which none is intact: the supervisor stops there
        none_intact = "none is intact" if fault.kind == "kill_in_save" and after is None else None
        retry, why = decide(history, after, none_intact, max_restarts - len(out))
        if not retry:
            raise PlanError(f"{fault}: the launcher would not restart: {why}")
        out.append(after)
        newest = after
    return out


def plan(seed: int, *, steps: int, save_freq: int, max_restarts: int, kinds: Sequence[str], nodes: int = 2,
         retrain: bool = False, tries: int = 100_000) -> list[Fault]:
    """``kinds`` in an order and at moments drawn from ``seed`` (the draw:
    :func:`verl_ds4.testing.slurm_chaos.draw_schedule`), every one survivable (:func:`expect`), each after the one
    before. The same seed and arguments give the same schedule. ``retrain``: only moments after which the next attempt
    trains again a step that the hit one printed (a test without an uninterrupted run compares those)."""
    rng = random.Random(seed)
    saves = save_steps(steps, save_freq)

    def choose() -> list[str]:
        chosen = list(kinds)
        rng.shuffle(chosen)
        return chosen

    def room(kind: str, faults: list[Fault], froms: list[int | None] | None) -> list[int]:
        start = (froms[-1] if froms else None) or 0
        where = [s for s in _valid_steps(kind, start, steps, saves) if all(s > f.step for f in faults)]
        if retrain:  # the step before the fault is not the newest checkpoint's: it is trained again
            where = [s for s in where if s - 1 > max([c for c in saves if c < s], default=0)]
        return where

    return draw_schedule(rng, choose, room,
                         lambda faults: expect(faults, steps=steps, save_freq=save_freq, max_restarts=max_restarts),
                         fault=Fault, nodes=nodes, tries=tries,
                         what=f"{list(kinds)} in {steps} steps (save every {save_freq})")


def _tree(pid: int) -> list[int]:
    import psutil

    try:
        root = psutil.Process(pid)
        return [pid] + [p.pid for p in root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


@dataclasses.dataclass
class Record:
    """What happened at one fault."""

    fault: Fault
    after: int | None  # the last step printed when it hit
    acted_s: float | None = None  # the fault to the supervisor's restart line
    next_step_s: float | None = None  # the fault to the next attempt's first step line
    restart: str = ""  # the supervisor's restart line
    resumed_from: int | None = None  # the step the next attempt started from (None: scratch)
    killed: list[int] = dataclasses.field(default_factory=list)
    ranks: dict[str, int] = dataclasses.field(default_factory=dict)  # trainer ranks (ray::WorkerDict) per node, held
    left: list[str] = dataclasses.field(default_factory=list)  # killed processes alive at the next attempt's first step


class RayChaos:
    """A two-node Ray cluster on this host, the GRPO job submitted to it, the faults injected at their moments."""

    def __init__(self, root: Path, *, steps: int, save_freq: int, max_restarts: int, timeout: float = 900):
        self.root, self.steps, self.save_freq, self.max_restarts, self.timeout = root, steps, save_freq, max_restarts, \
            timeout
        self.marker = os.urandom(8).hex()
        self.temp = Path(f"/tmp/ds4ray-{self.marker[:8]}")  # short: Ray's socket paths live under it
        gcs, dashboard = free_port(), free_port()
        self.env = base_env(self.marker, DS4_DEVICE="cpu", RAY_NODE_PORTS="auto", RAY_HEAD_IP="127.0.0.1",
                            RAY_PORT=str(gcs), RAY_DASHBOARD_PORT=str(dashboard), RAY_TEMP_DIR=str(self.temp),
                            NNODES="2")
        self.nodes: dict[str, Path] = {}  # name -> RAY_NODE_DIR
        self.outputs: dict[str, str] = {}  # name -> what ray_cluster.sh start-* printed
        self.workers = 0

    # ------------------------------------------------------------------------------------------------ the cluster
    def _ray(self, command: str, node: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        env = dict(self.env, RAY_NODE_DIR=str(self.nodes[node])) if node else self.env
        return subprocess.run(["bash", "scripts/ray_cluster.sh", *command.split()], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=timeout)

    def start(self, role: str) -> str:
        """Start the head (``role="head"``) or another worker node; its name."""
        name = "head" if role == "head" else f"worker-{self.workers}"
        self.workers += role != "head"
        self.nodes[name] = self.root / name
        out = self._ray(f"start-{'head' if role == 'head' else 'worker'}", name)
        if out.returncode != 0:
            raise RuntimeError(f"ray_cluster.sh start-{role} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
        self.outputs[name] = out.stdout
        return name

    def wait_nodes(self) -> str:
        out = self._ray("wait-nodes")
        if out.returncode != 0:
            raise RuntimeError(f"wait-nodes: {out.stdout[-2000:]}{out.stderr[-2000:]}")
        return out.stdout

    def node_pids(self, name: str) -> list[int]:
        """Every process of one node: its ``ray start --block`` and all it started (raylet, agents, workers)."""
        try:
            owner = int((self.nodes[name] / "ray_start.pid").read_text())
        except (OSError, ValueError):
            return []
        return _tree(owner)

    def stop(self) -> None:
        for name in reversed(list(self.nodes)):
            self._ray("stop", name, timeout=120)

    # ------------------------------------------------------------------------------------------------- the job
    def submit(self, work: Path, *, faults: Sequence[Fault] = (), name: str = "run",
               max_restarts: int | None = None) -> tuple[int, list[Record], str]:
        """Run the GRPO job in ``work`` under ``faults``: (its exit status, a record per fault, its output)."""
        holds = work / "holds"
        holds.mkdir(parents=True, exist_ok=True)
        env = dict(self.env, WORK_DIR=str(work), STEPS=str(self.steps), SAVE_FREQ=str(self.save_freq),
                   MAX_RESTARTS=str(self.max_restarts if max_restarts is None else max_restarts), RAY_JOB_ID=f"ds4-grpo-{name}-{self.marker[:8]}",
                   VERL_DS4_TEST_MODULES="verl_ds4.testing.hold_steps", VERL_DS4_TEST_HOLD_DIR=str(holds),
                   EXTRA_ENV_VARS="VERL_DS4_TEST_MODULES VERL_DS4_TEST_HOLD_DIR", **GRPO)
        out_path = work.parent / f"{name}.out"
        records: list[Record] = []
        faults = list(faults)
        if faults:
            self._arm(holds, faults[0])
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(["bash", "scripts/ray_cluster.sh", "submit", "grpo", "--", *GRPO_ARGS], cwd=REPO,
                                    env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            for i, fault in enumerate(faults):
                record = self._inject(proc, out_path, holds, fault, faults[i + 1] if i + 1 < len(faults) else None)
                records.append(record)
                print(f"[chaos] {fault}: {record.restart or 'no restart seen'} (acted {record.acted_s} s, next step "
                      f"{record.next_step_s} s)", flush=True)
            proc.wait(timeout=self.timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return proc.returncode, records, out_path.read_text(errors="replace")

    @staticmethod
    def _arm(holds: Path, fault: Fault) -> None:
        (holds / (f"hold_save_{fault.step}" if fault.kind == "kill_in_save" else f"hold_{fault.step}")).touch()

    def _await(self, what: str, proc: subprocess.Popen, out_path: Path, ready) -> float:
        start = time.monotonic()
        while not (found := ready()):
            if proc.poll() is not None:
                raise RuntimeError(f"the job ended (exit {proc.returncode}) while the test waited for {what}:\n"
                                   f"{out_path.read_text(errors='replace')[-5000:]}")
            if time.monotonic() - start > self.timeout:
                raise RuntimeError(f"{what}: not seen in {self.timeout:.0f} s:\n"
                                   f"{out_path.read_text(errors='replace')[-5000:]}")
            time.sleep(0.1)
        return found

    def _inject(self, proc, out_path: Path, holds: Path, fault: Fault, following: Fault | None) -> Record:
        held = holds / (f"held_save_{fault.step}" if fault.kind == "kill_in_save" else f"held_{fault.step}.driver")
        self._await(f"the run held for {fault}", proc, out_path, held.exists)

        def printed() -> list[int]:  # the steps the current attempt printed (after the last restart line)
            text = out_path.read_text(errors="replace")
            last = list(_RESTART.finditer(text))
            return [int(m) for m in _STEP.findall(text[last[-1].end() if last else 0:])]

        # the console's step line follows verl's log a moment later: the step before the fault is awaited
        self._await(f"step {fault.step - 1} printed before {fault}", proc, out_path,
                    lambda: fault.step - 1 in printed())
        restarts_before = len(_RESTART.findall(out_path.read_text(errors="replace")))
        record = Record(fault, max(printed()))
        record.ranks = {n: sum(_cmdline(p).startswith("ray::WorkerDict") for p in self.node_pids(n)) for n in self.nodes
                        if self.node_pids(n)}
        if fault.kind == "kill_node":
            [worker] = [n for n in self.nodes if n.startswith("worker") and self.node_pids(n)]
            record.killed = self.node_pids(worker)
        elif fault.kind == "kill_rank":
            ranks = [pid for pid in self._workerdicts() if (pid in self._all_node_pids("head")) == (fault.node == 0)]
            if not ranks:
                raise RuntimeError(f"{fault}: no trainer rank (ray::WorkerDict) on that node")
            record.killed = [min(ranks)]
        else:
            record.killed = [int(held.read_text())]
        fault_at = time.monotonic()
        for pid in record.killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if fault.kind == "kill_node":
            self.start("worker")  # the replacement node, as a cluster manager would start one
        if following is not None:
            self._arm(holds, following)  # the next fault's moment is in the next attempt
        for name in (f"hold_save_{fault.step}", f"hold_{fault.step}"):
            (holds / name).unlink(missing_ok=True)

        def restarted():
            found = _RESTART.findall(out_path.read_text(errors="replace"))
            return found[restarts_before] if len(found) > restarts_before else None

        match = self._await(f"the launcher's restart after {fault}", proc, out_path, restarted)
        record.acted_s = round(time.monotonic() - fault_at, 1)
        record.restart = next(line for line in out_path.read_text(errors="replace").splitlines()
                              if _RESTART.search(line) and _RESTART.search(line).groups() == match)
        record.resumed_from = int(match[3]) if match[3] else None
        mark = len(out_path.read_text(errors="replace"))

        def next_step():
            return _STEP.search(out_path.read_text(errors="replace")[mark:]) is not None

        self._await(f"the first step after the restart for {fault}", proc, out_path, next_step)
        record.next_step_s = round(time.monotonic() - fault_at, 1)
        for name in (f"held_save_{fault.step}", f"held_{fault.step}.driver"):
            (holds / name).unlink(missing_ok=True)
        alive = [pid for pid in record.killed if _cmdline(pid)]
        record.left = [f"{pid} {_cmdline(pid)[:120]}" for pid in alive]
        return record

    def _all_node_pids(self, prefix: str) -> set[int]:
        return {pid for name in self.nodes if name.startswith(prefix) for pid in self.node_pids(name)}

    def _workerdicts(self) -> list[int]:
        return [pid for name in self.nodes for pid in self.node_pids(name) if _cmdline(pid).startswith("ray::WorkerDict")]

    def left(self) -> list[str]:
        return marked_processes(self.marker)


def attempt_metrics(work: Path) -> list[dict[int, dict[str, float]]]:
    """Each attempt's verl step metrics, in the order the attempts ran (their full logs, ``WORK_DIR/logs``)."""
    logs = sorted((p for p in (work / "logs").glob("*.log") if not p.is_symlink()), key=lambda p: p.stat().st_mtime)
    return [parse_step_metrics(p.read_text(errors="replace")) for p in logs]


def intact_checkpoints(ckpt_dir: Path) -> dict[str, bytes]:
    """``{step folder name: its manifest's bytes}`` of every intact checkpoint in ``ckpt_dir`` (the full check)."""
    out = {}
    for _, folder in sorted(step_folders(ckpt_dir).items()):
        if not verify_folder(folder, full=True, require_manifest=True):
            out[folder.name] = (folder / MANIFEST_NAME).read_bytes()
    return out
