"""Installing verl-ds4 does not change a non-DS4 model's results: verl 0.9.1's stock Megatron engine
data path and ours, on the same tiny dense model (zigzag attention) and batches, CP=1 and CP=2.

Each run is verl's ``TrainingWorker`` under ``torchrun`` (2 CPU processes, real gloo groups;
:mod:`verl_ds4.testing.engine_differential`): per step the log-probs of a forward pass, then the
loss of a training step. Allowed difference: the label of each sequence's last token, which the
loss mask drops (ours wraps it to the sequence's first token; verl's zigzag CP>1 path reads a
padding row there, ``verl_ds4/mcore/thd.py`` difference 1).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from verl_ds4.mcore.distributed import free_port
from verl_ds4.cpu.sft_data import prepare_cpu_sft_assets
from verl_ds4.cpu.sft_run import cpu_env

FP32 = 2e-6  # CP=1 vs CP=2 sums the same terms in another order


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_differential")
    prepare_cpu_sft_assets(root / "assets", model="tiny_dense", n_train=32)
    out = {}
    for engine in ("stock", "ours"):
        for cp in (1, 2):
            path = root / f"{engine}{cp}.json"
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                "-m", "verl_ds4.testing.engine_differential", "--assets", str(root / "assets"),
                "--engine", engine, "--cp", str(cp), "--out", str(path), "--steps", "2",
            ]  # fmt: skip
            done = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            out[engine, cp] = json.loads(path.read_text())
    return out


def compare(reference: dict, other: dict) -> tuple[float, float, float]:
    """``(max |loss diff|, max |log-prob diff| off the last-token rows, on them)`` over the steps.

    Log-probs of the logging rank's data-parallel shard are compared (the shorter run's rows).
    """
    loss = rows = last = 0.0
    for ref, got in zip(reference["steps"], other["steps"], strict=True):
        base = np.array(ref["log_probs"])
        values = np.array(got["log_probs"])
        n = min(len(base), len(values))
        lengths = ref["lengths"] if len(base) == n else got["lengths"]
        ends = np.cumsum(lengths) - 1
        off = np.ones(n, bool)
        off[ends[ends < n]] = False
        diff = np.abs(base[:n] - values[:n])
        loss = max(loss, abs(ref["loss"] - got["loss"]))
        rows, last = max(rows, diff[off].max()), max(last, diff[~off].max(initial=0.0))
    return loss, rows, last


def test_runs_use_the_intended_engines(runs):
    assert runs["stock", 1]["engine"] == "StockCPUMegatronEngineWithLMHead"
    assert runs["ours", 2]["engine"] == "CPUMegatronEngineWithLMHead"


@pytest.mark.parametrize("cp", [1, 2])
def test_ours_equals_verls_stock_engine(runs, cp):
    loss, rows, _ = compare(runs["stock", cp], runs["ours", cp])
    assert loss == 0.0 and rows == 0.0, (loss, rows)


def test_cp2_equals_cp1_on_our_engine_including_the_last_token(runs):
    loss, rows, last = compare(runs["ours", 1], runs["ours", 2])
    assert loss <= FP32 and rows <= FP32 and last <= FP32, (loss, rows, last)


def test_the_comparison_sees_the_documented_label_row(runs):
    """Negative control: verl's own zigzag CP=2 label of the last token differs from its CP=1 one,
    and the comparison reports it (only there)."""
    loss, rows, last = compare(runs["stock", 1], runs["stock", 2])
    assert rows <= FP32 and loss <= FP32
    assert last > 1e-3, last


def _zigzag_dense_rank_costs(lengths: list[int], cp: int) -> list[float]:
    """Dense causal attention keys per CP rank, counted position by position: every sequence padded to a
    multiple of 2*cp and cut into 2*cp chunks, rank r holding chunks r and 2*cp-1-r (padding costs 0)."""
    ranks = [0.0] * cp
    for n in lengths:
        chunk = -(-n // (2 * cp))
        for p in range(n):
            k = p // chunk
            ranks[k if k < cp else 2 * cp - 1 - k] += p + 1
    return ranks


def test_every_step_reports_the_straggler_ratios_of_its_layout(runs):
    """verl-ds4's engine reports the CP straggler ratio of the layout it ran, equal to a count from the lengths
    alone (2 micro-batches of 4 in batch order, verl's fixed-size micro-batches), and the DP ratio from verl's
    global_token_num: in every forward pass and in the training steps marked as verl's RL updates mark them
    (odd steps). Controls: SFT-style training steps (even) carry none; verl's stock engine reports none."""
    steps = runs["ours", 2]["steps"]
    assert len(steps) == 2
    for i, step in enumerate(steps):
        per_mb = [_zigzag_dense_rank_costs(step["lengths"][j : j + 4], 2) for j in (0, 4)]
        expected = sum(max(c) for c in per_mb) / sum(sum(c) / 2 for c in per_mb)
        assert expected > 1.0  # the padding of these short sequences is visible: the check can fail
        for phase in ("train", "infer") if i % 2 else ("infer",):
            got = step["straggler"][phase]
            assert got["perf/cp_straggler_ratio"] == [pytest.approx(expected, rel=1e-12)], phase
            assert got["perf/cp_straggler_ratio_max"] == [pytest.approx(max(max(c) / (sum(c) / 2) for c in per_mb))]
            assert got["perf/cp_straggler_ratio_batch_order"] == got["perf/cp_straggler_ratio"]  # balance off
            assert got["perf/dp_straggler_ratio"] == [1.0]  # CP 2 of 2 ranks: one DP rank
    assert steps[0]["straggler"]["train"] == {}  # an SFT step: verl's SFT trainer would log a list
    for step in runs["ours", 1]["steps"]:  # CP 1, 2 DP ranks of 4 sequences each
        got = step["straggler"]["infer"]
        assert got["perf/cp_straggler_ratio"] == [1.0, 1.0]
        halves = (step["global_lengths"][:4], step["global_lengths"][4:])
        keys = [sum(n * (n + 1) / 2 for n in half) for half in halves]
        assert got["perf/dp_straggler_ratio"] == [pytest.approx(max(keys) / (sum(keys) / 2), rel=1e-12)] * 2
    for cp in (1, 2):
        assert all(s["straggler"] == {"train": {}, "infer": {}} for s in runs["stock", cp]["steps"])
