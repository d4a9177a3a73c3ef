"""``verl-ds4 verify --seq-len N``: the tiny DS4 at CP 4 vs CP 1 on a long sequence between short ones (fp64).

CI's shorter long-context case (N = 1536, CP 4: the long sequence covers all four ranks, every rank but the
first exchanges its halo inside it, its ratio-4 / ratio-128 blocks and the indexer's top-k cross the rank
boundaries, the linear core runs 384-row chunks and the attention's compressed-block work 160-row chunks, so chunk
boundaries fall inside it on every rank),
with the indexer replay off and on; V4.1's (``--model ds41 --cp 4 --seq-len 1024 --indexer-replay both``, CSA2 in
160-row chunks, NeMo Automodel's rows beside, about 20 s); the 8k-32k figures are in docs/verify-cp.md. Controls: replaying other
valid blocks must change the log-probs; bad lengths are refused before any rank starts.
"""

import pytest
import torch

from verl_ds4.verify.parity import RunOptions, compare, format_table, rows_passed, run_parity
from verl_ds4.verify.seqlen import LINEAR_CHUNK_ROWS, QUERY_CHUNK_ROWS, check_seq_len, first_blocks, long_lengths, replay_batches

N, CP = 1536, 4
BATCHES = replay_batches({"long": long_lengths(N)}, "both")


@pytest.fixture(scope="module")
def reference():
    return run_parity(1, batches=BATCHES, layout_checks=False)


def test_the_batch_spreads_the_long_sequence_over_every_rank():
    from verl_ds4.layout import PlanOptions
    from verl_ds4.mcore.thd import make_plan

    lengths = long_lengths(N)
    assert max(lengths) == N and len(lengths) == 6 and lengths.index(N) == 2
    ids = torch.nested.nested_tensor_from_jagged(torch.zeros(sum(lengths), dtype=torch.long),
                                                 offsets=torch.tensor([0, *lengths]).cumsum(0))  # fmt: skip
    plan = make_plan(ids, PlanOptions(layout="contiguous", cp_size=CP, min_local_rows=128))
    cu = plan.cu_seqlens_padded.tolist()
    first, last = cu[2] // plan.local_rows, (cu[3] - 1) // plan.local_rows
    assert (first, last) == (0, CP - 1)  # starts inside rank 0, ends inside the last rank
    assert cu[2] % plan.local_rows and cu[3] % plan.local_rows  # neither end on a rank boundary
    assert LINEAR_CHUNK_ROWS < plan.local_rows  # the linear core's chunk boundaries fall inside the long sequence
    assert QUERY_CHUNK_ROWS < plan.local_rows and plan.local_rows % QUERY_CHUNK_ROWS  # so do the attention's row chunks


def test_seq_len_parity_dense_with_and_without_replay(reference):
    # CP 4 in 160-row chunks of the compressed blocks' work (scores, top-k, replay, dense core, indexer loss), against
    # the CP 1 reference in its budget's chunks (one here): chunking and CP together change no number.
    result = run_parity(CP, batches=BATCHES, options=RunOptions(query_chunk_rows=QUERY_CHUNK_ROWS))
    rows = compare(result, reference)
    assert rows_passed(rows), format_table(rows, f"--seq-len {N} CP={CP}")
    names = {r.quantity for r in rows}
    for batch in ("long", "long+replay"):
        for q in ("loss", "mtp_loss", "indexer_loss", "log_probs", "entropy", "values", "value_loss"):
            assert f"fp64 {batch} {q}" in names
        assert any(n.startswith(f"fp64 {batch} grads attention (") for n in names)
    assert max(r.max_rel for r in rows if r.expect == "match") <= 1e-10
    control = next(r for r in rows if r.quantity.startswith("indexer replay of other valid blocks"))
    assert control.expect == "differ" and control.passed, control
    for name in ("zigzag with guard bypassed", "hash ids packed one row off", "MTP roll across sequence ends"):
        assert next(r for r in rows if r.quantity.startswith(name)).passed


def test_seq_len_parity_linear_core_in_chunks(reference):
    options = RunOptions(sparse_core="linear", linear_chunk_rows=LINEAR_CHUNK_ROWS)
    rows = compare(run_parity(CP, batches={"long": long_lengths(N)}, layout_checks=False, options=options), reference)
    assert rows_passed(rows), format_table(rows, f"--seq-len {N} CP={CP} linear")
    assert any(r.quantity.startswith("fp64 long grads attention") for r in rows)


def test_first_blocks_is_another_valid_choice():
    ids = torch.tensor([[[0, 2, 5]], [[0, 1, -1]], [[3, 4, 6]]], dtype=torch.int32)
    out = first_blocks(ids)
    assert out.tolist() == [[[0, 1, 2]], [[0, 1, -1]], [[0, 1, 2]]]  # a row reaching fewer than k keeps its ids


def test_bad_lengths_are_refused(capsys):
    with pytest.raises(ValueError, match=r"expected N >= 2"):
        check_seq_len(1, 1, 128)
    with pytest.raises(ValueError, match=r"expected N >= cp x min_local_rows = 1024; give --seq-len 1024 or more"):
        check_seq_len(512, 8, 128)
    check_seq_len(1024, 8, 128)  # the smallest that works
    from verl_ds4.cli import main

    assert main(["verify", "--cp", "8", "--seq-len", "512"]) == 2
    assert "give --seq-len 1024 or more" in capsys.readouterr().err
    assert main(["verify", "--cp", "2", "--seq-len", "300", "--model", "ds4_proxy"]) == 2
    assert main(["verify", "--model", "ds41", "--cp", "8", "--seq-len", "20"]) == 2
    assert "expected N >= cp x min_local_rows = 32" in capsys.readouterr().err
    assert main(["verify", "--cp", "8", "--seq-len", "40000", "--config", '{"max_position_embeddings": 4096, "sliding_window": 32}']) == 2
    assert "give --seq-len 4096 or less, or a config with max_position_embeddings >= 40000" in capsys.readouterr().err


def test_ds41_seq_len_above_the_tiny_positions_runs(monkeypatch, capsys):
    """``--model ds41 --seq-len 8192`` (above the tiny V4.1's 4,096 positions) runs: the field raised for the run and
    said, the CP=N run in QUERY_CHUNK_ROWS-row chunks; with a sequence above NEMO_MAX_TOKENS the NeMo rows are one
    n/a row (control: at NEMO_MAX_TOKENS they are there)."""
    import types

    import numpy as np

    from verl_ds4 import ds41_facts
    from verl_ds4.cli import main
    from verl_ds4.models.ds41.reference import tiny_text_config
    from verl_ds4.verify import ds41 as verify_ds41

    from verl_ds4.verify.parity import Row

    seen = {}

    def fake(cp, **kw):
        seen.update(kw, cp=cp)
        return {"rows": [Row("loss", 0.0, 0.0, 1e-10)], "seconds": 0.0, "stages": {}, "lengths": list(kw["lengths"])}

    monkeypatch.setattr(verify_ds41, "run_ds41_verify", fake)
    assert main(["verify", "--model", "ds41", "--cp", "8", "--seq-len", "8192"]) == 0
    err = capsys.readouterr().err
    assert "raised from 4096 to 8192" in err and "expected N <=" not in err
    assert seen["text"]["max_position_embeddings"] == 8192 and tiny_text_config()["max_position_embeddings"] == 4096
    assert seen["query_rows"] == QUERY_CHUNK_ROWS and max(seen["lengths"]) == 8192

    text = tiny_text_config()
    facts = ds41_facts.read_config({"model_type": ds41_facts.HF_MODEL_TYPE, "text_config": text})
    run = {"loss": np.ones(1), "log_probs": np.ones(4), "entropy": np.ones(4), "logits": np.ones((4, 2)),
           "grads": {"embedding.word_embeddings.weight": np.ones(3)}}  # fmt: skip
    for longest, nemo in ((verify_ds41.NEMO_MAX_TOKENS + 1, None), (verify_ds41.NEMO_MAX_TOKENS, run)):
        case = types.SimpleNamespace(facts=facts, lengths=(2, longest), loss_mask=lambda: np.ones(4, dtype=bool))
        rows = verify_ds41.ds41_rows(case, nemo, {1: run, 8: run}, 8)
        names = [r.quantity for r in rows]
        assert all(r.passed for r in rows) and "CP=8 vs CP=1: log_probs" in names
        against = [q for q in names if "vs NeMo" in q]
        if nemo is None:
            assert len(against) == 1 and "not run" in against[0] and rows[names.index(against[0])].expect == "absent"
        else:
            assert "CP=8 vs NeMo: log_probs" in against and "CP=1 vs NeMo: logits" in against


def test_ds41_seq_len_parity_at_cp4_in_row_chunks(tmp_path):
    """CI's shorter long-context case for V4.1: ``verify --model ds41 --cp 4 --seq-len 1024 --indexer-replay both``
    for real (CSA2's choices, replay and dense core in QUERY_CHUNK_ROWS-row chunks at CP 4: the chunk boundaries
    fall inside the long sequence on every rank; NeMo Automodel's rows run at this length). Control: replaying other
    valid entries changes the log-probs."""
    import json

    from verl_ds4.cli import main
    from verl_ds4.testing import ds41_reference as ref

    if ref.reference_missing() is not None:
        pytest.skip(str(ref.reference_missing()))
    out = tmp_path / "ds41.json"
    code = main(["verify", "--model", "ds41", "--cp", "4", "--seq-len", "1024", "--indexer-replay", "both", "--json", str(out)])
    result = json.loads(out.read_text())
    rows = {r["quantity"]: r for r in result["rows"]}
    assert code == 0 and result["passed"], [q for q, r in rows.items() if not r["passed"]]
    for needed in ("CP=4 vs CP=1: log_probs", "CP=4+replay vs CP=1+replay: log_probs", "CP=4 vs NeMo: log_probs",
                   "CP=4+replay vs NeMo: log_probs"):  # fmt: skip
        assert needed in rows, (needed, list(rows))
    assert all(r["max_rel"] <= 1e-10 for r in rows.values() if r["expect"] == "match")
    control = next(r for q, r in rows.items() if q.startswith("CP=4+replay control: indexer replay of other valid"))
    assert control["max_rel"] > 1e-3, control
    print(f"verify --model ds41 --cp 4 --seq-len 1024 --indexer-replay both: {result['seconds']:.1f} s")
