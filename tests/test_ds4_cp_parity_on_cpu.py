"""CP parity of the full tiny DS4 (real Megatron-Core GPTModel: mHC, DS4 attention, DS4 MoE with a
hash layer) on real gloo processes; the attention-only proxy stays checkable with ``model="ds4_proxy"``.

Each CP size runs the actor (LM head, one MTP depth, indexer loss on) and critic (value head)
through verl-ds4's THD path with the contiguous layout and must reproduce CP=1: the loss, the MTP
loss, the indexer loss, log-probs, entropy, the gradients of every parameter group (hc, router,
experts, shared_experts, mtp, attention, embeddings, ...), values and value-loss gradients (fp64:
<= 1e-10 relative). Negative controls show the comparison can fail: zigzag rows (guard bypassed),
hash ids packed one row off, an MTP roll across sequence ends, a broken halo exchange, and an
all-gather without backward.
"""

from __future__ import annotations

import pytest
import torch

from verl_ds4.models.ds4 import cp_comm
from verl_ds4.verify.parity import SHORT, RunOptions, compare, format_table, rows_passed, run_parity


@pytest.fixture(scope="module")
def reference():
    return run_parity(1, dtypes=("fp64", "fp32"), layout_checks=False)


def _assert_parity(cp, reference):
    result = run_parity(cp, dtypes=("fp64", "fp32"))
    rows = compare(result, reference)
    assert rows_passed(rows), format_table(rows, f"CP={cp}")
    names = [r.quantity for r in rows]
    # Every quantity of the issue is in the table, for both batches and both precisions.
    for dtype in ("fp64", "fp32"):
        for batch in ("ragged", "short"):
            for q in ("log_probs", "entropy", "loss", "mtp_loss", "indexer_loss", "values", "value_loss"):
                assert f"{dtype} {batch} {q}" in names
            for group in ("embeddings", "attention", "hc", "router", "experts", "shared_experts", "mtp"):
                assert any(n.startswith(f"{dtype} {batch} grads {group} (") for n in names), (group, names)
            assert any(n.startswith(f"{dtype} {batch} value_grads, all (") for n in names)
            aux = result.results[(dtype, batch)]
            assert aux["mtp_loss"][0] > 0 and aux["indexer_loss"][0] > 0  # both really computed
    fp64 = [r for r in rows if r.quantity.startswith("fp64") and r.expect == "match"]
    assert max(r.max_rel for r in fp64) <= 1e-10
    assert "contiguous" in result.checks["zigzag_error"]
    for control in ("hash ids packed one row off", "MTP roll across sequence ends"):
        row = next(r for r in rows if r.quantity.startswith(control))
        assert row.expect == "differ" and row.passed, row
    return rows


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_parity(cp, reference):
    _assert_parity(cp, reference)


@pytest.mark.slow
def test_cp8_parity(reference):
    _assert_parity(8, reference)


def test_the_linear_sparse_core_at_cp4_reproduces_the_dense_cp1(reference, monkeypatch):
    """verify --sparse-core linear: the whole tiny DS4 (actor with indexer loss, critic) at CP 4 with the
    memory-linear core against the dense CP=1 reference (fp64 <= 1e-10: loss, log-probs, every gradient).
    Control: the core with its softmax scale off by 1e-3 fails the same comparison."""
    linear = RunOptions(sparse_core="linear")
    rows = compare(run_parity(4, dtypes=("fp64",), layout_checks=False, options=linear), reference)
    assert rows_passed(rows), format_table(rows, "CP=4 linear core")
    assert any(r.quantity.startswith("fp64 ragged grads attention") for r in rows)

    from verl_ds4.kernels import linear_sparse_attn

    def off_scale(q, kv, sink, ids, scale, **kw):
        return linear_sparse_attn(q, kv, sink, ids, scale * 1.001, **kw)

    monkeypatch.setattr("verl_ds4.models.ds4.csa_rows.linear_sparse_attn", off_scale)  # forked ranks inherit it
    bad = compare(run_parity(2, dtypes=("fp64",), batches={"short": SHORT}, layout_checks=False, options=linear), reference)
    assert "fp64 short log_probs" in {r.quantity for r in bad if not r.passed}


def test_short_batch_is_padded_to_the_row_minimum(reference):
    """70 real tokens at CP 4: only the 128-rows-per-rank padding makes DS4 attention runnable."""
    assert sum(SHORT) < 4 * 128
    result = run_parity(4, dtypes=("fp64",), batches={"short": SHORT}, layout_checks=False)
    assert rows_passed(compare(result, reference))


def test_broken_halo_exchange_is_detected(reference, monkeypatch):
    """If the left neighbour's rows never arrive, windows and blocks at rank boundaries change."""

    def no_halo(x, rows, group):
        return x.new_zeros((rows,) + tuple(x.shape[1:]))

    monkeypatch.setattr("verl_ds4.models.ds4.attention.exchange_left_halo", no_halo)  # forked ranks inherit it
    rows = compare(run_parity(2, dtypes=("fp64",), layout_checks=False), reference)
    failing = {r.quantity for r in rows if not r.passed}
    assert "fp64 ragged log_probs" in failing and "fp64 ragged values" in failing


def test_all_gather_without_backward_is_detected(reference, monkeypatch):
    """Forward stays exact, but gradients of compressed KV blocks owned by other ranks are lost."""

    def local_only_backward(ctx, grad):
        start = sum(ctx.counts[: ctx.rank])
        return grad[start : start + ctx.counts[ctx.rank]], None, None

    monkeypatch.setattr(cp_comm._AllGatherRows, "backward", staticmethod(local_only_backward))
    rows = {r.quantity.split(" (")[0]: r for r in compare(run_parity(2, dtypes=("fp64",), layout_checks=False), reference)}
    assert rows["fp64 ragged log_probs"].passed and rows["fp64 ragged values"].passed
    assert not rows["fp64 ragged grads attention"].passed
    assert not rows["fp64 ragged value_grads, all"].passed


def test_hash_ids_packed_with_a_wrong_plan_fail_the_check(reference):
    """The test hook shifts the ids every hash layer reads by one row: the CP=2 table must fail, on
    the log-probs and on the router gradients, while the attention-only quantities stay as they are."""
    shifted = {r.quantity.split(" (")[0]: r for r in compare(run_parity(2, dtypes=("fp64",), layout_checks=False, hash_ids_shift=1), reference)}
    assert not shifted["fp64 ragged log_probs"].passed and not shifted["fp64 ragged loss"].passed
    assert not shifted["fp64 ragged grads router"].passed
    assert not rows_passed(list(shifted.values()))


def test_the_proxy_option_still_reproduces_cp1():
    ref = run_parity(1, dtypes=("fp64",), batches={"short": SHORT}, layout_checks=False, model="ds4_proxy")
    rows = compare(run_parity(2, dtypes=("fp64",), batches={"short": SHORT}, model="ds4_proxy"), ref)
    assert rows_passed(rows), format_table(rows)
    names = " ".join(r.quantity for r in rows)
    assert "grads mlp" in names and "grads router" not in names and "hash ids" not in names


def test_verify_cli_exit_codes(capsys):
    from verl_ds4.cli import main

    assert main(["verify", "--cp", "2", "--dtype", "fp64", "--no-layout-checks"]) == 0
    out = capsys.readouterr().out
    assert "max abs diff" in out and "fp64 ragged grads" in out and "PASSED" in out
    # An impossible tolerance must fail the run (non-zero exit), so the command can fail at all.
    assert main(["verify", "--cp", "2", "--dtype", "fp64", "--no-layout-checks", "--fp64-rtol", "1e-300"]) == 1
    assert "FAILED" in capsys.readouterr().out
