"""V4.1 Engram (``verl_ds4.models.ds41.engram``) against NeMo Automodel 0.7.0's at fp64, and under CP.

* the tokenizer-normalisation table equals the reference's (two tokenizers, one with whitespace,
  accented and full-width tokens); a wrong compressed-vocabulary size is refused by both;
* the n-gram table rows equal the reference's exactly on packed sequences with padding and masked
  tokens (negative control: another layer's multipliers give other rows);
* the Engram layer equals the reference's at fp64 with the same weights (<= 1e-10 relative);
  negative control: one changed norm weight is far off;
* contiguous CP over real gloo processes (2 and 4 ranks): every rank's rows and layer outputs equal
  the CP = 1 result; negative control: dropping the previous rank's last tokens (no halo) changes the
  first rows of every rank after the first.
"""

from __future__ import annotations

import time

import pytest
import torch

from verl_ds4.mcore.distributed import run_distributed
from verl_ds4.models.ds41.engram import DS41Engram, EngramHasher, engram_token_map
from verl_ds4.testing import ds41_reference as ref

pytestmark = pytest.mark.skipif(ref.reference_missing() is not None, reason=str(ref.reference_missing()))

TEXT = ref.tiny_text_config()
T = 24


def tricky_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = ["<s>", "</s>", "<pad>", "<unk>", " ", "  ", "\t", " the", "The ", "Ｔｈｅ", "ﬁne", "fine", "Ångström",
              "angstrom", "\u00a0x", "x", "İ", "i", "\n\n", "naïve", "naive", "ß", "SS"]  # fmt: skip
    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def packed_batch(seed: int = 0):
    """ids [T]; sequence ids [T]: three sequences straddling 12- and 6-row boundaries, then padding (0);
    a mask with two masked tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TEXT["vocab_size"], (T,), generator=g)
    seq = torch.tensor([1] * 7 + [2] * 9 + [3] * 5 + [0] * 3)
    mask = torch.ones(T, dtype=torch.bool)
    mask[[4, 13]] = False
    return ids, seq, mask


def reference_hasher():
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig
    from nemo_automodel.components.models.deepseek_v41.engram import DeepseekV41NgramHash

    return DeepseekV41NgramHash(DeepseekV41TextConfig(**TEXT), ref.local_tokenizer())


def our_hasher(text=TEXT):
    return EngramHasher(text, engram_token_map(ref.local_tokenizer())[0])


@pytest.mark.parametrize("make", [ref.local_tokenizer, tricky_tokenizer], ids=["local", "tricky"])
def test_token_map_equals_the_reference(make):
    from nemo_automodel.components.models.deepseek_v41.engram import _compressed_token_map

    ours, count = engram_token_map(make())
    theirs, their_count = _compressed_token_map(make())
    assert ours == list(theirs) and count == their_count
    assert count < len(ours)  # spellings were merged


def test_wrong_compressed_vocabulary_size_is_refused():
    table, count = engram_token_map(ref.local_tokenizer())
    with pytest.raises(ValueError, match=f"engram_compressed_vocab_size={count + 1}.*normalises onto {count}"):
        EngramHasher(dict(TEXT, engram_compressed_vocab_size=count + 1), table)


def test_hash_rows_equal_the_reference_exactly():
    ids, seq, mask = packed_batch()
    ours = our_hasher()(ids, seq, mask)
    theirs = reference_hasher()(ids.view(1, -1), token_mask=mask.view(1, -1), sequence_ids=seq.view(1, -1))[0]
    assert ours.shape == theirs.shape == (T, 2, 4) and torch.equal(ours, theirs)
    plain = reference_hasher()(ids.view(1, -1))[0]
    assert torch.equal(our_hasher()(ids), plain)
    # negative control: layer 3's multipliers in place of layer 1's give other rows
    wrong = our_hasher()
    wrong.multipliers = wrong.multipliers.flip(0)
    assert not torch.equal(wrong(ids, seq, mask)[:, 0], theirs[:, 0])


def engram_pair(seed: int = 0):
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig
    from nemo_automodel.components.models.deepseek_v41.engram import DeepseekV41Engram

    with ref.fp64_reference():
        theirs = DeepseekV41Engram(DeepseekV41TextConfig(**TEXT), 1, ref.reference_backend()).double()
    ref._randomise(theirs, torch.Generator().manual_seed(seed), std=0.3)
    ours = DS41Engram.from_config(TEXT, 1, dtype=torch.float64)
    with torch.no_grad():
        ours.multi_head_embedding.weight.copy_(theirs.embed.weight[: ours.rows])
        ours.linear_kv_proj.weight.copy_(theirs.wkv.weight)
        ours.query_norm.weight.copy_(theirs.q_weight)
        ours.key_norm.weight.copy_(theirs.k_weight)
    return ours, theirs


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_engram_layer_equals_the_reference_at_fp64():
    ours, theirs = engram_pair()
    ids, seq, mask = packed_batch(1)
    rows = our_hasher()(ids, seq, mask)[:, 0]
    streams = torch.randn(T, TEXT["hc_mult"], TEXT["hidden_size"], dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with ref.fp64_reference():
        expected = theirs(streams.unsqueeze(0), rows.unsqueeze(0), token_mask=mask.view(1, -1))[0]
    got = ours(streams, rows, mask)
    err = rel(got, expected)
    print(f"Engram layer fp64 relative difference: {err:.2e}")
    assert err <= 1e-10 and rel(got, streams) > 1e-2  # it did change the streams
    assert torch.equal(got[~mask], streams[~mask])  # masked rows untouched
    with torch.no_grad():
        ours.key_norm.weight[0, 0] += 0.5  # negative control
    assert rel(ours(streams, rows, mask), expected) > 1e-6


def _cp_rank(rank: int, world: int, drop_halo: bool):
    import torch.distributed as dist

    ids, seq, mask = packed_batch()
    local = slice(rank * T // world, (rank + 1) * T // world)
    hasher = our_hasher()
    rows = hasher(ids[local], seq[local], mask[local], cp_group=None if drop_halo else dist.group.WORLD)
    ours, _ = engram_pair()
    streams = torch.randn(T, TEXT["hc_mult"], TEXT["hidden_size"], dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out = ours(streams[local], rows[:, 0], mask[local])
    return rows.tolist(), out.tolist()


@pytest.mark.parametrize("world", [2, 4])
def test_cp_rows_and_outputs_equal_cp1_over_gloo(world):
    ids, seq, mask = packed_batch()
    full_rows = our_hasher()(ids, seq, mask)
    ours, _ = engram_pair()
    streams = torch.randn(T, TEXT["hc_mult"], TEXT["hidden_size"], dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    full_out = ours(streams, full_rows[:, 0], mask)
    start = time.perf_counter()
    parts = run_distributed(_cp_rank, world_size=world, args=(False,))
    rows = torch.cat([torch.tensor(r) for r, _ in parts])
    out = torch.cat([torch.tensor(o, dtype=torch.float64) for _, o in parts])
    assert torch.equal(rows, full_rows)
    err = rel(out, full_out)
    print(f"CP={world} Engram over gloo: rows equal, output relative difference {err:.2e} ({time.perf_counter() - start:.1f} s)")
    assert err <= 1e-12
    # negative control: without the previous rank's last ids the first rows of ranks 1.. differ
    dropped = run_distributed(_cp_rank, world_size=world, args=(True,))
    rows_dropped = torch.cat([torch.tensor(r) for r, _ in dropped])
    out_dropped = torch.cat([torch.tensor(o, dtype=torch.float64) for _, o in dropped])
    differ = (rows_dropped != full_rows).any(-1).any(-1).nonzero().flatten().tolist()
    starts = [r * T // world for r in range(1, world)]
    assert differ and set(differ) <= {s + k for s in starts for k in range(TEXT["engram_max_ngram_size"] - 1)}, differ
    print(f"CP={world} without the halo: rows differ at {differ}, output relative difference {rel(out_dropped, full_out):.2e}")
    assert rel(out_dropped, full_out) > 1e-6


def test_cp_needs_enough_rows_per_rank():
    def one_row(rank, world):
        import torch.distributed as dist

        try:
            our_hasher()(torch.tensor([5]), cp_group=dist.group.WORLD)
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    messages = run_distributed(one_row, world_size=2)
    assert all("needs >= 2 rows per rank" in m for m in messages), messages
