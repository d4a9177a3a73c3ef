"""The extended proofs (verl_ds4.testing.extended): slow end-to-end tests that the README's test command skips and
``bash benchmarks/extended_proofs.sh`` runs. The skip says how to run them; ``VERL_DS4_EXTENDED=1`` is the control
(the same test is then planned, not skipped); a value other than 0 / 1 is refused; comparisons with Megatron-LM dev run
at the pin in CI and at every proven commit when extended, the older ones marked so that ``-m extended`` picks them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_ds4.substitutes import megatron_dev
from verl_ds4.testing import extended

REPO = Path(__file__).resolve().parents[1]


def _plan(value: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, VERL_DS4_EXTENDED=value)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)


def test_an_extended_test_is_skipped_naming_its_command_and_runs_when_asked():
    target = "tests/test_hook_order_on_cpu.py"  # one extended test, no fixture of its own
    skipped = _plan("0", target, "--setup-plan")
    assert "1 skipped" in skipped.stdout and extended.REASON in skipped.stdout, skipped.stdout
    assert "bash benchmarks/extended_proofs.sh" in extended.REASON
    planned = _plan("1", target, "--setup-plan")  # the control: the same test, planned to run
    assert "skipped" not in planned.stdout and "test_hook_touching_tests_pass_in_shuffled_order" in planned.stdout, \
        planned.stdout
    bad = _plan("yes", target, "--setup-plan")
    assert bad.returncode != 0 and "VERL_DS4_EXTENDED=yes: expected 1" in bad.stdout + bad.stderr


def test_commits_are_the_pin_unless_extended_and_the_older_ones_are_marked(monkeypatch):
    monkeypatch.delenv(extended.ENV, raising=False)
    assert extended.proven_commits() == (megatron_dev.DEFAULT_COMMIT,)
    monkeypatch.setenv(extended.ENV, "1")
    commits = extended.proven_commits()
    assert commits == megatron_dev.PROVEN_COMMITS and len(commits) > 1
    params = extended.commit_params(commits)
    assert params[commits.index(megatron_dev.DEFAULT_COMMIT)] == megatron_dev.DEFAULT_COMMIT  # the pin: unmarked
    older = [p for p in params if p != megatron_dev.DEFAULT_COMMIT]
    assert older and all([m.name for m in p.marks] == ["extended"] for p in older)
    monkeypatch.setenv(extended.ENV, "on")
    with pytest.raises(ValueError, match="expected 1"):
        extended.enabled()
