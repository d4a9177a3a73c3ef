"""V4.1 CSA2's row chunks (verl_ds4/models/ds41/csa2_rows.py): the numbers of one pass, memory not T x E.

Every layer of the tiny V4.1 (window-only, Full / Reindex / Reuse at ratio 2 and 1, the candidate source and the
hierarchical layer), the state handed on, three packed sequences, fp64, dense and linear core: run in 5-row chunks
(boundaries inside and across sequences; the indexer's choice and its recorded replay chunk by chunk, the dense core
chunk by chunk under a checkpoint) and in one chunk, the outputs, the input's and every parameter's gradients, the
selections and the recorded indexer choices agree (outputs and gradients to 1e-15 relative, choices exactly).
Control: a chunk that reads the first rows' positions instead of its own changes them.

Memory: the largest tensor any op makes in a forward + backward of one sequence grows about linearly with its
length in 8-row chunks (x 4 for 4 x the tokens, 32 -> 128); control: in one chunk it grows as T x E (x 9).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from verl_ds4.mcore import indexer_replay
from verl_ds4.models.ds41 import csa2_rows
from verl_ds4.models.ds41.csa2 import CSA2State, DS41Attention
from verl_ds4.models.ds41.reference import tiny_text_config

TEXT = tiny_text_config()
LENGTHS = (13, 22, 9)


def _layers(core: str = "dense") -> list[DS41Attention]:
    torch.manual_seed(3)
    layers = []
    for i in range(TEXT["num_hidden_layers"]):
        layer = DS41Attention(TEXT, i, dtype=torch.float64)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn_like(p) * 0.4)
        layer.sparse_core = core
        if layer.indexer_replay_width is not None:
            layer.indexer_replay = indexer_replay.IndexerReplay(f"layer {i}", layer.indexer_replay_width, layer.role.ratio)
            layer.indexer_replay.record = True
        layers.append(layer)
    return layers


def _run(layers, rows: int | None, lengths=LENGTHS):
    """Every layer in order (``rows`` query rows per chunk): outputs, input grads, parameter grads, selections, records."""
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(sum(lengths), TEXT["hidden_size"], dtype=torch.float64, generator=gen).requires_grad_() for _ in layers]
    cu = torch.tensor([0, *lengths]).cumsum(0)
    state, outs, selections = CSA2State(), [], []
    for layer, x in zip(layers, xs):
        layer.query_chunk_rows = rows
        layer.zero_grad(set_to_none=True)
        out, state = layer(x, state, cu_seqlens_padded=cu)
        outs.append(out)
        selections.append(None if state.selection is None else state.selection.clone())
    sum(out.square().sum() for out in outs).backward()
    grads = {f"{i}.{n}": p.grad.clone() for i, layer in enumerate(layers) for n, p in layer.named_parameters() if p.grad is not None}
    records = [layer.indexer_replay.last.clone() for layer in layers if getattr(layer, "indexer_replay", None) is not None]
    return [o.detach() for o in outs], [x.grad for x in xs], grads, selections, records


def _rel(a, b) -> float:
    if isinstance(a, list):
        a, b = torch.stack(a), torch.stack(b)
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("core", ["dense", "linear"])
def test_chunks_give_the_numbers_of_one_pass(core):
    layers = _layers(core)
    whole, chunked = _run(layers, None), _run(layers, 5)
    assert _rel(chunked[0], whole[0]) <= 1e-15 and _rel(chunked[1], whole[1]) <= 1e-15
    assert whole[2].keys() == chunked[2].keys() and any(".compressor." in n for n in whole[2])
    worst = max(_rel(chunked[2][n], whole[2][n]) for n in whole[2])
    assert worst <= 1e-15, worst
    for a, b in zip(whole[3], chunked[3]):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    assert len(whole[4]) == 4 and all(torch.equal(a, b) for a, b in zip(whole[4], chunked[4]))
    # the choices are not trivial: rows choosing index_topk of more reachable entries exist
    assert all(bool((s >= 0).all(dim=1).any()) and bool((s < 0).any()) for s in whole[3] if s is not None)


def test_a_chunk_reading_the_first_rows_positions_is_noticed(monkeypatch):
    layers = _layers()
    good = _run(layers, 5)

    def first_rows(q_pos, m, start, end):
        return (q_pos[: end - start] + 1) // m

    monkeypatch.setattr(csa2_rows, "_reach", first_rows)  # each chunk's choice reads rows 0..c-1's positions
    bad = _run(layers, 5)
    assert _rel(bad[0], good[0]) > 1e-3
    assert any(not torch.equal(a, b) for a, b in zip(bad[4], good[4]))


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.most = max([self.most] + [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out


def _largest(layers, tokens: int, rows: int | None) -> int:
    with _Largest() as seen:
        _run(layers, rows if rows else tokens, lengths=(tokens,))
    return seen.most


def test_the_largest_tensor_grows_with_tokens_not_tokens_times_entries():
    layers = _layers()
    chunked = _largest(layers, 128, 8) / _largest(layers, 32, 8)
    whole = _largest(layers, 128, None) / _largest(layers, 32, None)
    print(f"largest tensor, 4x the tokens: x{chunked:.1f} in 8-row chunks, x{whole:.1f} in one chunk")
    assert chunked <= 4.5
    assert whole >= 8  # control: one chunk scores [T, heads, E] (x 9 here: at 32 tokens a [T, h] tensor is as large)
