"""Run the CPU PPO launcher under guard rails, and read its console metrics.

verl's PPO trainer can wait forever instead of failing on a CPU machine (TransferQueue's
``tq.init`` and Ray actor creation block when Ray has too few logical CPUs). :func:`run_guarded`
runs a command in its own process group with a wall-clock limit and a memory limit (peak RSS
summed over the whole process tree: driver, Ray's daemons and every worker), and on breach kills
the group and raises :class:`CPUPPORunError` with a message that says what happened, what the
usual cause is and the end of the log.

:func:`parse_step_metrics` reads verl's console logger lines (``step:N - key:value - ...``);
:func:`summary_table` prints the few that matter for the demo (reward, value loss, KL, step time).

:class:`PPOConsole` (in :mod:`verl_ds4.cpu.console`, re-exported) is the launcher's quiet console: the
full output of verl, Ray and the workers goes to ``WORK_DIR/logs/<timestamp>.log``; the console shows
the start-up facts, one line per PPO step (reward, value loss, KL, step time, ETA) and the summary.

    python -m verl_ds4.rollout.cpu_ppo_run --summarize runs/ds4_proxy_ppo_cpu/logs/latest.log
    python -m verl_ds4.cpu.console ppo --work-dir W --steps 3 [--verbose] [--fact k=v ...] -- CMD...
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from verl_ds4.cpu.console import (  # noqa: F401  (re-exported: this module's metrics readers live there)
    SUMMARY_COLUMNS,
    PPOConsole,
    parse_step_metrics,
    ppo_summary_lines,
    summary_table,
)
from verl_ds4.cpu.console_ppo import reward_trend_line

__all__ = ["CPUPPORunError", "PPOConsole", "RunResult", "parse_step_metrics", "run_guarded", "summary_table"]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")

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
    check: bool = True,
) -> RunResult:
    """Run ``cmd`` (stdout+stderr to ``log_path``) with a wall-clock and a process-tree RSS limit.

    Returns the result on exit status 0; raises :class:`CPUPPORunError` on a non-zero exit (unless
    ``check=False``: then the result carries the status), a timeout (likely a hang, see
    :data:`HANG_HINT`) or an RSS above ``rss_limit_gb``. Ray processes started by the command are in
    its process group and are killed with it.
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
    if proc.returncode != 0 and check:
        raise CPUPPORunError(
            f"{' '.join(cmd[:3])}... exited with status {proc.returncode} after {wall:.0f} s.\n"
            f"--- end of {log_path} ---\n{_tail(log_path)}"
        )
    return RunResult(proc.returncode, wall, peak / 2**30, text, parse_step_metrics(text))


def main(argv: list[str] | None = None) -> int:
    """``--summarize LOG``: the metrics table of a finished run. Running a command with the quiet
    console is ``python -m verl_ds4.cpu.console ppo ...`` (what the launcher does)."""
    parser = argparse.ArgumentParser(description="Summarise the console metrics of a finished CPU PPO run's log "
                                                 "(run one with: python -m verl_ds4.cpu.console ppo ... -- CMD).")
    parser.add_argument("--summarize", metavar="LOG", required=True, help="full log of scripts/run_ds4_proxy_ppo_cpu.sh")
    args = parser.parse_args(argv)
    metrics = parse_step_metrics(Path(args.summarize).read_text(errors="replace"))
    if not metrics:
        print(f"no 'step:N - ...' metric lines in {args.summarize}")
        return 1
    print(summary_table(metrics))
    print(reward_trend_line(metrics))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
