"""The tiny V4.1 backbone (``verl_ds4.models.ds41.model.DS41Model``: Engram, single-pass mHC, CSA2 with
every role, V4's MoE) against NeMo Automodel 0.7.0's ``DeepseekV41ForCausalLM`` at fp64, and under CP.

* one sequence and 4 packed sequences: logits <= 1e-10 relative to the reference with the same weights;
* contiguous CP 2 and 4 over real gloo processes: the ranks' logits, concatenated, equal CP 1 and the
  reference; negative control: the Engram rows hashed without the previous rank's last token ids
  (CSA2's halo left in place) are off at the rank starts;
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
