"""A replay buffer whose batches come in the order the prompts were submitted, not the order they finished.

verl's v1 trainers read each step's batch from TransferQueue through a ``ReplayBuffer``. The built-in
sync buffer lists a step's trajectories in the order TransferQueue received them: the order in
which the rollout finished them, which changes from run to run (asyncio scheduling, which request
a batch of the rollout server finished first). The batch order reaches the trainer: it decides how
sequences are packed into THD micro-batches and split over CP ranks, and in which order per-token
terms are summed. So two runs of the same command on the same sampled tokens differ by float
rounding from step 1 on (measured: critic values and actor log-probs ~2e-7 relative at step 1,
before any update), and a resumed run cannot equal an uninterrupted one bit for bit.

:class:`OrderedReplayBuffer` is verl's sync ``ReplayBuffer`` with one change to the batch: the trajectories of a
batch are put in prompt-submission order (the dataloader's order, which is seeded), then by their
key's numeric parts (the response index within a prompt's group, ...). Everything else (selection,
eviction, metrics) is verl's. It plugs in through verl's extension point for samplers::

    trainer.v1.sampler.custom_sampler.path=pkg://verl_ds4.rollout.ordered_replay_buffer
    trainer.v1.sampler.custom_sampler.name=OrderedReplayBuffer

(the CPU PPO and GRPO recipes set it). verl passes a custom sampler none of its group-filtering settings
(DAPO's ``algorithm.filter_groups``): recipes that filter groups keep verl's own buffer.

Poll interval: while a step's responses are still being generated, verl's buffer looks at TransferQueue
every ``poll_interval`` seconds, 2 s by default, so a rollout that needs 0.3 s costs the step 2 s (the CPU
runs' ``timing_s/gen`` was 2.02 or 4.03 s on every step). This buffer reads its interval from verl's
``trainer.v1.sampler.sampler_kwargs`` (the kwargs verl reserves for custom samplers)::

    trainer.v1.sampler.sampler_kwargs.poll_interval_s=0.05   # default DEFAULT_POLL_INTERVAL_S

A poll is one metadata read from TransferQueue (a few ms), so a short interval costs little.
"""

from __future__ import annotations

from typing import Any, Mapping

from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

__all__ = ["DEFAULT_POLL_INTERVAL_S", "OrderedReplayBuffer", "submission_order"]

#: Seconds between two looks at TransferQueue while a batch is incomplete (verl's buffer: 2.0).
DEFAULT_POLL_INTERVAL_S = 0.05


def submission_order(trajectories: Mapping[str, Any], prompt_order: list[str]) -> dict[str, Any]:
    """``trajectories`` (``{"<uid>_<n>_...": tag}``) re-keyed in the order of ``prompt_order`` (prompt uids,
    as submitted), then by the numeric parts of each key; unknown uids last, by uid."""
    rank = {uid: i for i, uid in enumerate(prompt_order)}

    def order(key: str):
        uid, *rest = key.split("_")
        parts = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in rest)
        return (rank.get(uid, len(rank)), uid, parts)

    return {key: trajectories[key] for key in sorted(trajectories, key=order)}


class OrderedReplayBuffer(ReplayBuffer):
    """verl's sync replay buffer, batches in prompt-submission order (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        options = dict(self.sampler_kwargs or {})
        interval = options.pop("poll_interval_s", DEFAULT_POLL_INTERVAL_S)
        if options:
            raise ValueError(
                f"OrderedReplayBuffer: unknown trainer.v1.sampler.sampler_kwargs {sorted(options)}; it reads only "
                "poll_interval_s (seconds between two looks at TransferQueue while a batch is incomplete)."
            )
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 < interval <= 60:
            raise ValueError(
                f"trainer.v1.sampler.sampler_kwargs.poll_interval_s={interval!r}: expected seconds in (0, 60], "
                f"e.g. {DEFAULT_POLL_INTERVAL_S} (the default)."
            )
        self.poll_interval = float(interval)

    def _validate_mode_config(self) -> None:
        if self.trainer_mode != "sync":
            raise ValueError(
                f"OrderedReplayBuffer is verl's sync replay buffer; trainer.v1.trainer_mode={self.trainer_mode!r} "
                "is asynchronous. Remove trainer.v1.sampler.custom_sampler for async trainers."
            )
        super()._validate_mode_config()

    def _materialize_batch(self, partition_id: str, selected_prompt_uids: list[str], partition_snapshot: dict[str, dict]):
        # prompt_global_steps[partition] lists the prompt keys in TransferQueue's order: the order the
        # trainer submitted them in (one batch put per step, in the dataloader's order).
        prompt_order = list(self.prompt_global_steps[partition_id])
        return super()._materialize_batch(partition_id, selected_prompt_uids,
                                          submission_order(partition_snapshot, prompt_order))
