"""``scripts/dev.sh test`` runs lane 2 and the image-pins check beside lane 1 at the lowest priority (``run_low``).

With the kernel's autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``), CPU time is shared between
sessions first and nice counts only inside a session. Lane 1's launchers (torchrun, Ray jobs) run in sessions of their
own, so a plain ``nice -n 19`` in dev.sh's session did not hold lane 2 back: measured with busy loops, each nice-19 loop
still got a third of a core beside lane-1-like loops in their own sessions. ``run_low`` starts its command in a session of
its own and sets that session's group to nice 19 as well.

Checked here on ``run_low`` as dev.sh defines it (sourced from the script): the command runs in a new session, at nice
19, and its session's group is at nice 19. Control: the same command under plain ``nice -n 19`` stays in the caller's
group, whose nice is 0 (what lane 2 had before).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEV_SH = REPO / "scripts" / "dev.sh"

pytestmark = pytest.mark.skipif(not Path("/proc/self/autogroup").exists(),
                                reason="no autogroup scheduling here (/proc/self/autogroup): plain nice 19 holds")

# What the started command reports: its session id, its nice value, its session's scheduling group.
PROBE = "import os; print(os.getsid(0), os.nice(0), open('/proc/self/autogroup').read().strip())"


def _started(how: str) -> tuple[str, int, str]:
    """``how`` ("run_low" or "nice") starts the probe in the background from a bash (in a session of its own) that
    sourced dev.sh's run_low; returns that bash's scheduling group, the probe's nice value and its group."""
    function = re.search(r"^run_low\(\) \{\n.*?^\}\n", DEV_SH.read_text(), re.S | re.M)
    assert function, "scripts/dev.sh defines no run_low()"
    start = "run_low" if how == "run_low" else "nice -n 19"
    script = f'{function.group(0)}\ncat /proc/$$/autogroup\n{start} "$PYTHON" -c "$PROBE" &\nwait $!\n'
    out = subprocess.run(["bash", "-c", script], env=dict(os.environ, PYTHON=sys.executable, PROBE=PROBE),
                         capture_output=True, text=True, timeout=60, start_new_session=True)
    assert out.returncode == 0, out.stdout + out.stderr
    caller, probe = out.stdout.strip().splitlines()
    sid, nice, group = probe.split(maxsplit=2)
    assert int(sid) != os.getsid(0)
    return caller.split()[0], int(nice), group


def test_run_low_starts_its_command_in_a_session_of_its_own_with_that_group_at_nice_19():
    caller, nice, group = _started("run_low")
    assert nice == 19 and group.endswith(" nice 19"), (nice, group)
    assert group.split()[0] != caller, (group, caller)  # a group of its own, not the caller's


def test_control_plain_nice_leaves_the_command_in_the_callers_group_at_nice_0():
    caller, nice, group = _started("nice")
    assert nice == 19
    assert group == f"{caller} nice 0", (group, caller)  # the caller's group: nice 19 alone does not lower it
