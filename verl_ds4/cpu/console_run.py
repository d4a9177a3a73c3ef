"""The quiet console's runner: the command's full output to a log file, a view's lines to the console.

:func:`run_quiet` runs a command with stdout and stderr teed, byte for byte, to a log file; the console
shows what a :class:`ConsoleView` makes of the output. ``verbose=True`` also passes every byte through.
On a non-zero exit the last lines of the log (:func:`log_tail`) and its path are printed and the exit
status is passed on. The views: :mod:`verl_ds4.cpu.console_sft` and :mod:`verl_ds4.cpu.console_ppo`;
the command line: :mod:`verl_ds4.cpu.console`.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

PREFIX = "[verl-ds4]"
TAIL_LINES = 40
MAX_TAIL_LINE = 1000  # characters of one log line in the failure tail (the rest stays in the log)
#: The engine's start-up line naming the CP layout it resolved (engine, layout, facts).
LAYOUT_LINE = re.compile(r"verl-ds4 (\w+): (\w+) CP layout \(([^)]*)\)")
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def layout_fact(match: re.Match) -> str:
    """The console line of a :data:`LAYOUT_LINE` match: the layout, its facts and the engine that resolved it."""
    return say(f"{'CP layout':<11} {match.group(2)} ({match.group(3)}), resolved by {match.group(1)}")


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def new_log_path(log_dir: str | Path) -> Path:
    """``log_dir/<YYYYmmdd-HHMMSS>.log`` (a suffix when that name is taken)."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = log_dir / f"{stamp}.log", 1
    while path.exists():
        path, n = log_dir / f"{stamp}-{n}.log", n + 1
    return path


_TORCHRUN_FAILED = re.compile(r"torch/distributed/elastic/multiprocessing/api\.py:\d+\] (failed \(exitcode.*)$")


def log_tail(path: str | Path, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of a log (ANSI codes and tqdm's carriage-return redraws removed).

    torchrun ends a failed run with a 40-line report of its own (its traceback and a table of the
    failed ranks) that would push the workers' error out of the tail: the tail then ends before that
    report, which is named in one line (it stays in the log).
    """
    path = Path(path)
    text = path.read_text(errors="replace") if path.exists() else ""
    all_lines = [line.rsplit("\r", 1)[-1] for line in ANSI_ESCAPE.sub("", text).splitlines()]
    report = None
    for i in range(len(all_lines) - 1, -1, -1):
        if m := _TORCHRUN_FAILED.search(all_lines[i]):
            report = f"(then torchrun's report: {m.group(1)}; {len(all_lines) - i} lines, in the log)"
            all_lines = all_lines[:i]
            break
    out = []
    for line in all_lines[-lines:]:
        if len(line) > MAX_TAIL_LINE:
            line = line[:MAX_TAIL_LINE] + f" ... ({len(line) - MAX_TAIL_LINE} more characters in the log)"
        out.append(line)
    return out + ([report] if report else [])


#: Failures whose cause is known and outside the run's settings: (pattern in the log, what to say).
KNOWN_FAILURES = (
    (re.compile(r"EADDRINUSE|server socket has failed to listen.*address already in use", re.S),
     "a TCP port was taken between being chosen and being bound (\"address already in use\"). In a Ray "
     "job verl's worker group picks torch.distributed's MASTER_PORT by binding port 0 and freeing it, and "
     "another process on this host can bind that port before rank 0 does (verl #5889); under torchrun, "
     "another job may hold its MASTER_PORT. If no other job holds the port named above, run it again."),
)


def failure_hints(lines: Iterable[str]) -> list[str]:
    """What :data:`KNOWN_FAILURES` says about a failed run's log lines (empty when nothing matches)."""
    text = "\n".join(lines)
    return [hint for pattern, hint in KNOWN_FAILURES if pattern.search(text)]


def say(text: str = "") -> str:
    """One console line of ours: ``[verl-ds4] text``."""
    return f"{PREFIX} {text}".rstrip()


# ------------------------------------------------------------------------------------- the runner


class ConsoleView:
    """What a person sees of a run. Subclasses turn log lines into console lines."""

    name = "run"

    def header(self, log_path: Path) -> list[str]:
        return [say(f"full log: {log_path}")]

    def on_line(self, line: str) -> list[str]:
        """Console lines for one output line (ANSI-free, one tqdm redraw at a time)."""
        return []

    def summary(self, log_path: Path, returncode: int, wall_s: float) -> list[str]:
        return [say(f"wall time {format_duration(wall_s)}; full log: {log_path}")]


def run_quiet(
    cmd: Sequence[str],
    log_path: str | Path,
    view: ConsoleView | None = None,
    *,
    verbose: bool = False,
    env: dict | None = None,
    cwd: str | Path | None = None,
    out=None,
) -> int:
    """Run ``cmd`` with its output teed to ``log_path``; print ``view``'s lines; return the exit status.

    The console (``out``, default ``sys.stdout``) gets the view's header, its lines for the output,
    and its summary; with ``verbose`` also the command's own output, unchanged. A non-zero exit adds
    the last :data:`TAIL_LINES` lines of the log and its path.
    """
    view = view or ConsoleView()
    out = out or sys.stdout
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)

    def emit(lines: Iterable[str]) -> None:
        for line in lines:
            out.write(line + "\n")
        out.flush()

    emit(view.header(log_path))
    env = dict(os.environ if env is None else env)
    env.setdefault("PYTHONUNBUFFERED", "1")  # a pipe would block-buffer the trainer's prints: progress arrives live
    start = time.monotonic()
    pending = ""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            fd = proc.stdout.fileno()
            while True:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                log.write(chunk)
                log.flush()
                if verbose:
                    out.flush()
                    raw = getattr(out, "buffer", None)
                    if raw is not None:
                        raw.write(chunk)
                        raw.flush()
                    else:
                        out.write(chunk.decode(errors="replace"))
                pending += chunk.decode(errors="replace")
                *segments, pending = re.split(r"[\r\n]", pending)
                for segment in segments:
                    emit(view.on_line(ANSI_ESCAPE.sub("", segment)))
            if pending:
                emit(view.on_line(ANSI_ESCAPE.sub("", pending)))
            returncode = proc.wait()
        except KeyboardInterrupt:
            proc.wait()  # the child is in our process group: it got the same SIGINT
            returncode = proc.returncode if proc.returncode else 130
    wall = time.monotonic() - start
    if returncode != 0:
        emit(
            [say(f"FAILED: {' '.join([Path(cmd[0]).name, *cmd[1:3]])} ... exited with status {returncode} after "
                 f"{format_duration(wall)}."),
             say(f"last lines of the full log (up to {TAIL_LINES}):")]
            + ["    " + line for line in log_tail(log_path)]
            + [say(f"known cause: {hint}") for hint in failure_hints(log_tail(log_path, 400))]
            + [say(f"FAILED (exit {returncode}); full log: {log_path}")]
        )
        return returncode
    emit(view.summary(log_path, returncode, wall))
    return 0
