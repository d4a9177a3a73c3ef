"""The rollout/actor mismatch gate: every PPO step, the rollout's log-probs against the actor's recompute.

With the ``cpu_demo`` rollout (fp32, the actor's weights synced every step) the log-probs the rollout
returns for the tokens it sampled (``rollout_log_probs``, verl's field) and the log-probs the actor
recomputes for the same tokens at context parallel size 2 (``old_log_probs``) must agree to float
rounding. The gate reports, per step:

* ``training/rollout_log_probs_diff_max``: max |old_log_probs - rollout_log_probs| over the response
  tokens (verl-ds4's name: verl's ``training/rollout_probs_diff_max`` is the same figure on
  probabilities, ``exp(log p)``; verl reports that one itself);
* ``rollout_corr/k3_kl``: the mean k3 KL estimator, computed by verl's own
  ``compute_offpolicy_metrics`` (verl reports it under that name when ``algorithm.rollout_correction``
  is set; the gate computes it even when it is not);
* ``training/rollout_log_probs_diff_above``: how many response tokens differ by more than the threshold,
  of ``training/rollout_log_probs_tokens``. A layout or weight-sync bug moves most tokens; one or a few
  are the signature of a discrete choice (an indexer's or a router's top-k with two nearly equal scores)
  that float rounding resolved differently in the rollout's packing and the actor's CP recompute.

:class:`GatedPPOTrainerSync` (``trainer.v1.trainer_mode=ds4_gated_sync``) is verl's synchronous v1
trainer plus the gate after the actor's old-log-prob recompute; with
``trainer.v1.ds4_gated_sync.max_log_prob_diff`` set, a step whose max difference exceeds it stops the
run with :class:`MismatchGateError` naming the step, the figure and the knob (``null`` reports only).
``max_tokens_above`` (default 0) tolerates that many response tokens above the threshold per step, each
still at most ``tolerated_max_diff`` (default 1e-3): the allowance for top-k near-ties (see above), which a
sync or layout bug, moving many tokens or one token by far more, does not fit.
Importing this module registers the trainer mode; the CPU launcher loads it in every process
(``VERL_USE_EXTERNAL_MODULES``), the trainer's included.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

logger = logging.getLogger(__name__)

TRAINER_MODE = "ds4_gated_sync"
KNOB = f"trainer.v1.{TRAINER_MODE}.max_log_prob_diff"
TOKENS_KNOB = f"trainer.v1.{TRAINER_MODE}.max_tokens_above"
TOLERATED_KNOB = f"trainer.v1.{TRAINER_MODE}.tolerated_max_diff"
MAX_DIFF_METRIC = "training/rollout_log_probs_diff_max"
K3_METRIC = "rollout_corr/k3_kl"
ABOVE_METRIC = "training/rollout_log_probs_diff_above"
TOKENS_METRIC = "training/rollout_log_probs_tokens"
GATE_MARK = "verl-ds4 mismatch gate"

__all__ = [
    "ABOVE_METRIC",
    "GATE_MARK",
    "K3_METRIC",
    "KNOB",
    "MAX_DIFF_METRIC",
    "TOKENS_KNOB",
    "TOKENS_METRIC",
    "TOLERATED_KNOB",
    "TRAINER_MODE",
    "MismatchGateError",
    "check_mismatch",
    "gate_threshold",
    "gate_tolerance",
    "mismatch_metrics",
    "GatedPPOTrainerSync",
    "register",
]


class MismatchGateError(RuntimeError):
    """The rollout's log-probs and the actor's recompute disagree by more than the configured threshold."""


def mismatch_metrics(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
    threshold: float | None = None,
) -> dict[str, float]:
    """The gate's figures on ``[batch, response]`` tensors (``response_mask``: 1 on the sampled tokens); with a
    ``threshold``, also how many tokens exceed it, of how many."""
    from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics

    if old_log_probs.shape != rollout_log_probs.shape or old_log_probs.shape != response_mask.shape:
        raise ValueError(  # error-catalogue: internal: verl's batch is inconsistent
            f"mismatch gate: old_log_probs {tuple(old_log_probs.shape)}, rollout_log_probs "
            f"{tuple(rollout_log_probs.shape)} and response_mask {tuple(response_mask.shape)} must have one shape."
        )
    mask = response_mask.bool()
    if not mask.any():
        raise ValueError("mismatch gate: the response mask selects no token; there is nothing to compare.")  # error-catalogue: internal: verl's batch is inconsistent
    old, rollout = old_log_probs.double(), rollout_log_probs.double()
    diff = (old - rollout).abs()[mask]
    k3 = compute_offpolicy_metrics(old_log_prob=old, rollout_log_prob=rollout, response_mask=mask.double())["k3_kl"]
    figures = {MAX_DIFF_METRIC: float(diff.max()), K3_METRIC: float(k3)}
    if threshold is not None:
        figures[ABOVE_METRIC] = int(((diff > threshold) | ~diff.isfinite()).sum())
        figures[TOKENS_METRIC] = int(diff.numel())
    return figures


def check_mismatch(
    metrics: dict[str, float], step: int, threshold: float | None, max_tokens_above: int = 0,
    tolerated_max_diff: float = 1e-3,
) -> None:
    """Raise :class:`MismatchGateError` when the step's max difference exceeds ``threshold`` (``None``: never) on
    more than ``max_tokens_above`` response tokens, or exceeds ``tolerated_max_diff`` on any (only with
    ``max_tokens_above`` > 0, which needs the token count in ``metrics``)."""
    value = metrics[MAX_DIFF_METRIC]
    if threshold is None:
        return
    tolerated = (
        max_tokens_above > 0 and math.isfinite(value) and value <= tolerated_max_diff
        and metrics.get(ABOVE_METRIC, max_tokens_above + 1) <= max_tokens_above
    )
    if value > threshold and tolerated:
        logger.warning("%s: step %s: %s of %s response tokens above %.3e (at most %.3e), tolerated (%s: %s)", GATE_MARK,
                       step, metrics.get(ABOVE_METRIC), metrics.get(TOKENS_METRIC), threshold, value, TOKENS_KNOB,
                       max_tokens_above)
        return
    if not math.isfinite(value) or value > threshold:
        above, tokens = metrics.get(ABOVE_METRIC), metrics.get(TOKENS_METRIC)
        count = f"; {above} of {tokens} response tokens above it" if above is not None and tokens is not None else ""
        raise MismatchGateError(
            f"{GATE_MARK}: step {step}: the rollout's log-probs and the actor's recomputed log-probs of the same "
            f"sampled tokens differ by up to {value:.3e} ({MAX_DIFF_METRIC}; mean k3 KL {metrics.get(K3_METRIC, float('nan')):.3e}), "
            f"above the threshold {threshold:.3e} ({KNOB}{count}). Expected: the rollout samples with the actor's current "
            "weights (synced every step) in fp32, so the two agree to float rounding. Check that the weight sync ran "
            "this step and that rollout and actor build the same model and dtype (most tokens off); one or a few tokens "
            "off is a top-k choice (indexer or router) between nearly equal scores that rounding decided differently. "
            f"Raise the knob (or set it to null to report only) if a larger gap is expected; {TOKENS_KNOB} "
            f"(now {max_tokens_above}) tolerates that many tokens a step up to {TOLERATED_KNOB} "
            f"(now {tolerated_max_diff:.1e})."
        )


def gate_threshold(config) -> float | None:
    """The configured threshold (``None``: report only); a clear error for anything but a positive number or null."""
    section = (config.get("trainer", {}) or {}).get("v1", {}) or {}
    settings = section.get(TRAINER_MODE, None) or {}
    if "max_log_prob_diff" not in settings:
        raise ValueError(
            f"trainer.v1.trainer_mode={TRAINER_MODE} needs {KNOB} (a positive float, or null to report the "
            "mismatch without stopping); the recipe recipes/recipe/ds4_proxy_ppo_cpu.yaml sets it."
        )
    value = settings.get("max_log_prob_diff")
    if value is None:
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{KNOB} must be a positive float or null, got {settings.get('max_log_prob_diff')!r}.")
    return value


def gate_tolerance(config) -> tuple[int, float]:
    """``(max_tokens_above, tolerated_max_diff)`` from the config (defaults 0 and 1e-3), checked: a
    non-negative integer and a positive float at least the threshold."""
    section = (config.get("trainer", {}) or {}).get("v1", {}) or {}
    settings = section.get(TRAINER_MODE, None) or {}
    tokens, tolerated = settings.get("max_tokens_above", 0), settings.get("tolerated_max_diff", 1e-3)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"{TOKENS_KNOB} must be an integer >= 0 (0: every token above {KNOB} stops the run), got {tokens!r}.")
    try:
        tolerated = float(tolerated)
    except (TypeError, ValueError):
        tolerated = float("nan")
    threshold = gate_threshold(config)
    if not (math.isfinite(tolerated) and tolerated > 0) or (threshold is not None and tolerated < threshold):
        raise ValueError(f"{TOLERATED_KNOB} must be a positive float >= {KNOB} ({threshold}), got "
                         f"{settings.get('tolerated_max_diff')!r}.")
    return int(tokens), tolerated


def _gated_trainer_class():
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    class GatedPPOTrainerSync(PPOTrainerSync):
        """verl's synchronous v1 trainer plus the mismatch gate after the old-log-prob recompute.

        verl's trainer base reads ``self.trainer_mode`` (set from ``trainer.v1.trainer_mode``, here the
        registry key ``ds4_gated_sync``) to choose between its sync and async behaviour: every mode but
        ``"sync"`` gets the async replay buffer, single-prompt dataloader fetches (``data.gen_batch_size``
        forced to 1), persisted prompt data and TransferQueue checkpoints. This trainer is the sync one,
        so it reports ``"sync"`` there; the registry key stays ``ds4_gated_sync`` (and its config section,
        ``trainer.v1.ds4_gated_sync``, holds the gate's knob)."""

        @property
        def trainer_mode(self) -> str:
            return "sync"

        @trainer_mode.setter
        def trainer_mode(self, value: str) -> None:
            if value not in (TRAINER_MODE, "sync"):
                raise ValueError(f"GatedPPOTrainerSync runs trainer.v1.trainer_mode={TRAINER_MODE!r}, got {value!r}.")  # error-catalogue: internal: the trainer class and its mode disagree

        def __init__(self, config, *args: Any, **kwargs: Any):
            self.mismatch_threshold = gate_threshold(config)
            self.mismatch_tolerance = gate_tolerance(config)
            if not config.actor_rollout_ref.rollout.get("calculate_log_probs", False):
                raise ValueError(
                    f"trainer.v1.trainer_mode={TRAINER_MODE} compares the rollout's log-probs with the actor's: set "
                    "actor_rollout_ref.rollout.calculate_log_probs=True (verl's default)."
                )
            custom = (config.trainer.v1.get("sampler") or {}).get("custom_sampler") or {}
            filter_groups = config.get("algorithm", {}).get("filter_groups") or {}
            if custom.get("name") and filter_groups.get("enable", False):
                raise ValueError(
                    f"algorithm.filter_groups.enable=true with trainer.v1.sampler.custom_sampler.name={custom.get('name')!r}: "
                    "verl gives a custom sampler none of the group-filtering settings, so the groups would not be "
                    "filtered. Drop trainer.v1.sampler.custom_sampler (verl's own buffer filters) or the filtering."
                )
            super().__init__(config, *args, **kwargs)

        def _compute_old_log_prob(self, batch, metrics: dict):
            import transfer_queue as tq
            from verl.protocol import DataProto

            batch = super()._compute_old_log_prob(batch, metrics=metrics)
            fields = ["old_log_probs", "rollout_log_probs", "response_mask"]
            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
            data = DataProto(batch=data.to_padded_tensor())
            figures = mismatch_metrics(
                data.batch["old_log_probs"], data.batch["rollout_log_probs"], data.batch["response_mask"],
                self.mismatch_threshold,
            )
            metrics.update(figures)
            logger.warning(
                "%s: step %s: %s=%.3e %s=%.3e (threshold %s)", GATE_MARK, self.global_steps, MAX_DIFF_METRIC,
                figures[MAX_DIFF_METRIC], K3_METRIC, figures[K3_METRIC], self.mismatch_threshold,
            )
            check_mismatch(figures, self.global_steps, self.mismatch_threshold, *self.mismatch_tolerance)
            return batch

    GatedPPOTrainerSync.__module__ = __name__
    GatedPPOTrainerSync.__qualname__ = "GatedPPOTrainerSync"
    return GatedPPOTrainerSync


def register() -> type:
    """Register ``trainer.v1.trainer_mode=ds4_gated_sync`` with verl (idempotent); returns the class."""
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer

    existing = TRAINER_REGISTRY.get(TRAINER_MODE)
    if existing is not None and getattr(existing, "__module__", None) == __name__:
        return existing
    return register_trainer(TRAINER_MODE)(_gated_trainer_class())


# Importing this module registers the trainer mode (the CPU launcher lists it in VERL_USE_EXTERNAL_MODULES).
GatedPPOTrainerSync = register()
