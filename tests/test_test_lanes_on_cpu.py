"""The two test lanes of ``scripts/dev.sh test`` (tests/conftest.py): which files each one collects.

``LANE2_ONLY_FILES`` run once, in lane 2, when both lanes run: lane 1 (``VERL_DS4_TEST_LANE=1``) does not collect
them, lane 2 (``VERL_DS4_TEST_LANE=2``) does, and a plain ``pytest`` (no lane) does. Collection only (no test runs).
Control: a lane-1 file that is not lane-2-only is collected by lane 1 and not by lane 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _conftest():
    import importlib.util

    spec = importlib.util.spec_from_file_location("verl_ds4_tests_conftest", REPO / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


conftest = _conftest()
ONLY = "test_cpu_grpo_on_cpu.py"
LANE1 = "test_cpu_console_on_cpu.py"  # in neither list: lane 1 only


def _collected(name: str, lane: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "VERL_DS4_TEST_LANE"}
    if lane is not None:
        env["VERL_DS4_TEST_LANE"] = lane
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          f"tests/{name}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return sum(1 for line in out.stdout.splitlines() if "::" in line)


def test_the_lists_name_existing_files_and_do_not_overlap():
    for name in conftest.LANE2_FILES | conftest.LANE2_ONLY_FILES:
        assert (REPO / "tests" / name).is_file(), name
    assert not conftest.LANE2_FILES & conftest.LANE2_ONLY_FILES
    assert ONLY in conftest.LANE2_ONLY_FILES and LANE1 not in conftest.LANE2_FILES | conftest.LANE2_ONLY_FILES


def test_lane_2_only_files_run_in_lane_2_not_in_lane_1():
    assert _collected(ONLY, "1") == 0
    assert _collected(ONLY, "2") > 0  # (a plain run, no lane, collects it as lane 2 does: no filter applies)
    assert _collected(LANE1, "1") > 0 and _collected(LANE1, "2") == 0  # the control
