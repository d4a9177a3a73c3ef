"""Faults at seeded moments in a running Slurm SFT job: the chaos test and benchmark of the launchers' restarts.

Issue 44 on the local Slurm (``scripts/local_slurm.sh``): the tiny DS4 SFT job of ``scripts/slurm_submit.sh sft``
(2 nodes x 1 process, CP=2) is hit by faults at moments a seed picks; the launcher brings the run back after each,
and at the end the run has all its steps, each step's loss equal to an uninterrupted run's bit for bit, no intact
checkpoint deleted or changed, and no process of the job left.

* :func:`plan` draws the faults from a seed (kind, step, node) among the schedules the launcher must survive;
  :func:`expect` says what it does after each, by the supervisor's own rules
  (:func:`verl_ds4.recipes.supervise.decide`): which attempt, from which checkpoint, restart or requeue.
* :class:`ChaosJob` submits the job and injects each fault at its moment, waiting on events (a step printed in the
  node-0 log, a checkpoint's files appearing, the tracker, the job's state, ``restarts.json``), never on the clock;
  it records when the launcher acted and when the next attempt trained its first step.
* :class:`LocalSlurm`, :func:`marked_processes`: the local Slurm, and the processes of a job (every process of a
  job carries a marker in its environment).

The kinds (:data:`KINDS`):

``kill_rank``     SIGKILL of one node's trainer rank during step N (after step N-1 was printed and, when N-1 saved,
                  its save ended): the batch script's supervisor runs the ``srun`` step again on every node from
                  the newest intact checkpoint (``MAX_RESTARTS``).
``kill_in_save``  SIGKILL of every trainer rank (and what they forked for the save) inside the save of step N, frozen
                  with SIGSTOP where ``global_step_N`` holds files and no manifest: the supervisor restarts, and the
                  launcher's start-up check renames the unfinished step aside and resumes from the one before.
``usr1``          USR1 to the batch shell during step N, what ``--signal=B:USR1@REQUEUE_BEFORE_S`` sends before the
                  time limit: the run is stopped and the job requeues itself (one of the ``MAX_RESTARTS``).
``requeue``       ``scontrol requeue`` during step N, as Slurm requeues a ``--requeue`` job after a node failure: the
                  batch script runs again and resumes.
``scancel``       ``scancel`` during step N, then the same ``slurm_submit.sh`` command again (a person's stop and
                  resubmission: not a restart; the new job has its own budget).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from verl_ds4.ckpt_manifest import MANIFEST_NAME, TRACKER_NAME, step_folders, verify_folder
from verl_ds4.recipes.supervise import Attempt, decide

__all__ = ["FINAL_STATES", "KINDS", "LAUNCHER_KINDS", "SIGKILL_REASON", "ChaosJob", "Expect", "Fault", "LocalSlurm",
           "PlanError", "base_env", "expect", "free_port", "marked_processes", "plan", "save_steps", "trainer_ranks"]

REPO = Path(__file__).resolve().parents[2]
KINDS = ("kill_rank", "kill_in_save", "usr1", "requeue", "scancel")
#: The faults the job must come back from by itself (``scancel`` is a person's stop).
LAUNCHER_KINDS = ("kill_rank", "kill_in_save", "usr1", "requeue")
#: What the supervisor names when torchrun reports a rank killed by SIGKILL.
SIGKILL_REASON = "a rank was killed by SIGKILL (torchrun: exitcode -9)"
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
                "DEADLINE"}
_TRAINER = ["-u", "-m", "verl.trainer.sft_trainer"]  # a rank's command line after the interpreter
_STEP_LINE = re.compile(r"\bstep:(\d+) - ")


class PlanError(ValueError):
    """A fault schedule the launcher would not survive (and so not a schedule to test it with)."""


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    step: int  # kill_in_save: the save of this step; the others: during this step
    node: int | None = None  # kill_rank: the node whose rank is killed

    def __str__(self) -> str:
        if self.kind == "kill_in_save":
            return f"kill_in_save at the step-{self.step} save"
        return f"{self.kind} during step {self.step}" + (f" (node {self.node})" if self.node is not None else "")


@dataclasses.dataclass(frozen=True)
class Expect:
    """What the launcher does after one fault (from the supervisor's rules)."""

    fault: Fault
    job: int  # which submission it hits (0: the first)
    attempt: int  # the attempt it ends, numbered in its job as restarts.json numbers them
    resumed_from: int | None  # where that attempt started (None: from scratch)
    failed_at: int  # the step the supervisor names ("failed at step N")
    newest: int | None  # the newest intact checkpoint after it: where the next attempt starts
    action: str  # "restart" (the supervisor), "requeue" (the job requeues itself), "slurm requeue", "resubmit"
    used: int  # restarts used in the job after it (restarts.json)
    requeues: int  # Slurm's Restarts count of the job after it


def save_steps(steps: int, save_freq: int) -> list[int]:
    """The steps verl's SFT trainer saves after: every ``save_freq``-th and the last."""
    return sorted({s for s in range(save_freq, steps + 1, save_freq)} | {steps})


def _valid_steps(kind: str, start: int, steps: int, saves: list[int]) -> list[int]:
    """Where a fault of ``kind`` can hit an attempt that started from checkpoint ``start`` (0: scratch): inside a
    save it made, or during a step after its first printed one (the moment is seen in the log)."""
    if kind == "kill_in_save":
        return [s for s in saves if s > start]
    return list(range(start + 2, steps + 1))


def expect(faults: Sequence[Fault], *, steps: int, save_freq: int, max_restarts: int) -> list[Expect]:
    """What the launcher does after each fault, in order; :class:`PlanError` if it would stop the run instead
    (the supervisor's own :func:`decide` on the attempts as restarts.json will hold them) or a fault cannot
    happen where it is placed."""
    saves = save_steps(steps, save_freq)
    out: list[Expect] = []
    job, history, used, requeues, newest = 0, [], 0, 0, None
    for fault in faults:
        if fault.kind not in KINDS:
            raise PlanError(f"unknown fault kind {fault.kind!r}: expected one of {', '.join(KINDS)}")
        start = newest or 0
        if fault.step not in _valid_steps(fault.kind, start, steps, saves):
            raise PlanError(f"{fault}: the attempt it hits starts from step {start}")
        before = fault.step - 1  # the saves that ended before it
        done = [s for s in saves if start < s <= before]
        after = done[-1] if done else newest
        last_step = fault.step if fault.kind == "kill_in_save" else fault.step - 1
        reason = {"kill_rank": SIGKILL_REASON, "kill_in_save": SIGKILL_REASON, "usr1": "requeue",
                  "requeue": "stopped by SIGTERM", "scancel": "stopped by SIGTERM"}[fault.kind]
        attempt = Attempt(len(history) + 1, newest, returncode=1, last_step=last_step, reason=reason,
                          signal="SIGKILL" if reason == SIGKILL_REASON else None)
        history.append(attempt)
        if fault.kind in ("kill_rank", "kill_in_save"):
            # a kill in the first save leaves checkpoints of which none is intact: the supervisor stops there
            none_intact = "none is intact" if fault.kind == "kill_in_save" and after is None else None
            retry, why = decide(history, after, none_intact, max_restarts - used)
            if not retry:
                raise PlanError(f"{fault}: the launcher would not restart: {why}")
            used, action = used + 1, "restart"
        elif fault.kind == "usr1":
            if max_restarts - used <= 0:
                raise PlanError(f"{fault}: no restart left (MAX_RESTARTS={max_restarts})")
            used, requeues, action = used + 1, requeues + 1, "requeue"
        elif fault.kind == "requeue":
            requeues, action = requeues + 1, "slurm requeue"
        else:
            action = "resubmit"
        out.append(Expect(fault, job, attempt.number, newest, attempt.failed_at, after, action, used, requeues))
        if fault.kind == "scancel":
            job, history, used, requeues = job + 1, [], 0, 0
        newest = after
    return out


def plan(seed: int, *, steps: int, save_freq: int, max_restarts: int, kinds: Sequence[str] | None = None,
         n: int | None = None, nodes: int = 2, tries: int = 100_000) -> list[Fault]:
    """A fault schedule drawn from ``seed``: ``kinds`` in a random order (or ``n`` kinds drawn from
    :data:`LAUNCHER_KINDS`), each at a random valid moment after the one before, every one survivable
    (:func:`expect`; the draw: :func:`draw_schedule`). The same seed and arguments give the same schedule."""
    rng = random.Random(seed)
    saves = save_steps(steps, save_freq)

    def choose() -> list[str]:
        if kinds is None:
            return [rng.choice(LAUNCHER_KINDS) for _ in range(n or 0)]
        chosen = list(kinds)
        rng.shuffle(chosen)
        return chosen

    def room(kind: str, faults: list[Fault], expected: list[Expect] | None) -> list[int]:
        return _valid_steps(kind, (expected[-1].newest if expected else None) or 0, steps, saves)

    return draw_schedule(rng, choose, room,
                         lambda faults: expect(faults, steps=steps, save_freq=save_freq, max_restarts=max_restarts),
                         fault=Fault, nodes=nodes, tries=tries,
                         what=f"{kinds or n} faults in {steps} steps (save every {save_freq})")


def draw_schedule(rng: random.Random, choose: Callable[[], list[str]], room: Callable[[str, list, Any], list[int]],
                  survivable: Callable[[list], Any], *, fault: Callable[[str, int, int | None], Any], nodes: int,
                  tries: int, what: str) -> list:
    """The draw both chaos planners share (this module's and :func:`verl_ds4.testing.ray_chaos.plan`): each try takes
    the kinds ``choose()`` returns and puts each at a moment drawn with ``rng`` from its share of the moments
    ``room(kind, faults so far, what survivable returned for them)`` leaves (the first 1/k of them when k faults are
    left, so that the faults spread over the run; None before the first), as ``fault(kind, step, node)`` (a
    ``kill_rank`` also draws its node among ``nodes``); a try counts when ``survivable(faults)`` accepts every prefix
    (it raises :class:`PlanError` otherwise). The first of ``tries`` tries that counts is the schedule."""
    for _ in range(tries):
        chosen = choose()
        faults: list = []
        expected = None
        try:
            for i, kind in enumerate(chosen):
                where = room(kind, faults, expected)
                if not where:
                    raise PlanError("no room")
                share = where[:-(-len(where) // (len(chosen) - i))]  # its share of the steps left: spread over the run
                step = rng.choice(share)
                faults.append(fault(kind, step, rng.randrange(nodes) if kind == "kill_rank" else None))
                expected = survivable(faults)
        except PlanError:
            continue
        return faults
    raise PlanError(f"no survivable schedule of {what} found in {tries} draws")


# ------------------------------------------------------------------------------------------- processes, Slurm


def free_port(_picked: set[int] = set()) -> int:  # noqa: B006 (the ports this process handed out)
    """A port free now, from 20000 up to the kernel's ephemeral range (clear of Ray's defaults 10001-19999): one the
    OS hands out for port 0 can be taken by an outgoing connection before the job binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.SystemRandom()
    while True:
        port = rng.randrange(20000, max(low, 21000))
        if port in _picked:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
        _picked.add(port)
        return port


def base_env(marker: str, **extra: str) -> dict[str, str]:
    """This environment minus any cluster or recipe knob, this interpreter's tools first on PATH, this checkout first
    on PYTHONPATH, and the marker every process of the job inherits (:func:`marked_processes`)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "RAY_", "PET_", "DS4_"))
           and k not in {"MODEL_PATH", "TRAIN_FILES", "VAL_FILES", "NNODES", "GPUS_PER_NODE", "NPROC_PER_NODE", "CP",
                         "WORK_DIR", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "STEPS", "NPROC", "MAX_RESTARTS",
                         "SAVE_FREQ", "N_TRAIN", "JOB_NAME", "CLUSTER_LOG_DIR"}}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHON"] = sys.executable
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env["DS4_TEST_MARKER"] = marker
    env.update(extra)
    return env


def _start_time(pid: str) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _scan(marker: str) -> dict[tuple[str, str], str]:
    """``{(pid, start time): full command line}`` of every live process whose environment carries
    ``DS4_TEST_MARKER=marker`` (the start time tells a process from a later one with its pid)."""
    needle = f"DS4_TEST_MARKER={marker}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if needle not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if stat[0] == "Z":
                continue
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        found[(entry, stat[19])] = cmd.strip()
    return found


def marked_processes(marker: str) -> list[str]:
    """``pid cmdline`` (200 characters) of every live process whose environment carries ``DS4_TEST_MARKER=marker``."""
    return [f"{pid} {cmd[:200]}" for (pid, _), cmd in _scan(marker).items()]


def _is_rank(cmd: str, node: int | None = None) -> bool:
    return cmd.split()[1:4] == _TRAINER and (node is None or f"/assets/node{node}/" in cmd)


def trainer_ranks(marker: str, node: int | None = None) -> list[int]:
    """The pids of the job's trainer ranks (``python -u -m verl.trainer.sft_trainer``: not torchrun, not the console
    above it; with any process a rank forked for a save, which has the same command line), of one node or all."""
    return [int(pid) for (pid, _), cmd in _scan(marker).items() if _is_rank(cmd, node)]


def _alive(identity: tuple[str, str]) -> bool:
    return _start_time(identity[0]) == identity[1]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _stopping(pid: int) -> bool:
    """The process is gone, or a SIGTERM or SIGKILL is pending on it (it is frozen: the signal waits for SIGCONT)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    if re.search(r"^State:\s+Z", status, re.M):
        return True
    pending = 0
    for m in re.finditer(r"^(?:SigPnd|ShdPnd):\s+([0-9a-f]+)", status, re.M):
        pending |= int(m.group(1), 16)
    return bool(pending & (1 << (signal.SIGTERM - 1) | 1 << (signal.SIGKILL - 1)))


class LocalSlurm:
    """The Slurm of ``scripts/local_slurm.sh`` in ``directory`` (``up`` / ``down`` run that script)."""

    def __init__(self, directory: Path, nodes: int = 2, timeout: float = 600):
        self.dir = Path(directory)
        self.conf = self.dir / "slurm.conf"
        self.nodes = nodes
        self.timeout = timeout  # what wait() gives a job by default

    def _script(self, action: str, timeout: float) -> subprocess.CompletedProcess:
        env = {**os.environ, "LOCAL_SLURM_DIR": str(self.dir), "LOCAL_SLURM_NODES": str(self.nodes)}
        return subprocess.run(["bash", "scripts/local_slurm.sh", action], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=timeout)

    def up(self) -> subprocess.CompletedProcess:
        return self._script("up", 600)

    def down(self) -> subprocess.CompletedProcess:
        return self._script("down", 120)

    def daemon_pids(self) -> dict[str, int]:
        return {f.name: int(f.read_text()) for f in (self.dir / "run").glob("*.pid")}

    def env(self, marker: str, **extra: str) -> dict[str, str]:
        return base_env(marker, SLURM_CONF=str(self.conf), **extra)

    def _slurm_env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def job(self, job_id: str) -> dict[str, str]:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                             env=self._slurm_env())
        return dict(re.findall(r"(\w+)=(\S*)", out.stdout))

    def wait(self, job_id: str, timeout: float | None = None) -> dict[str, str]:
        """Until the job is in a final state (its record), polling scontrol; scancel and fail after ``timeout``."""
        timeout = timeout or self.timeout
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in FINAL_STATES:
                return info
            if time.monotonic() > deadline:
                self.cancel(job_id)
                raise AssertionError(f"job {job_id} did not end in {timeout:.0f} s: {info}")
            time.sleep(0.5)

    def cancel(self, job_id: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["scancel", *args, job_id], capture_output=True, text=True, env=self._slurm_env())

    def requeue(self, job_id: str) -> subprocess.CompletedProcess:
        return subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, env=self._slurm_env())

    def submit(self, args: list[str], env: dict[str, str]) -> tuple[str, str]:
        """``bash scripts/slurm_submit.sh ARGS`` -> (job id, what the submitter printed)."""
        out = subprocess.run(["bash", "scripts/slurm_submit.sh", *args], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=120)
        if out.returncode != 0:
            raise AssertionError(f"slurm_submit.sh failed ({out.returncode}):\n{out.stdout}{out.stderr}")
        return re.search(r"Submitted batch job (\d+)", out.stdout).group(1), out.stdout

    def queued(self) -> list[str]:
        out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=self._slurm_env())
        return out.stdout.split()


# ------------------------------------------------------------------------------------------------ the job


class ChaosJob:
    """One SFT run through ``slurm_submit.sh sft`` (resubmitted after a ``scancel``), hit by faults in order.

    ``env``: the submission's environment (WORK_DIR, CLUSTER_LOG_DIR, JOB_NAME, the step knobs, the marker).
    Every wait polls an event and fails after ``timeout`` seconds naming what it waited for.

    ``faults``: the schedule, in order. The run is then held at each fault's moment until the fault is in
    (:mod:`verl_ds4.testing.hold_steps`: before step N's training for a fault during step N, before the manifest of
    step N for a kill in its save), so a loaded machine cannot let the run pass the moment while the test is still
    busy with the fault before: the next fault's hold is set while the current one is injected (the first one's
    before the first submission), and each hold is released once its fault is in.
    """

    def __init__(self, slurm: LocalSlurm, env: dict[str, str], *, timeout: float = 600,
                 say: Callable[[str], None] = print, faults: Sequence[Fault] = ()):
        self.slurm, self.timeout, self.say = slurm, timeout, say
        self.faults = list(faults)
        self.work = Path(env["WORK_DIR"])
        self.holds = self.work / "holds"
        if self.faults:
            self.holds.mkdir(parents=True, exist_ok=True)
            env = {**env, "VERL_DS4_TEST_MODULES": "verl_ds4.testing.hold_steps", "VERL_DS4_TEST_HOLD_DIR": str(self.holds)}
        self.env = env
        self.ckpt = self.work / "checkpoints"
        self.tracker = self.ckpt / TRACKER_NAME
        self.name = env["JOB_NAME"]
        self.marker = env["DS4_TEST_MARKER"]
        self.jobs: list[str] = []
        self.submitted: list[str] = []
        self.records: list[dict] = []
        self.intact: dict[str, bytes] = {}  # every intact step folder seen: its manifest's bytes
        self.t0 = time.monotonic()

    # -- what the job wrote
    @property
    def job_id(self) -> str:
        return self.jobs[-1]

    def out(self, job_id: str | None = None) -> str:
        path = self.work / "slurm" / f"{self.name}-{job_id or self.job_id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def node_log_dir(self, job_id: str | None = None) -> Path:
        return self.work / "slurm" / f"{self.name}-{job_id or self.job_id}"

    def restarts(self, job_id: str | None = None) -> dict:
        path = self.node_log_dir(job_id) / "restarts.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {"used": 0, "attempts": []}

    def attempt_logs(self) -> list[Path]:
        """The node-0 trainer logs, one per attempt, oldest first."""
        return sorted((self.work / "logs").glob("*-node0.log"))

    def steps_in(self, log: Path) -> list[int]:
        return [int(s) for s in _STEP_LINE.findall(log.read_text(errors="replace"))]

    def state(self) -> dict[str, str]:
        return self.slurm.job(self.job_id)

    # -- waiting on events
    def wait_for(self, what: str, ready: Callable[[], object], *, poll: float = 0.05, alive: bool = True,
                 timeout: float | None = None):
        """Poll ``ready()`` until it returns something truthy (returned); fail naming ``what`` after the timeout,
        or as soon as the job ended (``alive``: it must be running meanwhile; its state is read every second)."""
        limit = timeout or self.timeout
        deadline = time.monotonic() + limit
        next_state = time.monotonic() + 1.0
        while True:
            if value := ready():
                return value
            if alive and self.jobs and time.monotonic() > next_state:
                next_state = time.monotonic() + 1.0
                if (state := self.state().get("JobState")) in FINAL_STATES:
                    if value := ready():
                        return value
                    raise AssertionError(f"job {self.job_id} ended ({state}) while waiting for {what}\n"
                                         f"{self.out()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"waited {limit:.0f} s for {what} (job {self.job_id}: "
                                     f"{self.state().get('JobState')})\n{self.out()[-3000:]}")
            time.sleep(poll)

    def _snapshot_intact(self) -> None:
        for step, folder in step_folders(self.ckpt).items():
            manifest = folder / MANIFEST_NAME
            if folder.name not in self.intact and manifest.is_file() and not verify_folder(folder):
                self.intact[folder.name] = manifest.read_bytes()

    # -- the run
    def submit(self) -> str:
        if not self.jobs and self.faults:
            self._arm(0)
        job_id, printed = self.slurm.submit(["sft"], self.env)
        self.jobs.append(job_id)
        self.submitted.append(printed)
        self.say(f"[chaos] {self.clock()} submitted job {job_id}")
        return job_id

    def clock(self) -> str:
        return f"{time.monotonic() - self.t0:6.1f}s"

    def _current_log(self, attempts: int) -> Path | None:
        logs = self.attempt_logs()
        return logs[-1] if len(logs) == attempts else None

    @staticmethod
    def _hold_name(fault: Fault) -> str:
        return f"hold_save_{fault.step}" if fault.kind == "kill_in_save" else f"hold_{fault.step}"

    def _arm(self, index: int) -> None:
        """Set the hold of the ``index``-th fault (none past the last)."""
        if index < len(self.faults):
            (self.holds / self._hold_name(self.faults[index])).touch()

    def _release(self, fault: Fault) -> None:
        name = self._hold_name(fault)
        (self.holds / name).unlink(missing_ok=True)
        for marker in self.holds.glob(name.replace("hold", "held", 1) + "*"):
            marker.unlink(missing_ok=True)

    def _held(self, fault: Fault) -> bool:
        """Every trainer rank waits at the fault's hold (a kill in a save: rank 0, before the manifest)."""
        held = list(self.holds.glob(self._hold_name(fault).replace("hold", "held", 1) + "*"))
        if fault.kind == "kill_in_save":
            return bool(held)
        ranks = [cmd for cmd in _scan(self.marker).values() if _is_rank(cmd)]
        return bool(held) and len(held) >= len(ranks)

    def _wait_for_the_moment(self, fault: Fault, attempts: int) -> None:
        """Until the fault's moment: step N-1 printed by the current attempt (``attempts``-th node-0 log) and, when
        N-1 saved, that save ended (the tracker on N-1); for a kill in a save, the step-N folder holding files.
        With the schedule given, the run waits there at the fault's hold (first awaited here)."""
        if self.faults:
            self.wait_for(f"the run held at {fault}'s moment ({self.holds / self._hold_name(fault)})",
                          lambda: self._held(fault), poll=0.02)
        if fault.kind == "kill_in_save":
            folder = self.ckpt / f"global_step_{fault.step}"
            self.wait_for(f"the save of step {fault.step} to begin ({folder} holding files)",
                          lambda: folder.is_dir() and any(p.is_file() for p in folder.rglob("*")), poll=0.01)
            return
        prev = fault.step - 1
        self.wait_for(f"step {prev} in attempt {attempts}'s node-0 log",
                      lambda: (log := self._current_log(attempts)) is not None and prev in self.steps_in(log),
                      poll=0.02)
        if prev in self._saves:
            self.wait_for(f"the step-{prev} save to end (tracker on {prev})",
                          lambda: self.tracker.exists() and self.tracker.read_text().strip() == str(prev), poll=0.02)

    def _last_step(self, attempts: int) -> int | None:
        log = self._current_log(attempts)
        steps = self.steps_in(log) if log else []
        return max(steps) if steps else None

    def _inject(self, fault: Fault, attempts: int, record: dict) -> dict[tuple[str, str], str]:
        """Freeze every trainer rank (SIGSTOP: the run cannot move past the moment), note the last step printed,
        then: SIGKILL the victims (a kill; the others go on), or send the signal / run the command and let the
        ranks go on once it reached them (a SIGTERM or SIGKILL pending on each, or the rank gone). Returns the
        job's processes at that moment."""
        procs = _scan(self.marker)
        ranks = [int(pid) for (pid, _), cmd in procs.items() if _is_rank(cmd)]
        if not ranks:
            raise AssertionError(f"no trainer rank for {fault}:\n" + "\n".join(procs.values()))
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        victims: list[int] = []
        try:
            record["landed_after_step"] = self._last_step(attempts)
            if fault.kind == "kill_in_save":
                folder = self.ckpt / f"global_step_{fault.step}"
                record["manifest_then"] = (folder / MANIFEST_NAME).exists()
                record["tracker_then"] = self.tracker.read_text().strip() if self.tracker.exists() else None
                record["files_then"] = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                                              if p.is_file())
                record["ranks_on_nodes"] = [n for n in range(self.slurm.nodes)
                                            if any(_is_rank(cmd, n) for cmd in procs.values())]
                victims = ranks
            elif fault.kind == "kill_rank":
                victims = [int(pid) for (pid, _), cmd in procs.items() if _is_rank(cmd, fault.node)]
                if not victims:
                    raise AssertionError(f"no trainer rank on node {fault.node}:\n" + "\n".join(procs.values()))
            else:
                done = (self.slurm.cancel(self.job_id, "--batch", "--signal=USR1") if fault.kind == "usr1" else
                        self.slurm.requeue(self.job_id) if fault.kind == "requeue" else self.slurm.cancel(self.job_id))
                if done.returncode != 0:
                    raise AssertionError(f"{fault}: {done.args} failed: {done.stderr}")
                self.wait_for(f"the stop ({fault.kind}) to reach the frozen trainer ranks (SIGTERM pending)",
                              lambda: all(_stopping(pid) for pid in ranks), alive=False)
        finally:
            for pid in victims:
                _signal(pid, signal.SIGKILL)
            if self.faults:  # the next fault's hold is set before this attempt's ranks can move again
                self._arm(len(self.records) + 1)
                self._release(fault)
            for pid in ranks:
                _signal(pid, signal.SIGCONT)
        record["killed"] = victims
        return procs

    def hit(self, fault: Fault, want: Expect) -> dict:
        """Wait for the fault's moment, inject it, wait for the launcher's action and for the next attempt's first
        step; return what happened and when."""
        attempts = len(self.records) + 1  # each attempt writes one node-0 log
        self._wait_for_the_moment(fault, attempts)
        record: dict = {"fault": str(fault), "job": self.job_id}
        t_fault = time.monotonic()
        before = self._inject(fault, attempts, record)
        self._snapshot_intact()
        self.say(f"[chaos] {self.clock()} {fault}: injected after step {record['landed_after_step']} "
                 f"(job {self.job_id})")
        job = self.job_id
        if want.action == "restart":
            self.wait_for(f"the supervisor's restart {want.used} (restarts.json of job {job})",
                          lambda: self.restarts(job)["used"] >= want.used)
        elif want.action in ("requeue", "slurm requeue"):
            self.wait_for(f"job {job} requeued (PENDING, Restarts={want.requeues})",
                          lambda: (info := self.state()).get("JobState") == "PENDING"
                          and info.get("Restarts") == str(want.requeues), alive=False)
        else:
            record["cancelled"] = self.slurm.wait(job, timeout=self.timeout).get("JobState")
            self.wait_for(f"every process of the cancelled job {job} to end",
                          lambda: not marked_processes(self.marker), alive=False)
        t_action = time.monotonic()
        if want.action == "resubmit":
            self.submit()
        log = self.wait_for(f"the next attempt's first step after {fault}",
                            lambda: (lg := self._current_log(attempts + 1)) is not None and self.steps_in(lg) and lg)
        t_step = time.monotonic()
        record["first_step_after"] = min(self.steps_in(log))
        # Every process of the stopped attempt is gone by then (but the job's batch shell and supervisor, when the
        # job goes on): waited for a while, as a manager process ends within 0.5 s of its rank.
        keep = ("slurm_script", "scripts/supervise.py") if want.action == "restart" else ()
        stale = {k: cmd for k, cmd in before.items() if not any(s in cmd for s in keep)}
        deadline = time.monotonic() + 120  # an event poll: a generous bound costs nothing when all is gone
        while (left := [f"{k[0]} {c}" for k, c in stale.items() if _alive(k)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        record["processes_then"] = len(before)
        record["left_behind"] = left
        node0 = self.node_log_dir() / "node0.log"
        record["node0_log"] = node0.read_text(errors="replace") if node0.exists() else ""
        record.update(action=want.action, action_s=round(t_action - t_fault, 1),
                      first_step_s=round(t_step - t_fault, 1))
        self.say(f"[chaos] {self.clock()} {fault}: {want.action} after {record['action_s']} s; step "
                 f"{record['first_step_after']} trained {record['first_step_s']} s after the fault")
        self.records.append(record)
        return record

    @property
    def _saves(self) -> list[int]:
        return save_steps(int(self.env["STEPS"]), int(self.env["SAVE_FREQ"]))

    def finish(self) -> dict[str, str]:
        """Wait for the last job to end; its final record."""
        info = self.slurm.wait(self.job_id, timeout=self.timeout)
        self._snapshot_intact()
        self.say(f"[chaos] {self.clock()} job {self.job_id}: {info.get('JobState')} {info.get('ExitCode')}")
        return info
