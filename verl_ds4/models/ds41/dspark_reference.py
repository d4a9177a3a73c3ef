"""NeMo Automodel 0.7.0's DSpark training step as an fp64 CPU reference (tests and ``verl-ds4 verify``).

Called, never copied: NeMo's frozen-target wrapper (``speculative.dspark.target.HFDSparkTargetModel``:
the streams entering each ``dspark_target_layer_ids`` layer's attention mHC, averaged over the
streams, and the final-norm output), its V4.1 drafter (``DeepseekV41DSparkModel`` with the target's
embedding and LM head copied in, frozen) and its three-term loss (``DSparkTrainerModule``). NeMo
Automodel is imported only inside the functions. Beyond :func:`~.reference.fp64_reference`:

* the probability-distance term runs its chunks through ``torch.utils.checkpoint``; the recompute
  happens in backward, outside the float64 promotion, and would recompute in float32 (torch refuses
  the mismatch). Inside :func:`dspark_fp64_reference` the chunks are computed directly (a memory
  optimisation, not a numerical step);
* the anchors: NeMo draws them inside the drafter's forward from the global RNG; to drive both
  sides with the same blocks, :func:`nemo_dspark_step` hands the drafter given anchors (it replaces
  the drafter module's ``sample_anchor_positions`` for that call).
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch

from . import reference as ref

__all__ = ["dspark_fp64_reference", "nemo_target_features", "nemo_dspark_step"]

_LOSS = "nemo_automodel.components.speculative.dspark.loss"
_DRAFT = "nemo_automodel.components.models.deepseek_v41.dspark"


def _direct(function, *args, use_reentrant=None, preserve_rng_state=None, **kwargs):
    del use_reentrant, preserve_rng_state
    return function(*args, **kwargs)


@contextlib.contextmanager
def _patched(module_name: str, name: str, value):
    import importlib

    module = importlib.import_module(module_name)
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


@contextlib.contextmanager
def dspark_fp64_reference():
    """:func:`~.reference.fp64_reference` plus NeMo's DSpark loss without activation checkpointing."""
    with ref.fp64_reference(), _patched(_LOSS, "checkpoint", _direct):
        yield


def nemo_target_features(model, sequences: Sequence[torch.Tensor], layer_ids: Sequence[int]):
    """NeMo's target wrapper on its ``DeepseekV41ForCausalLM`` ``model``, one sequence per forward:
    ``(features [S_i, L * h], last [S_i, h])`` per sequence. Call inside :func:`dspark_fp64_reference`."""
    import logging

    from nemo_automodel.components.speculative.dspark.target import HFDSparkTargetModel

    logging.getLogger("nemo_automodel.components.speculative.dspark.common").setLevel(logging.ERROR)  # SGLang note
    wrapper = HFDSparkTargetModel(model, list(layer_ids))
    out = []
    for ids in sequences:
        ids = ids.view(1, -1)
        batch = wrapper.generate_batch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones_like(ids))
        out.append((batch.target_hidden_states[0], batch.target_last_hidden_states[0]))
    return [f for f, _ in out], [last for _, last in out]


def nemo_dspark_step(
    target,
    draft,
    sequences: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    anchors: Sequence[tuple[torch.Tensor, torch.Tensor]],
    pad_id: int,
    features: tuple[list, list] | None = None,
    **loss_settings: Any,
) -> dict[str, Any]:
    """NeMo's DSpark step on ``sequences`` (right-padded into one batch, loss mask 0 on padding) with
    the given anchors: ``{"loss", "ce", "l1", "confidence"}`` (floats) after ``loss.backward()`` (the
    drafter's ``.grad`` filled). ``target``: NeMo's causal LM (features captured by NeMo's wrapper
    unless ``features`` are given); ``loss_settings``: ``DSparkTrainerModule``'s keywords. Call inside
    :func:`dspark_fp64_reference`."""
    from nemo_automodel.components.speculative.dspark.core import DSparkTrainerModule

    if features is None:
        features = nemo_target_features(target, sequences, draft.config.dspark_target_layer_ids)
    width = max(int(s.numel()) for s in sequences)

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        extra = torch.full((width - t.shape[0], *t.shape[1:]), value, dtype=t.dtype)
        return torch.cat([t, extra])

    ids = torch.stack([pad(s.view(-1).long(), pad_id) for s in sequences])
    masks = torch.stack([pad(m.view(-1).to(torch.float64), 0.0) for m in loss_masks])
    feats = torch.stack([pad(f, 0.0) for f in features[0]])
    last = torch.stack([pad(x, 0.0) for x in features[1]])
    given = (torch.stack([a for a, _ in anchors]), torch.stack([k for _, k in anchors]))

    def sample_anchor_positions(*, seq_len, loss_mask, num_anchors, device, doc_remaining=None):
        if loss_mask.shape[0] != given[0].shape[0] or num_anchors != given[0].shape[1]:
            raise AssertionError("nemo_dspark_step: the given anchors do not fit the drafter's batch / num_anchors")
        return given[0].to(device), given[1].to(device)

    draft.initialize_embeddings_and_head(embed_tokens=target.get_input_embeddings(), lm_head=target.get_output_embeddings())
    trainer = DSparkTrainerModule(draft, **loss_settings)
    with _patched(_DRAFT, "sample_anchor_positions", sample_anchor_positions):
        metrics = trainer(input_ids=ids, target_hidden_states=feats, loss_mask=masks, target_last_hidden_states=last)
    metrics.loss.backward()
    return {"loss": float(metrics.loss), "ce": float(metrics.ce_loss), "l1": float(metrics.l1_loss),
            "confidence": float(metrics.confidence_loss)}  # fmt: skip
