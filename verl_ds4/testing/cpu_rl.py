"""Run the CPU PPO/GRPO launcher (``scripts/run_ds4_proxy_ppo_cpu.sh``) under the memory/time guard, for tests.

:func:`run_cpu_rl_launcher` runs it with ``WORK_DIR`` in a temporary folder under
:func:`verl_ds4.rollout.cpu_ppo_run.run_guarded` (wall-clock limit: verl's TransferQueue waits forever
instead of failing when Ray lacks logical CPUs; RSS limit over the whole process tree), then reads the
full log the console names and verl's per-step metrics from it. :func:`launcher_env` is its
environment (for tests that start the launcher themselves, e.g. to kill it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from verl_ds4.rollout.cpu_ppo_run import CPUPPORunError, parse_step_metrics, run_guarded

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = ["bash", str(REPO / "scripts" / "run_ds4_proxy_ppo_cpu.sh")]
# Ray gives its raylet a fixed 30 s to register (ray/_private/node.py); on a loaded machine ray.init fails so
# before verl runs anything, and the same command once more is the same run. Only that failure is retried.
RAY_NODE_TIMEOUT = "The current node timed out during startup"

__all__ = ["LAUNCHER", "REPO", "launcher_env", "run_cpu_rl_launcher"]


def launcher_env(work: Path, env_extra: dict[str, str]) -> dict[str, str]:
    """The launcher's environment: this interpreter, ``WORK_DIR=work``, no Ray address or test switch
    inherited, ``env_extra`` on top, and this checkout first on ``PYTHONPATH`` (Ray workers inherit it)."""
    env = dict(os.environ, PYTHON=sys.executable, WORK_DIR=str(work))
    env.pop("RAY_ADDRESS", None)
    env.pop("VERL_DS4_TEST_SKIP_WEIGHT_SYNC_AT_STEP", None)
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def run_cpu_rl_launcher(work: Path, env_extra: dict[str, str], *, timeout_s: float, rss_limit_gb: float, args=(),
                        name: str = "outer", check: bool = True):
    """The guarded run's :class:`~verl_ds4.rollout.cpu_ppo_run.RunResult`, with ``console`` (what the
    launcher printed, also in ``work/<name>.log``), ``log`` (the full log) and ``metrics`` (verl's step
    metrics) filled in. ``check=False``: a run that exits non-zero on its own (e.g. stopped by the
    mismatch gate) is returned with its status instead of raising."""
    for attempt in (1, 2):
        try:
            result = run_guarded([*LAUNCHER, *args], work / f"{name}.log", timeout_s=timeout_s,
                                 rss_limit_gb=rss_limit_gb, env=launcher_env(work, env_extra), cwd=REPO, check=check)
            break
        except CPUPPORunError as err:
            if attempt == 2 or RAY_NODE_TIMEOUT not in str(err):
                raise
            print(f"\n{name}: Ray's node start-up timed out (machine overloaded); launching once more")
    console = result.log
    # "[verl-ds4] full log    PATH" after a run, "[verl-ds4] FAILED (exit N); full log: PATH" after a failure
    lines = [line for line in console.splitlines()
             if line.startswith("[verl-ds4] full log") or line.startswith("[verl-ds4] FAILED (exit")]
    if len(lines) != 1:
        raise AssertionError(f"expected one line naming the full log in the launcher's output:\n{console}")
    full_log = Path(lines[0].split()[-1])
    if full_log.parent != work / "logs" or not full_log.is_file():
        raise AssertionError(f"the full log {full_log} is not a file in {work / 'logs'}")
    result.log = full_log.read_text(errors="replace")
    result.metrics = parse_step_metrics(result.log)
    result.console = console
    return result
