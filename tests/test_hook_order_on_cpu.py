"""Order independence of the tests that install, uninstall or re-register verl-ds4's patches on verl.

What it proves: every test that touches the global hooks of :mod:`verl_ds4.engine.megatron` or the
registrations of :mod:`verl_ds4.engine.plugin` leaves them as it found them (the
``restore_verl_hooks`` fixture of ``tests/conftest.py``), so these tests pass shuffled across
files (pytest-random-order, ``--random-order-bucket=global``, a fixed seed: reproducible). The
uninstall tests are among them, so a test that relied on hooks another test installed would fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOOK_TESTS = (
    "tests/test_engine_plugin_on_cpu.py",
    "tests/test_layout_resolver_on_cpu.py",
)
#: The tests of those files that touch hooks or registrations (the subprocess tests of the plugin
#: file start fresh interpreters and cannot leak; leaving them out keeps this near a minute, most
#: of it importing verl and Megatron).
SELECTION = "hooks or register or uninstall or dynamic_cp_block or scheduler_survives or engine_layout"
SEED = 20240


@pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import random_order"], capture_output=True).returncode != 0,
    reason="pytest-random-order is not installed (pip install -e .[test])",
)
@pytest.mark.extended  # CI: every hook-touching test restores the hooks (conftest restore_verl_hooks)
def test_hook_touching_tests_pass_in_shuffled_order():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run(
        [
            sys.executable, "-m", "pytest", *HOOK_TESTS, "-k", SELECTION, "-v", "-W", "ignore",
            "-p", "no:cacheprovider",
            "--random-order-bucket=global", f"--random-order-seed={SEED}",
        ],  # fmt: skip
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert f"Using --random-order-seed={SEED}" in out, out[-2000:]
    ran = [line.split(" PASSED")[0] for line in out.splitlines() if " PASSED" in line]
    assert len(ran) >= 8, out[-2000:]
    files = [test.split("::")[0] for test in ran]
    # It did shuffle across files: the files interleave (not one file's tests, then the other's).
    assert sum(a != b for a, b in zip(files, files[1:])) > len(HOOK_TESTS) - 1, ran
