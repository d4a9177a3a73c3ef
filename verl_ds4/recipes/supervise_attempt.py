"""One attempt of a supervised run (:mod:`verl_ds4.recipes.supervise`): run it, read it, stop it.

:class:`Runner` runs the command in a session of its own with its stdout and stderr passed through unchanged,
reads their lines (and, after it ends, the last lines of files it wrote: the Slurm node logs) for the last
training step it printed and its error; :func:`failure_reason` names what ended it. ``Runner.stop`` ends it and
every process it started (torchrun's ranks run in sessions of their own: each is signalled by pid).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

TAIL = 200  # output lines kept per attempt to name its failure
STOP_GRACE_S = 30.0  # seconds an attempt gets to end after SIGTERM before SIGKILL

_STEP = re.compile(r"(?:\bstep:(\d+) - |\[verl-ds4\] step (\d+)/\d+)")
_EXITCODE = re.compile(r"exitcode\W+(-\d+)")
_SIGNAL_LINE = re.compile(r"Signal (\d+) \((SIG\w+)\) received")
_ERROR = re.compile(r"^\s*([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)):?\s?(.*)$")
_REFUSAL = re.compile(r"^(?:\[verl-ds4\] FAILED: |error: |verl-ds4: )(.+)$")  # the launchers' and checks' refusals
#: How one process stops another (torchrun and srun end the other ranks and tasks with SIGTERM once one fails):
#: not a fault of its own, so not a sign that a process was lost.
STOPPING = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
_NUMBER = re.compile(r"\d{3,}")


@dataclasses.dataclass
class Attempt:
    """One run of the command and how it ended."""

    number: int
    resumed_from: int | None  # the newest intact checkpoint step when it started (None: none)
    returncode: int = 0
    last_step: int | None = None  # the last training step it printed
    reason: str = ""
    signal: str | None = None  # the signal that killed it or one of its processes
    seconds: float = 0.0

    @property
    def failed_at(self) -> int:
        """The step it was training when it failed (the one after the last it printed or resumed from)."""
        return (self.last_step if self.last_step is not None else self.resumed_from or 0) + 1

    @property
    def signature(self) -> tuple:
        return self.failed_at, _NUMBER.sub("N", self.reason)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def failure_reason(returncode: int, lines) -> tuple[str, str | None]:
    """(what ended the attempt, the signal that killed a process of it or None), from its exit and output.

    A process killed by a signal of :data:`STOPPING` was stopped by another (torchrun and srun end the other ranks
    and tasks so once one fails): that is not named as the fault, and the rank whose own death began it (torchrun's
    ``exitcode: -N``) or the error a process printed is looked for first.
    """
    def fault(number: int) -> bool:
        return number not in {s.value for s in STOPPING}

    if returncode < 0 and fault(-returncode):
        return f"killed by {signal_name(-returncode)}", signal_name(-returncode)
    lines = list(lines)
    for line in reversed(lines):
        if (m := _EXITCODE.search(line)) and int(m.group(1)) < 0 and fault(-int(m.group(1))):
            name = signal_name(-int(m.group(1)))
            return f"a rank was killed by {name} (torchrun: exitcode {m.group(1)})", name
    for line in reversed(lines):
        if (m := _SIGNAL_LINE.search(line)) and fault(int(m.group(1))):
            return f"a process was killed by {m.group(2)}", m.group(2)
    status = returncode - 128 if returncode > 128 else -returncode
    if status > 0 and status in {s.value for s in signal.Signals} and fault(status):
        return f"killed by {signal_name(status)} (exit status {returncode})", signal_name(status)
    for line in reversed(lines):
        if m := _ERROR.match(line) or _REFUSAL.match(line):
            return (f"{m.group(1)}: {m.group(2)}" if m.re is _ERROR else m.group(1))[:300].rstrip(": "), None
    if status > 0 and status in {s.value for s in signal.Signals}:
        return f"stopped by {signal_name(status)} (exit status {returncode})", None
    return f"exit status {returncode}", None


class Runner:
    """Runs one attempt in a session of its own; stops it (and every process it started) on request."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.stop_reason: str | None = None

    def stop(self, why: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = why
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        family = _family(proc.pid)
        for pid in family:  # torchrun's ranks run in sessions of their own: signal each by pid
            _kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in family:
            _kill(pid, signal.SIGKILL)

    def run(self, cmd: list[str], env: dict, attempt: Attempt, logs=()) -> Attempt:
        """Run one attempt; its stdout and stderr go to ours unchanged, their lines (then the last lines of
        ``logs``, files the attempt wrote: the Slurm node logs) are read for steps and errors."""
        tail: collections.deque[str] = collections.deque(maxlen=TAIL)
        start = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
        streams = {self.proc.stdout.fileno(): (sys.stdout.buffer, [b""]),
                   self.proc.stderr.fileno(): (sys.stderr.buffer, [b""])}
        with selectors.DefaultSelector() as selector:
            for fd in streams:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                for key, _ in selector.select():
                    out, pending = streams[key.fd]
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        selector.unregister(key.fd)
                        if pending[0]:
                            self._line(pending[0].decode(errors="replace"), tail, attempt)
                        continue
                    out.write(chunk)
                    out.flush()
                    *lines, pending[0] = (pending[0] + chunk).split(b"\n")
                    for raw in lines:
                        self._line(raw.decode(errors="replace"), tail, attempt)
        attempt.returncode = self.proc.wait()
        attempt.seconds = time.monotonic() - start
        for log in map(Path, logs):
            text = log.read_text(errors="replace") if log.is_file() else ""
            for line in text.splitlines()[-TAIL:]:
                self._line(line, tail, attempt)
        if attempt.returncode != 0:
            attempt.reason, attempt.signal = failure_reason(attempt.returncode, tail)
        return attempt

    @staticmethod
    def _line(line: str, tail, attempt: Attempt) -> None:
        line = line.rsplit("\r", 1)[-1]
        tail.append(line)
        if m := _STEP.search(line):
            attempt.last_step = max(attempt.last_step or 0, int(m.group(1) or m.group(2)))


def _family(pid: int) -> list[int]:
    try:
        import psutil

        return [p.pid for p in psutil.Process(pid).children(recursive=True)] + [pid]
    except Exception:  # psutil missing or the process gone: the session's group is the fallback
        return [pid]


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


