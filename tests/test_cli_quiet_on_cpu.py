"""The CLI shows its own output only: the libraries' warnings and logs go to a log file.

Each subcommand's ``--help`` and ``verl-ds4 doctor`` run as a user runs them (a fresh process):
the console holds no third-party warning line, the log file holds them (so they were moved, not
silenced), and ``--verbose`` brings them back to the console (the negative control: the check sees
such lines when they are there).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from verl_ds4.cli import SUBCOMMANDS

# What a third-party warning or log record looks like on a console.
THIRD_PARTY = re.compile(r"(Warning:|WARNING|warnings\.warn|site-packages/|^\[W\d+|FutureWarning|DeprecationWarning)", re.M)


def cli(*args: str, log_dir) -> subprocess.CompletedProcess:
    env = dict(os.environ, VERL_DS4_LOG_DIR=str(log_dir))
    return subprocess.run([sys.executable, "-m", "verl_ds4.cli", *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("args", [["--help"]] + [[name, "--help"] for name in SUBCOMMANDS])
def test_help_is_quiet_and_describes_the_current_behaviour(args, tmp_path):
    out = cli(*args, log_dir=tmp_path)
    assert out.returncode == 0, out.stderr
    assert not THIRD_PARTY.search(out.stdout + out.stderr), out.stdout + out.stderr
    if args == ["--help"]:
        assert "proxy" not in out.stdout and "full tiny DS4" in out.stdout and "--verbose" in out.stdout
    if args[0] == "plan":
        assert "--fit" in out.stdout and "--gpu" in out.stdout


def test_doctor_console_is_its_report_and_the_log_has_the_warnings(tmp_path):
    out = cli("doctor", log_dir=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("verl-ds4 doctor") and "verl engine registry" in out.stdout
    assert not THIRD_PARTY.search(out.stdout + out.stderr), out.stdout + out.stderr
    log = (tmp_path / "cli-doctor.log").read_text()
    assert THIRD_PARTY.search(log) and "verl" in log
    assert f"in {tmp_path / 'cli-doctor.log'}; --verbose prints them" in out.stderr


def test_verbose_prints_them_on_the_console(tmp_path):
    out = cli("--verbose", "doctor", log_dir=tmp_path)
    assert out.returncode == 0 and THIRD_PARTY.search(out.stderr)
    assert not (tmp_path / "cli-doctor.log").exists()
    out = cli("doctor", "--verbose", log_dir=tmp_path)  # after the subcommand too
    assert out.returncode == 0 and THIRD_PARTY.search(out.stderr)
