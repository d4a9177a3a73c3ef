"""The memory-linear DS4 sparse attention core (verl_ds4.kernels) against the project's dense reference of the
same math, and the Megatron patch's refusals, on CPU (CI; the comparison with Megatron-LM dev's own functions
is tests/test_linear_sparse_attn_megatron_dev_on_cpu.py).

Exactness: float64 <= 1e-12 relative (output and the gradients of query, KV and sink) against
``sparse_attn_reference`` (dense gather + softmax with the sink column, autograd); float32 <= 1e-5 against the
float64 reference. Cases: THD with several packed sequences (DS4-style window + compressed ids, ``-1`` ids, a
row with no key), a CP rank's offset ids, chunk boundaries inside and across sequences, SBHD. Memory: what the
autograd graph keeps (saved-tensor hooks), linear and without any ``[rows, K, d]`` tensor."""

from __future__ import annotations

import types

import pytest
import torch

from verl_ds4.kernels import (
    chunk_rows_for,
    chunked_dense_indexer_kl,
    chunked_qk_topk,
    linear_sparse_attn,
    sparse_attn_reference,
)
from verl_ds4.mcore import sparse_attention_patch


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def ds4_ids(lengths, window=8, ratio=4, topk=3, seed=0, offset=0):
    """[rows, topk + window] ids into [buffer rows ; compressed rows] the way DS4 builds them (own sequence only)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    comp = [n // ratio for n in lengths]
    rows, start = [], 0
    for seq, n in enumerate(lengths):
        base = total + sum(comp[:seq])
        for pos in range(n):
            chosen = torch.randperm((pos + 1) // ratio, generator=gen)[:topk].tolist()
            ids = [base + b for b in chosen] + [-1] * (topk - len(chosen))
            ids += [start + pos - j if pos >= j else -1 for j in range(window)]
            rows.append([i + offset if i >= 0 else -1 for i in ids])
        start += n
    return torch.tensor(rows, dtype=torch.int32), total + sum(comp) + offset


def _inputs(rows, n_kv, heads=3, dim=16, dtype=torch.float64, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, dim, generator=gen, dtype=dtype).requires_grad_()
    kv = torch.randn(n_kv, dim, generator=gen, dtype=dtype).requires_grad_()
    sink = torch.randn(heads, generator=gen, dtype=dtype).requires_grad_()
    weight = torch.randn(rows, heads * dim, generator=gen, dtype=dtype)
    return q, kv, sink, weight


def _run(fn, q, kv, sink, ids, weight, **kw):
    out = fn(q, kv, sink, ids, q.shape[-1] ** -0.5, **kw)
    return (out, *torch.autograd.grad((out * weight).sum(), (q, kv, sink)))


@pytest.mark.parametrize("chunk", [1, 7, 53, None])
@pytest.mark.parametrize("offset", [0, 25])
def test_float64_equals_the_dense_reference(chunk, offset):
    ids, n_kv = ds4_ids((37, 9, 54), offset=offset)
    ids[4] = -1  # a row with no key at all
    q, kv, sink, weight = _inputs(ids.shape[0], n_kv)
    ours = _run(linear_sparse_attn, q, kv, sink, ids, weight, chunk_rows=chunk)
    ref = _run(sparse_attn_reference, q, kv, sink, ids, weight)
    errors = [_rel(a, b) for a, b in zip(ours, ref)]
    assert max(errors) <= 1e-12, errors
    assert torch.all(ours[0][4] == 0)  # no key: the sink takes all the mass
    # Negative control: one key id moved by one row changes the result far beyond the tolerance.
    moved = ids.clone()
    moved[10, 0] = moved[10, 0] + 1 if moved[10, 0] >= 0 else 0
    assert max(_rel(a, b) for a, b in zip(_run(linear_sparse_attn, q, kv, sink, moved, weight, chunk_rows=chunk), ref)) > 1e-6


def test_float32_within_1e5_of_float64():
    ids, n_kv = ds4_ids((64, 40))
    q, kv, sink, weight = _inputs(ids.shape[0], n_kv)
    ref = _run(sparse_attn_reference, q, kv, sink, ids, weight)
    leaves = [t.detach().float().requires_grad_() for t in (q, kv, sink)]
    ours = _run(linear_sparse_attn, *leaves, ids, weight.float(), chunk_rows=11)
    assert ours[0].dtype == torch.float32
    assert max(_rel(a, b) for a, b in zip(ours, ref)) <= 1e-5


def test_bf16_inputs_compute_in_float32_and_return_bf16():
    ids, n_kv = ds4_ids((30,))
    q, kv, sink, weight = _inputs(ids.shape[0], n_kv)
    leaves = [q.detach().bfloat16().requires_grad_(), kv.detach().bfloat16().requires_grad_(), sink.detach().float().requires_grad_()]
    out, gq, gkv, gs = _run(linear_sparse_attn, *leaves, ids, weight.bfloat16())
    assert (out.dtype, gq.dtype, gkv.dtype, gs.dtype) == (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32)
    ref = _run(sparse_attn_reference, *(t.detach().double().requires_grad_() for t in leaves), ids, weight.bfloat16().double())
    assert _rel(out, ref[0]) < 2e-2  # bf16 rounding of the output only


def test_sbhd_equals_the_reference_and_its_flat_thd_form():
    gen = torch.Generator().manual_seed(3)
    sq, b, heads, dim, n_kv = 20, 3, 2, 8, 24
    q = torch.randn(sq, b, heads, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(n_kv, b, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    sink = torch.randn(heads, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(-1, n_kv, (b, sq, 5), generator=gen)
    weight = torch.randn(sq, b, heads * dim, generator=gen, dtype=torch.float64)
    ours = _run(linear_sparse_attn, q, kv, sink, ids, weight, chunk_rows=4)
    ref = _run(sparse_attn_reference, q, kv, sink, ids, weight)
    assert ours[0].shape == (sq, b, heads * dim)
    assert max(_rel(a, c) for a, c in zip(ours, ref)) <= 1e-12
    flat_ids = torch.where(ids >= 0, ids + (torch.arange(b) * n_kv).view(b, 1, 1), ids).reshape(b * sq, -1)
    flat = linear_sparse_attn(q.permute(1, 0, 2, 3).reshape(b * sq, heads, dim), kv.permute(1, 0, 2).reshape(b * n_kv, dim), sink, flat_ids, dim**-0.5)
    assert torch.allclose(flat.reshape(b, sq, -1).permute(1, 0, 2), ours[0], rtol=0, atol=1e-14)


@pytest.mark.parametrize("bad", [-2, 40])
def test_ids_outside_the_buffer_are_refused(bad):
    q, kv, sink, _ = _inputs(6, 40)
    ids = torch.full((6, 3), -1, dtype=torch.int32)
    linear_sparse_attn(q, kv, sink, ids, 0.25)  # control: -1 everywhere is valid
    ids[2, 1] = bad
    with pytest.raises(ValueError, match=f"key id {bad} is outside the KV buffer"):
        linear_sparse_attn(q, kv, sink, ids, 0.25)


def test_kept_bytes_are_linear_and_hold_no_gathered_keys():
    """What the autograd graph keeps for backward: the reference keeps the gathered [rows, K, d] keys (and more);
    the core keeps q, kv, sink, ids and a [rows, heads] log-sum-exp only."""

    def kept(fn, rows):
        ids, n_kv = ds4_ids((rows,), window=16, topk=8)
        q, kv, sink, _ = _inputs(rows, n_kv, heads=4, dim=32, dtype=torch.float32)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fn(q, kv, sink, ids, 0.2)
        own = {id(t) for t in (q, kv, sink)}
        return sum(t.numel() * t.element_size() for t in saved if id(t) not in own and t.data_ptr() not in {x.data_ptr() for x in (q, kv, sink)}), saved

    (ours_256, saved), (ours_512, _) = kept(linear_sparse_attn, 256), kept(linear_sparse_attn, 512)
    assert ours_512 == 2 * ours_256  # ids [rows, 24] int32 + lse [rows, 4] float32
    assert ours_256 == 256 * (24 * 4 + 4 * 4)
    assert not any(t.dim() == 3 and t.shape[1:] == (24, 32) for t in saved)
    ref_256, ref_saved = kept(sparse_attn_reference, 256)
    assert any(t.dim() == 3 and t.shape[1:] == (24, 32) for t in ref_saved)  # control: the dense form keeps them
    assert ref_256 > 10 * ours_256


def test_chunk_rows_follow_the_byte_budget():
    rows = chunk_rows_for(64, 512, 640, torch.bfloat16)
    assert 60 <= rows <= 100  # DS4-Flash CSA: 73 rows in 256 MiB
    assert chunk_rows_for(64, 512, 640, torch.bfloat16, budget_bytes=1) == 1
    with pytest.raises(ValueError, match="chunk_rows must be a positive"):
        linear_sparse_attn(*_inputs(4, 8)[:3], torch.zeros(4, 2, dtype=torch.int64), 0.3, chunk_rows=0)


def _dense_topk(q, k, w, topk, starts, ends):
    scores = (torch.relu(torch.einsum("sbhd,tbd->sbht", q.float(), k.float())) * w.unsqueeze(-1)).sum(2).transpose(0, 1)
    pos = torch.arange(k.shape[0])
    visible = (pos >= starts.unsqueeze(1)) & (pos < ends.unsqueeze(1))
    values, ids = scores.masked_fill(~visible, float("-inf")).topk(topk, dim=-1)
    return ids.masked_fill(values == float("-inf"), -1)


@pytest.mark.parametrize("chunk", [1, 5, None])
def test_chunked_topk_equals_whole_rows(chunk):
    gen = torch.Generator().manual_seed(4)
    lengths, ratio = (30, 22), 4
    comp = [n // ratio for n in lengths]
    q, k, w = torch.randn(52, 1, 3, 8, generator=gen), torch.randn(sum(comp), 1, 8, generator=gen), torch.randn(52, 1, 3, generator=gen)
    seq = torch.repeat_interleave(torch.arange(2), torch.tensor(lengths))
    pos = torch.arange(52) - torch.tensor([0, 30])[seq]
    starts = torch.tensor([0, comp[0]])[seq]
    ends = starts + (pos + 1) // ratio
    _, ids = chunked_qk_topk(q, k, w, 4, varlen_starts=starts, varlen_ends=ends, chunk_rows=chunk)
    expected = _dense_topk(q, k, w, 4, starts, ends)
    assert torch.equal(ids, expected)
    assert (ids[0, :3] == -1).all()  # positions 0-2 see no completed block
    assert ((ids[0, 40] >= comp[0]) | (ids[0, 40] == -1)).all()  # the second sequence's own blocks only
    _, shifted = chunked_qk_topk(q, k, w, 4, varlen_starts=starts, varlen_ends=ends + 1, chunk_rows=chunk)
    assert not torch.equal(shifted, expected)  # control: one more visible key per row changes the choice


def _dense_kl_reference(q, k, w, scale, valid, target):
    """The indexer KL written densely (float64, autograd), with float32's tiny clamps as Megatron applies them."""
    tiny = torch.finfo(torch.float32).tiny
    logits = (torch.relu(torch.einsum("rhd,kd->rhk", q, k)) * (w * scale).unsqueeze(-1)).sum(1).masked_fill(~valid, float("-inf"))
    row_valid = valid.any(-1, keepdim=True)
    predict = (torch.softmax(torch.where(row_valid, logits, 0.0), -1) * row_valid).clamp(min=tiny)
    t = (target * row_valid).clamp(min=tiny)
    kl = (t * (t.log() - predict.log())).sum(-1)
    return torch.where(row_valid.squeeze(-1), kl, 0.0).sum()


@pytest.mark.parametrize("chunk", [1, 6, None])
def test_chunked_dense_indexer_kl_matches_the_dense_loss(chunk):
    gen = torch.Generator().manual_seed(5)
    rows, heads, dim, keys = 24, 3, 8, 10
    q = torch.randn(rows, heads, dim, generator=gen, requires_grad=True)
    k = torch.randn(keys, dim, generator=gen, requires_grad=True)
    w = torch.randn(rows, heads, generator=gen, requires_grad=True)
    valid = torch.rand(rows, keys, generator=gen) < 0.6
    valid[3] = False  # a row with no visible key contributes nothing
    target = torch.softmax(torch.randn(rows, keys, generator=gen).masked_fill(~valid, float("-inf")), -1).nan_to_num(0.0)

    loss = chunked_dense_indexer_kl(q, k, w, 0.7, lambda s, e: valid[s:e], lambda v, s, e: target[s:e], chunk_rows=chunk)
    grads = torch.autograd.grad(loss, (q, k, w))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, w)]
    ref = _dense_kl_reference(*leaves[:2], leaves[2], 0.7, valid, target.double())
    ref_grads = torch.autograd.grad(ref, leaves)
    assert _rel(loss, ref) <= 1e-5
    assert max(_rel(a, b) for a, b in zip(grads, ref_grads)) <= 1e-5
    wrong = chunked_dense_indexer_kl(q, k, w, 0.7, lambda s, e: valid[s:e], lambda v, s, e: target[s:e].flip(-1), chunk_rows=chunk)
    assert _rel(wrong, ref) > 1e-3  # control: another target is seen


def test_the_patch_needs_megatron_dev_and_says_so():
    """megatron-core 0.16.1 (this venv) has no DS4 attention: installing is refused with the fix."""
    with pytest.raises(sparse_attention_patch.SparseAttentionPatchError, match="needs Megatron-LM dev's DS4 attention"):
        sparse_attention_patch.install()
    assert not sparse_attention_patch.installed()


def test_a_megatron_with_other_signatures_is_refused():
    fake = types.ModuleType("fake_csa")
    fake.__file__ = "fake_csa.py"
    fake.unfused_compressed_sparse_attn = lambda query, kv_full, attn_sink, topk_indices, softmax_scale, extra=0: None
    fake.fused_qk_topk_naive = lambda q, k, weights, index_topk, mask=None, varlen_starts=None, varlen_ends=None, key_positions=None, use_relu=True: None
    problems = sparse_attention_patch.check(fake)
    assert any("csa.unfused_compressed_sparse_attn(query, kv_full, attn_sink, topk_indices, softmax_scale, extra) differs" in p for p in problems)
    assert "csa._unfused_indexer_sparse_attn_from_topk is missing" in problems
    assert not any("fused_qk_topk_naive" in p for p in problems)  # control: the matching one is not named
    with pytest.raises(sparse_attention_patch.SparseAttentionPatchError, match="Fix: use the Megatron-LM dev the GPU image pins"):
        sparse_attention_patch.install(fake)
    assert fake.unfused_compressed_sparse_attn.__name__ == "<lambda>"  # nothing was replaced
