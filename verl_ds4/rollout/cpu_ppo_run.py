"""Run the CPU PPO launcher under guard rails, and read its console metrics.

verl's PPO trainer can wait forever instead of failing on a CPU machine (TransferQueue's
``tq.init`` and Ray actor creation block when Ray has too few logical CPUs). :func:`run_guarded`
runs a command in its own process group with a wall-clock limit and a memory limit (peak RSS
summed over the whole process tree: driver, Ray's daemons and every worker), and on breach kills
the group and raises :class:`CPUPPORunError` with a message that says what happened, what the
usual cause is and the end of the log.

:func:`parse_step_metrics` reads verl's console logger lines (``step:N - key:value - ...``);
:func:`summary_table` prints the few that matter for the demo (reward, value loss, KL, step time).

:class:`PPOConsole` is the launcher's quiet console (a :class:`verl_ds4.cpu.console.ConsoleView`): the
full output of verl, Ray and the workers goes to ``WORK_DIR/logs/<timestamp>.log``; the console shows
the start-up facts, one line per PPO step (reward, value loss, KL, step time, ETA) and the summary.

    python -m verl_ds4.rollout.cpu_ppo_run --summarize runs/ds4_proxy_ppo_cpu/logs/latest.log
    python -m verl_ds4.rollout.cpu_ppo_run --work-dir W --steps 3 [--verbose] [--fact k=v ...] -- CMD...
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from verl_ds4.cpu.console import ConsoleView, format_duration, link_latest, new_log_path, run_quiet, say

__all__ = ["CPUPPORunError", "PPOConsole", "RunResult", "parse_step_metrics", "run_guarded", "summary_table"]

# (metric key in verl's console line, column title)
SUMMARY_COLUMNS = (
    ("critic/score/mean", "reward"),
    ("critic/vf_loss", "value_loss"),
    ("actor/kl_loss", "kl(actor|ref)"),
    ("actor/pg_loss", "pg_loss"),
    ("critic/values/mean", "value_mean"),
    ("response_length/mean", "resp_len"),
    ("timing_s/gen", "gen_s"),
    ("timing_s/step", "step_s"),
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP_LINE = re.compile(r"(?:^|\s)step:(\d+) - (.*)$")
_LAYOUT = re.compile(r"verl-ds4 (\w+): (\w+) CP layout \(([^)]*)\)")
_ROLLOUT_READY = re.compile(r"(cpu_demo rollout server \d+ ready)")

HANG_HINT = (
    "verl's PPO trainer waits instead of failing when Ray lacks resources: TransferQueue needs one logical CPU "
    "for its controller plus one per storage unit (configs/cpu/laptop.yaml sets ray_kwargs.ray_init.num_cpus=16 "
    "and transfer_queue.backend.SimpleStorage.num_data_storage_units=1), and the worker groups need "
    "trainer.n_gpus_per_node logical GPUs (ray_kwargs.ray_init.num_gpus). Check those overrides, and that no "
    "other Ray cluster is running on this machine (`ray status`)."
)


class CPUPPORunError(RuntimeError):
    """The guarded run failed, timed out or used too much memory."""


@dataclass
class RunResult:
    returncode: int
    wall_s: float
    peak_rss_gb: float
    log: str
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)


def _tree_rss_bytes(root_pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(path: Path, lines: int = 40) -> str:
    text = _ANSI.sub("", path.read_text(errors="replace")) if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def run_guarded(
    cmd: list[str],
    log_path: str | Path,
    *,
    timeout_s: float,
    rss_limit_gb: float,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    poll_s: float = 1.0,
) -> RunResult:
    """Run ``cmd`` (stdout+stderr to ``log_path``) with a wall-clock and a process-tree RSS limit.

    Returns the result on exit status 0; raises :class:`CPUPPORunError` on a non-zero exit, a
    timeout (likely a hang, see :data:`HANG_HINT`) or an RSS above ``rss_limit_gb``. Ray processes
    started by the command are in its process group and are killed with it.
    """
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    peak = 0
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        try:
            while proc.poll() is None:
                elapsed = time.monotonic() - start
                peak = max(peak, _tree_rss_bytes(proc.pid))
                if peak > rss_limit_gb * 2**30:
                    _kill_group(proc)
                    raise CPUPPORunError(
                        f"{' '.join(cmd[:3])}...: the process tree used {peak / 2**30:.1f} GB RSS, above the "
                        f"{rss_limit_gb} GB limit, after {elapsed:.0f} s; killed.\n--- end of {log_path} ---\n"
                        f"{_tail(log_path)}"
                    )
                if elapsed > timeout_s:
                    _kill_group(proc)
                    raise CPUPPORunError(
                        f"{' '.join(cmd[:3])}...: no result after {timeout_s:.0f} s; killed (peak RSS "
                        f"{peak / 2**30:.1f} GB). {HANG_HINT}\n--- end of {log_path} ---\n{_tail(log_path)}"
                    )
                time.sleep(poll_s)
        except BaseException:
            if proc.poll() is None:
                _kill_group(proc)
            raise
    wall = time.monotonic() - start
    # Ray's daemons may outlive the driver for a moment; they are in the same process group.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    text = _ANSI.sub("", log_path.read_text(errors="replace"))
    if proc.returncode != 0:
        raise CPUPPORunError(
            f"{' '.join(cmd[:3])}... exited with status {proc.returncode} after {wall:.0f} s.\n"
            f"--- end of {log_path} ---\n{_tail(log_path)}"
        )
    return RunResult(proc.returncode, wall, peak / 2**30, text, parse_step_metrics(text))


def parse_step_metrics(text: str) -> dict[int, dict[str, float]]:
    """``{step: {metric: value}}`` from verl's console logger lines (``step:N - a:1.0 - b:2 ...``)."""
    steps: dict[int, dict[str, float]] = {}
    for line in _ANSI.sub("", text).splitlines():
        match = _STEP_LINE.search(line)
        if not match:
            continue
        values: dict[str, float] = {}
        for item in match.group(2).split(" - "):
            key, sep, value = item.strip().rpartition(":")
            if not sep:
                continue
            try:
                values[key] = float(value)
            except ValueError:
                continue
        steps[int(match.group(1))] = values
    return steps


def summary_table(metrics: dict[int, dict[str, float]]) -> str:
    """A small fixed-width table of :data:`SUMMARY_COLUMNS` per step."""
    header = ["step"] + [title for _, title in SUMMARY_COLUMNS]
    rows = [header]
    for step in sorted(metrics):
        row = [str(step)]
        for key, _ in SUMMARY_COLUMNS:
            value = metrics[step].get(key)
            row.append("-" if value is None else f"{value:.4g}")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def _line_metrics(line: str) -> tuple[int, dict[str, float]] | None:
    metrics = parse_step_metrics(line)
    return next(iter(metrics.items())) if metrics else None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


class PPOConsole(ConsoleView):
    """The CPU PPO/GRPO launcher's console: facts, one line per PPO step with an ETA, the summary table."""

    name = "ppo"

    def __init__(self, work_dir: str | Path, total_steps: int, *, facts=()):
        self.work_dir = Path(work_dir)
        self.total_steps = total_steps
        self.facts = list(facts)
        self._layouts: set[str] = set()
        self._ready = False
        self._start = time.monotonic()
        self._step_times: list[float] = []
        self._printed: set[int] = set()

    def header(self, log_path: Path) -> list[str]:
        lines = [say(f"{key:<11} {value}") for key, value in self.facts]
        lines.append(say(f"{'log':<11} {log_path} (verl, Ray and worker output; VERBOSE=1 shows it here)"))
        return lines

    def on_line(self, line: str) -> list[str]:
        if "step:" in line and (found := _line_metrics(line)):
            step, m = found
            if step in self._printed:
                return []
            self._printed.add(step)
            if "timing_s/step" in m:
                self._step_times.append(m["timing_s/step"])
            mean = sum(self._step_times) / len(self._step_times) if self._step_times else float("nan")
            eta = mean * max(0, self.total_steps - step)
            return [say(
                f"step {step}/{self.total_steps} | reward {_fmt(m.get('critic/score/mean'))} | value_loss "
                f"{_fmt(m.get('critic/vf_loss'))} | kl {_fmt(m.get('actor/kl_loss'))} | step "
                f"{format_duration(m.get('timing_s/step', float('nan')))} | elapsed "
                f"{format_duration(time.monotonic() - self._start)} | ETA {format_duration(eta)}"
            )]
        if (m := _LAYOUT.search(line)) and m.group(1) not in self._layouts:
            self._layouts.add(m.group(1))
            return [say(f"{'CP layout':<11} {m.group(2)} ({m.group(3)}), resolved by {m.group(1)}")]
        if not self._ready and (m := _ROLLOUT_READY.search(line)):
            self._ready = True
            return [say(f"{'rollout':<11} {m.group(1)}")]
        return []

    def summary(self, log_path: Path, returncode: int, wall_s: float) -> list[str]:
        metrics = parse_step_metrics(log_path.read_text(errors="replace"))
        return ppo_summary_lines(metrics, self.total_steps, self.work_dir / "checkpoints", wall_s=wall_s,
                                 log_path=log_path)


def ppo_summary_lines(metrics: dict[int, dict[str, float]], total_steps: int | None, ckpt_dir: Path | None = None,
                      *, wall_s: float | None = None, log_path: str | Path | None = None) -> list[str]:
    """The summary: a verdict on the RL path (not on learning: the model is random), the table, paths."""
    lines = [say("-" * 26 + " summary " + "-" * 26)]
    if not metrics:
        lines.append(say("result      NO PPO STEPS: no 'step:N - ...' metric line in the log"))
    else:
        last = max(metrics)
        bad = sorted({k for m in metrics.values() for k, v in m.items() if not math.isfinite(v)} & {
            k for k, _ in SUMMARY_COLUMNS})
        if total_steps and last < total_steps:
            verdict = f"INCOMPLETE: the run stopped at PPO step {last} of {total_steps}"
        elif bad:
            verdict = f"NOT FINITE: {', '.join(bad)}"
        else:
            verdict = (f"the RL path ran: {len(metrics)} PPO step{'s' * (len(metrics) != 1)} (rollout, reward, "
                       "values, GAE, updates, weight sync), all metrics finite; the model is random, so this "
                       "is not a test of learning")
        lines.append(say(f"result      {verdict}"))
        lines += [say("  " + row) for row in summary_table(metrics).splitlines()]
    if wall_s is not None:
        lines.append(say(f"wall time   {format_duration(wall_s)}"))
    if ckpt_dir is not None:
        tracker = Path(ckpt_dir) / "latest_checkpointed_iteration.txt"
        step = tracker.read_text().strip() if tracker.exists() else ""
        lines.append(say(f"checkpoint  {Path(ckpt_dir) / f'global_step_{step}' if step else 'none'}"))
    if log_path is not None:
        lines.append(say(f"full log    {log_path}"))
    return lines


def main(argv: list[str] | None = None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    cmd: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, cmd = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description="Run the CPU PPO launcher's trainer with a quiet console, or "
                                                 "summarise the console metrics of a finished run's log.")
    parser.add_argument("--summarize", metavar="LOG", help="full log of scripts/run_ds4_proxy_ppo_cpu.sh")
    parser.add_argument("--work-dir", default=".", help="run folder (logs/ and checkpoints/)")
    parser.add_argument("--log", help="log file (default: WORK_DIR/logs/<timestamp>.log)")
    parser.add_argument("--steps", type=int, default=0, help="total PPO steps (for the ETA and the summary)")
    parser.add_argument("--fact", action="append", default=[], metavar="KEY=VALUE", help="a start-up fact to print")
    parser.add_argument("--verbose", action="store_true", help="also show the full output on the console")
    args = parser.parse_args(argv)
    if args.summarize:
        metrics = parse_step_metrics(Path(args.summarize).read_text(errors="replace"))
        if not metrics:
            print(f"no 'step:N - ...' metric lines in {args.summarize}")
            return 1
        print(summary_table(metrics))
        return 0
    if not cmd:
        parser.error("expected --summarize LOG or a command after `--`")
    facts = [tuple(f.partition("=")[::2]) for f in args.fact]
    log_path = Path(args.log) if args.log else new_log_path(Path(args.work_dir) / "logs")
    if not args.log:
        link_latest(log_path)
    view = PPOConsole(args.work_dir, args.steps, facts=facts)
    return run_quiet(cmd, log_path, view, verbose=args.verbose)


if __name__ == "__main__":
    raise SystemExit(main())
