"""The tiny V4.1 backbone (``verl_ds4.models.ds41.model.DS41Model``: Engram, single-pass mHC, CSA2 with
every role, V4's MoE) against NeMo Automodel 0.7.0's ``DeepseekV41ForCausalLM`` at fp64, and under CP.

* one sequence and 4 packed sequences: logits <= 1e-10 relative to the reference with the same weights;
* contiguous CP 2 and 4 over real gloo processes: the ranks' logits, concatenated, equal CP 1 and the
  reference; negative control: the Engram rows hashed without the previous rank's last token ids
  (CSA2's halo left in place) are off at the rank starts;
* gradients of every trained tensor (the indexer is frozen on both sides) equal the reference's, and
  at CP 2 and 4 (summed over the ranks) equal CP 1; negative control: an all-gather whose backward
  keeps only the local slice gives wrong compressor gradients;
* a model with Engram layers and no normalisation table is refused at construction.
"""

from __future__ import annotations

import pytest
import torch

from verl_ds4.models.ds41.engram import engram_token_map
from verl_ds4.models.ds41.model import DS41Model
from verl_ds4.testing import ds41_reference as ref

pytestmark = pytest.mark.skipif(ref.reference_missing() is not None, reason=str(ref.reference_missing()))

TEXT = ref.tiny_text_config()
LENGTHS = [10, 18, 14, 6]
CU = torch.tensor([0, 10, 28, 42, 48])


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def models():
    with ref.fp64_reference():
        theirs = ref.build_reference_model(TEXT)
    ours = DS41Model(TEXT, engram_token_map(ref.local_tokenizer())[0], dtype=torch.float64)
    assert ref.copy_reference_weights(ours, theirs) == len(list(ours.parameters())) + len(ours.decoder.layers)
    return ours, theirs


def ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TEXT["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


def reference_packed(theirs, tokens):
    seq_ids = torch.repeat_interleave(torch.arange(1, 5), torch.tensor(LENGTHS)).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    with ref.fp64_reference(), torch.no_grad():
        return theirs(tokens.view(1, -1), attention_mask=torch.ones_like(seq_ids), position_ids=positions,
                      packed_seq_ids=seq_ids).logits[0]  # fmt: skip


def test_one_sequence_equals_the_reference():
    ours, theirs = models()
    tokens = ids(24)
    with ref.fp64_reference(), torch.no_grad():
        expected = theirs(tokens.view(1, -1)).logits[0]
    with torch.no_grad():
        got = ours(tokens)
    err = rel(got, expected)
    lp = rel(got.log_softmax(-1), expected.log_softmax(-1))
    print(f"V4.1 tiny model, one sequence: logits {err:.1e}, log-probs {lp:.1e} relative (fp64)")
    assert err <= 1e-10 and lp <= 1e-10


def test_packed_sequences_equal_the_reference():
    ours, theirs = models()
    tokens = ids(48, 1)
    expected = reference_packed(theirs, tokens)
    with torch.no_grad():
        got = ours(tokens, cu_seqlens_padded=CU)
    print(f"V4.1 tiny model, 4 packed sequences: logits {rel(got, expected):.1e} relative (fp64)")
    assert rel(got, expected) <= 1e-10
    with torch.no_grad():  # negative control: the boundaries ignored
        assert rel(ours(tokens), expected) > 1e-3


def _cp_rank(rank: int, world: int, ours: DS41Model, drop_engram_halo: bool):
    """One CP rank (forked: ``ours`` is the parent's model; the reference is not rebuilt in a rank,
    where it would shard its Engram tables over the gloo world)."""
    import torch.distributed as dist

    from verl_ds4.models.ds41 import engram

    if drop_engram_halo:
        engram.exchange_left_halo = lambda x, rows, group: torch.zeros_like(x[:rows])
    local = slice(rank * 48 // world, (rank + 1) * 48 // world)
    with torch.no_grad():
        return ours(ids(48, 1)[local], cu_seqlens_padded=CU, cp_group=dist.group.WORLD).tolist()


@pytest.mark.parametrize("world", [2, 4])
def test_cp_over_gloo_equals_cp1_and_the_reference(world):
    from verl_ds4.mcore.distributed import run_distributed

    ours, theirs = models()
    tokens = ids(48, 1)
    expected = reference_packed(theirs, tokens)
    with torch.no_grad():
        cp1 = ours(tokens, cu_seqlens_padded=CU)
    got = torch.cat([torch.tensor(p, dtype=torch.float64) for p in run_distributed(_cp_rank, world_size=world, args=(ours, False))])
    print(f"V4.1 tiny model CP={world} over gloo: vs CP=1 {rel(got, cp1):.1e}, vs the reference {rel(got, expected):.1e}")
    assert rel(got, cp1) <= 1e-12 and rel(got, expected) <= 1e-10
    dropped = torch.cat([torch.tensor(p, dtype=torch.float64) for p in run_distributed(_cp_rank, world_size=world, args=(ours, True))])
    rows = (dropped - cp1).abs().amax(-1) > 1e-9 * cp1.abs().max()
    starts = {r * 48 // world for r in range(1, world)}
    print(f"without the Engram halo: rows off {rows.nonzero().flatten().tolist()}, {rel(dropped, cp1):.1e} relative")
    assert rows.any() and not rows[: min(starts)].any()


def test_engram_without_its_table_is_refused():
    with pytest.raises(ValueError, match="tokenizer-normalisation table: pass token_map"):
        DS41Model(TEXT, None, dtype=torch.float64)


# ------------------------------------------------------------------------------------ gradients


def loss_weights(rows: int) -> torch.Tensor:
    return torch.randn(rows, TEXT["vocab_size"], dtype=torch.float64, generator=torch.Generator().manual_seed(11))


def grad_rel(got: torch.Tensor, want: torch.Tensor, scale: float) -> float:
    """``max |got - want| / max(max |want|, 1e-6 * scale)``: relative per tensor, except for a gradient
    that cancels to almost nothing (layer 0's ``alpha_res``, ~1e-6 of the largest: its streams are
    identical copies of the embedding, so the residual mix barely depends on it), measured against
    the model's gradient scale instead."""
    return float((got - want).abs().max() / max(float(want.abs().max()), 1e-6 * scale))


def grad_errors(ours: DS41Model, expected: dict) -> dict[str, float]:
    """:func:`grad_rel` of every gradient of ours against ``expected`` (our names)."""
    scale = max(float(g.abs().max()) for g in expected.values() if g is not None)
    out = {}
    for name, param in ours.named_parameters():
        want = expected[name]
        if "indexer" in name:  # frozen: the top-k gives the LM loss no path to the indexer (both sides)
            assert param.grad is None and want is None, name
            continue
        out[name] = grad_rel(param.grad, want, scale)
    return out


def test_gradients_equal_the_reference():
    ours, theirs = models()
    tokens, weights = ids(48, 1), loss_weights(48)
    seq_ids = torch.repeat_interleave(torch.arange(1, 5), torch.tensor(LENGTHS)).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    with ref.fp64_reference():
        logits = theirs(tokens.view(1, -1), attention_mask=torch.ones_like(seq_ids), position_ids=positions,
                        packed_seq_ids=seq_ids).logits[0]  # fmt: skip
        (logits * weights).sum().backward()
    (ours(tokens, cu_seqlens_padded=CU) * weights).sum().backward()
    errors = grad_errors(ours, ref.reference_tensors(ours, theirs, grads=True))
    worst = max(errors, key=errors.get)
    print(f"gradients vs the reference (4 packed sequences, {len(errors)} tensors): worst {errors[worst]:.1e} ({worst})")
    assert errors[worst] <= 1e-10


def _grad_rank(rank: int, world: int, ours: DS41Model, local_only_gather: bool):
    import torch.distributed as dist

    from verl_ds4.models.ds4 import cp_comm

    if local_only_gather:  # negative control: the all-gather's backward keeps only this rank's own gradient
        cp_comm._AllGatherRows.backward = staticmethod(
            lambda ctx, grad: (grad[sum(ctx.counts[: ctx.rank]) : sum(ctx.counts[: ctx.rank + 1])], None, None)
        )
    local = slice(rank * 48 // world, (rank + 1) * 48 // world)
    (ours(ids(48, 1)[local], cu_seqlens_padded=CU, cp_group=dist.group.WORLD) * loss_weights(48)[local]).sum().backward()
    grads = {}
    for name, param in ours.named_parameters():  # same order on every rank; an unused expert gives zeros
        if "indexer" in name:
            continue
        grad = torch.zeros_like(param) if param.grad is None else param.grad
        dist.all_reduce(grad)  # CP ranks hold replicas: their gradients add up
        grads[name] = grad.tolist()
    return grads


@pytest.mark.parametrize("world", [2, 4])
def test_cp_gradients_over_gloo_equal_cp1(world):
    from verl_ds4.mcore.distributed import run_distributed

    ours, _ = models()
    fresh = {k: v.clone() for k, v in ours.state_dict().items()}
    (ours(ids(48, 1), cu_seqlens_padded=CU) * loss_weights(48)).sum().backward()
    cp1 = {name: p.grad.clone() for name, p in ours.named_parameters() if p.grad is not None}
    ours.zero_grad(set_to_none=True)
    ours.load_state_dict(fresh)
    results = run_distributed(_grad_rank, world_size=world, args=(ours, False))[0]
    scale = max(float(g.abs().max()) for g in cp1.values())
    errors = {name: grad_rel(torch.tensor(results[name], dtype=torch.float64), g, scale) for name, g in cp1.items()}
    worst = max(errors, key=errors.get)
    print(f"CP={world} gradients vs CP=1 ({len(errors)} tensors): worst {errors[worst]:.1e} ({worst})")
    assert set(cp1) <= set(results) and errors[worst] <= 1e-10
    assert all(not any(torch.tensor(results[n]).flatten()) for n in set(results) - set(cp1))  # unused at CP 1 too
    broken = run_distributed(_grad_rank, world_size=world, args=(ours, True))[0]
    off = {n: grad_rel(torch.tensor(broken[n], dtype=torch.float64), g, scale) for n, g in cp1.items() if "compressor" in n}
    print(f"all-gather backward kept local: compressor gradients off by up to {max(off.values()):.1e}")
    assert max(off.values()) > 1e-3
