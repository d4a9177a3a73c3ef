"""verl_ds4.memory.terms: the logits step's bytes per token and the rollout's KV cache, checked
against what the functions' own parts allocate and against counts by hand (docstring derivations)."""

from __future__ import annotations

import pytest

from verl_ds4.memory import terms as mt

FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4]  # DS4-Flash's 43 layers (configs/ds4_model/flash.yaml)
V, H = 129_280, 4096


def test_unfused_logits_are_per_token_vocab_times_the_pass_bytes():
    assert mt.logits_step_bytes("actor", vocab=V, hidden=H).per_token == 14 * V
    assert mt.logits_step_bytes("actor", vocab=V, hidden=H, entropy=False).per_token == 8 * V
    assert mt.logits_step_bytes("sft", vocab=V, hidden=H, mtp_depths=1).per_token == 14 * V
    assert mt.logits_step_bytes("value", vocab=V, hidden=H).at(8192) == 0


def test_fused_and_chunked_are_bounded():
    full = mt.logits_step_bytes("actor", vocab=V, hidden=H)
    fused = mt.logits_step_bytes("actor", vocab=V, hidden=H, kind="fused")
    chunked = mt.logits_step_bytes("actor", vocab=V, hidden=H, kind="chunked")
    assert fused.per_token == 20 + 2 * 9504 and fused.fixed == 2 * V * H
    assert mt.logits_step_bytes("logprob", vocab=V, hidden=H, kind="fused").per_token == 20 + 12 * 127
    assert chunked.per_token == 16 and chunked.fixed <= 3 * 256 * 1024**2 + 4 * V * H
    # at 8k tokens a GPU: 13.8 GiB of logits buffers become ~1.2 GiB (mostly the fixed weight gradient)
    assert full.at(8192) / 2**30 == pytest.approx(13.8, abs=0.05)
    assert fused.at(8192) / 2**30 < 1.3 and full.at(8192) / fused.at(8192) > 10


def test_refusals():
    with pytest.raises(ValueError, match="MTP only on the non-fused path"):
        mt.logits_step_bytes("sft", vocab=V, hidden=H, kind="fused", mtp_depths=1)
    with pytest.raises(ValueError, match="pass 'update'"):
        mt.logits_step_bytes("update", vocab=V, hidden=H)
    with pytest.raises(ValueError, match="index_cache"):
        mt.rollout_kv_cache_bytes(FLASH_RATIOS, 1024, 1, index_cache="bf16")


def test_kv_cache_counts_by_hand():
    # one CSA layer, one sequence of 1,024 tokens: window + 256 compressed entries + 256 index keys + states
    one = mt.rollout_kv_cache_bytes([4], 1024, 1)
    assert one == 128 * 584 + 256 * 584 + 256 * 132 + (2 * 2 * 512 * 4 * 8) + (2 * 2 * 128 * 4 * 8)
    assert mt.rollout_kv_cache_bytes([4], 1000, 1) == one  # rounded up to vLLM's 256-token page
    assert mt.rollout_kv_cache_bytes([4], 1024, 3) == 3 * one
    # DS4-Flash, 16k tokens: the compressed cache grows ~linearly; ~165 KiB per sequence per 1k tokens
    grow = mt.rollout_kv_cache_bytes(FLASH_RATIOS, 32768, 1) - mt.rollout_kv_cache_bytes(FLASH_RATIOS, 16384, 1)
    assert grow == 16384 * (21 * (584 + 132) / 4 + 20 * 584 / 128)


def test_v41_counts_only_its_source_layers():
    ratios = [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]
    kv, idx = [2, 8, 14, 20], [2, 8, 14, 20, 24, 28, 32, 36]
    v41 = mt.rollout_kv_cache_bytes(ratios, 4096, 1, kv_source_layers=kv, index_source_layers=idx, index_cache="mxfp4")
    windows = 43 * 128 * 584
    compressed = 3 * 2048 * 584 + 4096 * 584  # layers 2, 8, 14 ratio 2; layer 20 ratio 1
    index = 3 * 2048 * 68 + 5 * 4096 * 68
    states = 3 * (2 * 512 * 4 * 2) + 2 * 512 * 4 + 3 * (2 * 128 * 4 * 2) + 5 * (2 * 128 * 4)
    assert v41 == windows + compressed + index + states
    # negative control: read as V4 (every compressed layer its own KV) it is several times larger
    assert mt.rollout_kv_cache_bytes(ratios, 4096, 1, index_cache="mxfp4") > 3 * v41 - 2 * windows
