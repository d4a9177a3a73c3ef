"""verl's micro-batch iterator inside the DS4 engines' ``forward_step``: each micro-batch a dynamic-CP scheduler
built brings its plan into the open plan scope, and with indexer replay its recorded top-k field is handed to
the forward (:mod:`verl_ds4.mcore.batch_plans`, :mod:`verl_ds4.mcore.indexer_replay`)."""

from __future__ import annotations

from verl_ds4.mcore import batch_plans, indexer_replay

__all__ = ["SeedingIterator"]


class SeedingIterator:
    """Yields verl's micro-batches, adding a scheduled micro-batch's plan to the open plan scope."""

    def __init__(self, batches, indexer_replay_on: bool = False):
        self._batches = iter(batches)
        self._replay = indexer_replay_on
        self.last = None  # the micro-batch handed out last (the straggler metrics key it)

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._batches)
        self.last = batch
        from verl.utils import tensordict_utils as tu

        try:
            batch_plans.seed_plan(tu.get_non_tensor_data(batch, key=batch_plans.PLAN_KEY, default=None))
        except (AttributeError, KeyError, TypeError):  # not a TensorDict: nothing was scheduled
            pass
        if self._replay:  # the forward packs it with the micro-batch's plan (model_forward.load_indexer_replay)
            indexer_replay.set_pending(batch.get(indexer_replay.FIELD, None))
        return batch
