"""The V4.1 DSpark drafter (``verl_ds4.models.ds41.dspark``) against NeMo Automodel 0.7.0 at fp64.

* our draft positions and visibility equal the reference's (``build_position_ids`` /
  ``build_attention_mask``) for anchors near the start (a window cut short) and a dropped block;
* the 3 stages with the same weights and inputs (noise rows, the backbone's target features,
  previous tokens): normed states, Markov transition logits and confidence logits <= 1e-10 relative,
  and the draft logits ``output_layer(normed) + transition`` too; negative control: the context
  window of a kept block hidden changes the drafts;
* a config without DSpark is refused.
"""

from __future__ import annotations

import pytest
import torch

from verl_ds4.models.ds41.dspark import DS41DSpark, draft_positions, draft_visibility
from verl_ds4.testing import ds41_reference as ref

pytestmark = pytest.mark.skipif(ref.reference_missing() is not None, reason=str(ref.reference_missing()))

TEXT = ref.tiny_text_config()
C, BLOCK = 16, TEXT["dspark_block_size"]
ANCHORS = torch.tensor([1, 6, 11, 3])
KEEP = torch.tensor([True, True, True, False])


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def pair():
    with ref.fp64_reference():
        theirs = ref.build_reference_dspark(TEXT)
    ours = DS41DSpark(TEXT, dtype=torch.float64)
    ref.load_tensors(ours, ref.dspark_reference_tensors(ours, theirs))
    return ours, theirs


def inputs():
    g = torch.Generator().manual_seed(21)
    noise = torch.randn(len(ANCHORS) * BLOCK, TEXT["hidden_size"], dtype=torch.float64, generator=g)
    features = torch.randn(C, 3 * TEXT["hidden_size"], dtype=torch.float64, generator=g)
    previous = torch.randint(0, TEXT["vocab_size"], (len(ANCHORS) * BLOCK,), generator=g)
    return noise, features, previous


def test_positions_and_visibility_equal_the_reference(pair):
    _, theirs = pair
    positions = theirs.build_position_ids(ANCHORS.view(1, -1), C)[0]
    mask = theirs.build_attention_mask(ANCHORS.view(1, -1), KEEP.view(1, -1), C, torch.float64)[0, 0]
    assert torch.equal(draft_positions(ANCHORS, C, BLOCK), positions)
    visible = draft_visibility(ANCHORS, KEEP, C, BLOCK, TEXT["sliding_window"])
    assert torch.equal(visible, mask == 0)
    assert not visible[-BLOCK:, :C].any() and visible[:BLOCK, :C].sum() == BLOCK  # dropped block; anchor 1: one row each


def test_stages_and_heads_equal_the_reference(pair):
    ours, theirs = pair
    noise, features, previous = inputs()
    positions = draft_positions(ANCHORS, C, BLOCK)
    visible = draft_visibility(ANCHORS, KEEP, C, BLOCK, TEXT["sliding_window"])
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkBackbone

    mask = torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, float("-inf"))
    with ref.fp64_reference(), torch.no_grad():
        expected = DeepseekV41DSparkBackbone.forward(
            theirs, noise.unsqueeze(0), features.unsqueeze(0), position_ids=positions.unsqueeze(0),
            attention_mask=mask.view(1, 1, *mask.shape), previous_token_ids=previous.unsqueeze(0),
        )  # fmt: skip
        head = torch.randn(TEXT["vocab_size"], TEXT["hidden_size"], dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        theirs.lm_head.weight.copy_(head)
        their_logits = theirs.compute_logits(expected.normalized_hidden_states)[0] + expected.transition_logits[0]
    with torch.no_grad():
        normed, transition, confidence = ours(noise, features, positions, visible, previous)
        logits = normed @ head.T + transition
    errors = {
        "normed": rel(normed, expected.normalized_hidden_states[0]),
        "transition": rel(transition, expected.transition_logits[0]),
        "confidence": rel(confidence, expected.confidence_pred[0]),
        "draft logits": rel(logits, their_logits),
    }
    print("DSpark vs NeMo Automodel (fp64):", ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) <= 1e-10
    hidden = visible.clone()
    hidden[:BLOCK * 3, :C] = False  # negative control: the kept blocks lose their context window
    with torch.no_grad():
        assert rel(ours(noise, features, positions, hidden, previous)[0], expected.normalized_hidden_states[0]) > 1e-3


def test_config_without_dspark_is_refused():
    with pytest.raises(ValueError, match="no DSpark drafter"):
        DS41DSpark(dict(TEXT, num_nextn_predict_layers=0), dtype=torch.float64)
