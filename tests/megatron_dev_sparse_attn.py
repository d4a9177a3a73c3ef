"""Run verl-ds4's linear sparse attention beside Megatron-LM dev's own functions and print the differences as JSON.

Run by tests/test_linear_sparse_attn_megatron_dev_on_cpu.py in a subprocess, because it imports Megatron-LM
``dev``'s ``megatron/core`` (the tree benchmarks/gpu/prepare_megatron_dev.sh exports) in place of the
installed megatron-core. Compared, each forward and backward:

* ``csa.unfused_compressed_sparse_attn`` vs ``verl_ds4.kernels.linear_sparse_attn``: THD (three packed
  sequences, DS4-style window + compressed ids, invalid ids, chunks across sequence ends, a CP rank's
  offset ids) and SBHD; float32 as Megatron runs, and float64 with Megatron's own code evaluated in float64
  (its ``.float()`` casts kept at float64) against the core in float64;
* ``csa.fused_qk_topk_naive`` vs ``verl_ds4.kernels.chunked_qk_topk`` (varlen THD and masked SBHD);
* ``csa._unfused_indexer_sparse_attn_from_topk`` vs the replacement in verl_ds4.mcore.sparse_attention_patch
  (dense indexer loss under CP);
* ``csa.FusedDSAIndexerLoss`` (CP 1: the indexer's top-k and its dense or sparse loss) vs
  verl_ds4.mcore.sparse_attention_cp1, in one chunk and in 5-row chunks;
* install / check / uninstall, and a changed Megatron function refused (negative control).

usage: python tests/megatron_dev_sparse_attn.py MEGATRON_DEV_DIR
"""

import contextlib
import importlib.util
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _import_csa(megatron_dir: str):
    sys.path.insert(0, megatron_dir)
    spec = importlib.util.spec_from_file_location("megatron_dsv4_memory", REPO / "benchmarks" / "gpu" / "megatron_dsv4_memory.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    harness.import_megatron("cpu")  # a no-op triton while dev's modules import
    from megatron.core.transformer.experimental_attention_variant import csa

    assert str(Path(csa.__file__).resolve()).startswith(str(Path(megatron_dir).resolve())), csa.__file__
    return csa


@contextlib.contextmanager
def float_keeps_float64():
    """Megatron's function casts with ``.float()``; inside this block a float64 tensor stays float64, so its
    own code evaluates the same math in float64."""
    original = torch.Tensor.float

    def as_float(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else original(self, *args, **kwargs)

    torch.Tensor.float = as_float
    try:
        yield
    finally:
        torch.Tensor.float = original


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300))


def ds4_ids(lengths, window, ratio, topk, gen, kv_offset=0):
    """THD ids of DS4 shape into ``[window rows of the buffer ; compressed rows]``: each row's own-sequence
    window keys, then ``topk`` of its sequence's completed blocks (random choice), -1 elsewhere."""
    total = sum(lengths)
    n_comp = [n // ratio for n in lengths]
    comp_start = [total + sum(n_comp[:i]) for i in range(len(lengths))]
    rows = []
    start = 0
    for seq, n in enumerate(lengths):
        for pos in range(n):
            win = [start + pos - j if pos - j >= 0 else -1 for j in range(window)]
            visible = (pos + 1) // ratio
            chosen = torch.randperm(visible, generator=gen)[:topk].tolist() if visible else []
            comp = [comp_start[seq] + b for b in chosen] + [-1] * (topk - len(chosen))
            rows.append([i + kv_offset if i >= 0 else -1 for i in comp + win])
        start += n
    return torch.tensor(rows, dtype=torch.int32), total + sum(n_comp)


def attention_cases(csa, linear):
    gen = torch.Generator().manual_seed(0)
    out = {}
    lengths, heads, dim = (37, 64, 27), 4, 32
    for label, offset in (("thd", 0), ("thd_cp_rank_offset", 40)):
        ids, n_kv = ds4_ids(lengths, 16, 4, 6, gen, kv_offset=offset)
        n_kv += offset
        for dtype in (torch.float32, torch.float64):
            q = torch.randn(ids.shape[0], heads, dim, generator=gen, dtype=dtype, requires_grad=True)
            kv = torch.randn(n_kv, dim, generator=gen, dtype=dtype, requires_grad=True)
            sink = torch.randn(heads, generator=gen, dtype=dtype, requires_grad=True)
            weight = torch.randn(ids.shape[0], heads * dim, generator=gen, dtype=dtype)
            ctx = float_keeps_float64() if dtype == torch.float64 else contextlib.nullcontext()
            with ctx:
                theirs = csa.unfused_compressed_sparse_attn(q, kv, sink, ids, dim**-0.5)
                their_grads = torch.autograd.grad((theirs * weight).sum(), (q, kv, sink))
            for chunk in (None, 7, 1000):
                ours = linear(q, kv, sink, ids, dim**-0.5, chunk_rows=chunk)
                our_grads = torch.autograd.grad((ours * weight).sum(), (q, kv, sink))
                key = f"{label}_{str(dtype)[6:]}_chunk{chunk or 'default'}"
                out[key] = max(rel(ours, theirs), *(rel(a, b) for a, b in zip(our_grads, their_grads)))
    # SBHD: per-batch local ids
    sq, b, n_kv = 48, 3, 60
    for dtype in (torch.float32, torch.float64):
        q = torch.randn(sq, b, heads, dim, generator=gen, dtype=dtype, requires_grad=True)
        kv = torch.randn(n_kv, b, dim, generator=gen, dtype=dtype, requires_grad=True)
        sink = torch.randn(heads, generator=gen, dtype=dtype, requires_grad=True)
        ids = torch.randint(0, n_kv, (b, sq, 12), generator=gen)
        ids = ids.masked_fill(torch.rand(b, sq, 12, generator=gen) < 0.3, -1)
        weight = torch.randn(sq, b, heads * dim, generator=gen, dtype=dtype)
        ctx = float_keeps_float64() if dtype == torch.float64 else contextlib.nullcontext()
        with ctx:
            theirs = csa.unfused_compressed_sparse_attn(q, kv, sink, ids, dim**-0.5)
            their_grads = torch.autograd.grad((theirs * weight).sum(), (q, kv, sink))
        ours = linear(q, kv, sink, ids, dim**-0.5, chunk_rows=5)
        our_grads = torch.autograd.grad((ours * weight).sum(), (q, kv, sink))
        out[f"sbhd_{str(dtype)[6:]}"] = max(rel(ours, theirs), *(rel(a, b) for a, b in zip(our_grads, their_grads)))
    return out


def topk_cases(csa, chunked):
    gen = torch.Generator().manual_seed(1)
    out = {}
    lengths, ratio = (50, 30, 48), 4
    total, comp = sum(lengths), [n // ratio for n in lengths]
    q = torch.randn(total, 1, 4, 16, generator=gen)
    k = torch.randn(sum(comp), 1, 16, generator=gen)
    w = torch.randn(total, 1, 4, generator=gen)
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    pos = torch.arange(total) - torch.tensor([0, 50, 80])[seq]
    starts = torch.tensor([0, comp[0], comp[0] + comp[1]])[seq]
    ends = starts + (pos + 1) // ratio
    _, theirs = csa.fused_qk_topk_naive(q, k, w, 5, varlen_starts=starts, varlen_ends=ends)
    for chunk in (None, 3, 1000):
        _, ours = chunked(q, k, w, 5, varlen_starts=starts, varlen_ends=ends, chunk_rows=chunk)
        out[f"varlen_chunk{chunk or 'default'}_ids_differ"] = int((ours != theirs).sum())
    sq, b = 40, 2
    q = torch.randn(sq, b, 4, 16, generator=gen)
    k = torch.randn(sq // 4, b, 16, generator=gen)
    w = torch.randn(sq, b, 4, generator=gen)
    mask = torch.where(torch.arange(sq // 4).unsqueeze(0) < ((torch.arange(sq) + 1) // 4).unsqueeze(1), 0.0, float("-inf"))
    _, theirs = csa.fused_qk_topk_naive(q, k, w, 3, mask)
    _, ours = chunked(q, k, w, 3, mask, chunk_rows=6)
    out["masked_sbhd_ids_differ"] = int((ours != theirs).sum())
    return out


def indexer_loss_cases(csa, patch, probes):
    originals = {name: getattr(csa, name) for name in patch.SIGNATURES}
    replacement = patch._replacements(csa, originals)["_unfused_indexer_sparse_attn_from_topk"]
    out = {}
    labels, theirs = probes.probe_indexer_loss(originals["_unfused_indexer_sparse_attn_from_topk"])
    _, ours = probes.probe_indexer_loss(replacement)
    for label, a, b in zip(labels, theirs, ours):
        out[f"dense_{label.replace(' ', '_')}"] = rel(b, a)
    return out


def cp1_indexer_loss_cases(csa, probes):
    """csa.FusedDSAIndexerLoss (dsa's naive indexer top-k + loss, CP 1) vs the chunked replacement, dense and sparse,
    in one chunk and in chunks of 5 rows (boundaries inside both sequences)."""
    from verl_ds4.mcore.sparse_attention_cp1 import chunked_indexer_loss

    out = {}
    labels, theirs = probes.probe_cp1_indexer_loss(csa.FusedDSAIndexerLoss)
    for chunk in (None, 5):
        _, ours = probes.probe_cp1_indexer_loss(chunked_indexer_loss(csa, csa.FusedDSAIndexerLoss, chunk_rows=chunk))
        for label, a, b in zip(labels, theirs, ours):
            key = f"chunk{chunk or 'default'}_{label.replace(' ', '_')}"
            out[key] = int((a != b).sum()) if not a.is_floating_point() else rel(b, a)
    return out


def install_cases(csa, patch):
    out = {"check_before_install": patch.check(csa)}
    own = csa.unfused_compressed_sparse_attn
    out["installed_names"] = patch.install(csa)
    out["core_is_ours"] = csa.unfused_compressed_sparse_attn.__module__
    out["check_while_installed"] = patch.check(csa)
    patch.uninstall()
    out["restored"] = csa.unfused_compressed_sparse_attn is own

    def changed(query, kv_full, attn_sink, topk_indices, softmax_scale):  # a Megatron whose core differs
        return own(query, kv_full, attn_sink + 0.01, topk_indices, softmax_scale)

    csa.unfused_compressed_sparse_attn = changed
    try:
        out["changed_function_problems"] = patch.check(csa)
        try:
            patch.install(csa)
            out["changed_function_refused"] = ""
        except patch.SparseAttentionPatchError as exc:
            out["changed_function_refused"] = str(exc)
    finally:
        csa.unfused_compressed_sparse_attn = own
    return out


def main():
    csa = _import_csa(sys.argv[1])
    sys.path.insert(0, str(REPO))
    from verl_ds4.kernels import chunked_qk_topk, linear_sparse_attn
    from verl_ds4.mcore import sparse_attention_patch, sparse_attention_probes

    result = {
        "megatron_file": csa.__file__,
        "attention": attention_cases(csa, linear_sparse_attn),
        "topk": topk_cases(csa, chunked_qk_topk),
        "indexer_loss": indexer_loss_cases(csa, sparse_attention_patch, sparse_attention_probes),
        "cp1_indexer_loss": cp1_indexer_loss_cases(csa, sparse_attention_probes),
        "install": install_cases(csa, sparse_attention_patch),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
