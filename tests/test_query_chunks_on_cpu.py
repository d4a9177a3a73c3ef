"""Row chunks of the DS4 attention's compressed-block work (verl_ds4/models/query_chunks.py, models/ds4/csa_rows.py).

One CSA layer (indexer loss on) and one HCA layer, fp64, three packed sequences: the same layer run in 7-row
chunks (chunk boundaries inside every sequence, the indexer's choice, the dense and the linear core and the indexer
loss chunk by chunk, each chunk checkpointed) and in one chunk give the same output, indexer loss, gradients of
every parameter and of the input, and the same recorded indexer choices (replay recorded chunk by chunk). Control:
a chunk that reads the first rows' visibility instead of its own changes the output. Also: ``verify --seq-len``'s
``max_position_embeddings`` rule and its malloc bound.
"""

import pytest
import torch

from verl_ds4.models.ds4 import csa_rows
from verl_ds4.models.ds4.attention import DS4AttentionSpec, DS4HybridAttention

LENGTHS = (37, 70, 21)


def _layer(ratio: int, core: str) -> DS4HybridAttention:
    torch.manual_seed(3)
    spec = DS4AttentionSpec(hidden_size=16, num_heads=2, head_dim=16, rope_dim=8, q_lora_rank=8, o_groups=2, o_lora_rank=4,
                            compress_ratio=ratio, window_size=8, index_n_heads=2, index_head_dim=8, index_topk=3,
                            yarn_factor=None, indexer_loss_coeff=0.5)  # fmt: skip
    layer = DS4HybridAttention(spec, dtype=torch.float64).train()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    layer.sparse_core = core
    return layer


def _run(layer, rows: int | None):
    from verl_ds4.mcore import indexer_replay

    layer.query_chunk_rows = rows
    if layer.indexer is not None:
        layer.indexer_replay = indexer_replay.IndexerReplay("csa", layer.spec.index_topk, layer.spec.compress_ratio)
        layer.indexer_replay.record = True
    x = torch.randn(sum(LENGTHS), 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).requires_grad_()
    cu = torch.tensor([0, *LENGTHS]).cumsum(0)
    layer.zero_grad(set_to_none=True)
    out = layer(x, cu)
    (out.square().sum()).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    ids = layer.indexer_replay.last.clone() if layer.indexer is not None else None
    loss = layer.last_indexer_loss
    return out.detach(), x.grad.clone(), grads, ids, loss


@pytest.mark.parametrize("ratio,core", [(4, "dense"), (4, "linear"), (8, "dense")])
def test_chunks_give_the_numbers_of_one_pass(ratio, core):
    layer = _layer(ratio, core)
    whole, chunked = _run(layer, 10_000), _run(layer, 7)
    assert torch.allclose(whole[0], chunked[0], rtol=0, atol=1e-13)
    assert torch.allclose(whole[1], chunked[1], rtol=0, atol=1e-12)
    assert whole[2].keys() == chunked[2].keys()
    for name in whole[2]:
        assert torch.allclose(whole[2][name], chunked[2][name], rtol=0, atol=1e-11), name
    if ratio == 4:
        assert any(".indexer." in n for n in whole[2])  # the indexer loss trains the indexer, chunked too
        assert torch.equal(whole[3], chunked[3]) and whole[3].shape == (sum(LENGTHS), 3)
        assert abs(float(whole[4]) - float(chunked[4])) <= 1e-15 and float(whole[4]) > 0


def test_a_chunk_reading_other_rows_is_noticed(monkeypatch):
    layer = _layer(4, "dense")
    good = _run(layer, 7)[0]
    original = csa_rows.Selection.attended
    monkeypatch.setattr(csa_rows.Selection, "attended", lambda self, start, end: original(self, 0, end - start))
    bad = _run(layer, 7)[0]
    assert (good - bad).abs().max() > 1e-3


def test_seq_len_positions_and_malloc():
    from verl_ds4.verify.seqlen import bound_malloc, fit_positions

    cfg = {"max_position_embeddings": 4096}
    assert fit_positions(4096, cfg, given=True) == (cfg, None)
    raised, note = fit_positions(32768, cfg, given=False)
    assert raised["max_position_embeddings"] == 32768 and cfg["max_position_embeddings"] == 4096 and "raised from 4096" in note
    with pytest.raises(ValueError, match="max_position_embeddings = 4096, expected N <= 4096; give --seq-len 4096 or less"):
        fit_positions(32768, cfg, given=True)
    assert bound_malloc() in (True, False)
