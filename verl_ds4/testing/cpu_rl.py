"""Run the CPU PPO/GRPO launcher (``scripts/run_ds4_proxy_ppo_cpu.sh``) under the memory/time guard, for tests.

:func:`run_cpu_rl_launcher` runs it with ``WORK_DIR`` in a temporary folder under
:func:`verl_ds4.rollout.cpu_ppo_run.run_guarded` (wall-clock limit: verl's TransferQueue waits forever
instead of failing when Ray lacks logical CPUs; RSS limit over the whole process tree), then reads the
full log the console names and verl's per-step metrics from it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from verl_ds4.rollout.cpu_ppo_run import parse_step_metrics, run_guarded

REPO = Path(__file__).resolve().parents[2]

__all__ = ["REPO", "run_cpu_rl_launcher"]


def run_cpu_rl_launcher(work: Path, env_extra: dict[str, str], *, timeout_s: float, rss_limit_gb: float, args=()):
    """The guarded run's :class:`~verl_ds4.rollout.cpu_ppo_run.RunResult`, with ``console`` (what the
    launcher printed), ``log`` (the full log) and ``metrics`` (verl's step metrics) filled in."""
    env = dict(os.environ, PYTHON=sys.executable, WORK_DIR=str(work), **env_extra)
    env.pop("RAY_ADDRESS", None)
    result = run_guarded(
        ["bash", str(REPO / "scripts" / "run_ds4_proxy_ppo_cpu.sh"), *args],
        work / "outer.log",
        timeout_s=timeout_s,
        rss_limit_gb=rss_limit_gb,
        env=env,
        cwd=REPO,
    )
    console = result.log
    lines = [line for line in console.splitlines() if line.startswith("[verl-ds4] full log")]
    if len(lines) != 1:
        raise AssertionError(f"expected one '[verl-ds4] full log' line in the launcher's output:\n{console}")
    full_log = Path(lines[0].split()[-1])
    if full_log.parent != work / "logs" or not full_log.is_file():
        raise AssertionError(f"the full log {full_log} is not a file in {work / 'logs'}")
    result.log = full_log.read_text(errors="replace")
    result.metrics = parse_step_metrics(result.log)
    result.console = console
    return result
