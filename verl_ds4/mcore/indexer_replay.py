"""Rollout indexer replay: the sparse attention's top-k choices made at rollout, replayed in training.

DS4's compressed sparse attention (CSA) and V4.1's CSA2 choose, per query row and per selecting layer,
the ``index_topk`` compressed blocks (V4.1: entries) the query attends to. A near-tie decided one way
at rollout and the other way in the actor's recompute is a different function, so with the switch on
(``actor_rollout_ref.actor.megatron.indexer_replay=true``) the rollout records its choices and the
actor's log-prob recompute and update take them instead of their own top-k (as router replay R3 does
for the MoE's experts).

**The field** (:data:`FIELD`, one per sample, like verl's ``routed_experts``): an integer tensor
``[seq_len, layers, index_topk]`` over the sample's whole sequence (prompt + response), ``layers`` the
model's *selecting* layers in decoder order (DS4: the CSA layers, ratio 4; V4.1: the layers with their
own indexer, Full and Reindex; a Reuse layer takes its source's choice and has no entry). Row ``t``
holds, ascending, the ids of the compressed blocks that query ``t`` attends to, counted from its own
sequence's first block (block ``b`` covers rows ``[b m, (b + 1) m)``; only ``b < (t + 1) // m`` is
reachable), padded with :data:`PAD` (-1) when fewer than ``index_topk`` are reachable. A row of
:data:`NOT_RECORDED` (-2) in a layer chooses natively (the rollout never ran that row, e.g. the last
token; the CP padding rows are packed so).

**The encoding** is ids, not a bitmap, by size (docs/rl-on-a-laptop.md, "Indexer replay"): ids cost
``index_topk * 4`` bytes per token per layer at any context; a bitmap over the sequence's compressed
blocks costs ``context / (8 m)`` bytes and passes the ids' size at 64k (V4.1, ratio 1) to 128k tokens
(DS4, ratio 4), and the models run to 1M.

**In training** the engine packs the micro-batch's field with the micro-batch's one THD plan (the same
plan as the input ids: under contiguous CP each rank gets the rows of its own queries, no second split)
and :func:`load` hands each selecting layer its ``[local_rows, index_topk]`` slice; the layer calls
:meth:`IndexerReplay.select` with its native choice and gets the replayed one. The indexer's scores,
and so DS4's indexer loss, are computed as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from typing import Any

import torch

__all__ = [
    "FIELD",
    "NOT_RECORDED",
    "PAD",
    "IndexerReplay",
    "IndexerReplayError",
    "clear",
    "enable",
    "ids_to_mask",
    "load",
    "mask_to_ids",
    "micro_batch_scope",
    "pending",
    "recorded",
    "selecting_layers",
    "set_pending",
]

logger = logging.getLogger(__name__)
_ANNOUNCED = False  # the first replaying forward of this process logs one line

FIELD = "indexer_topk"
SWITCH = "actor_rollout_ref.actor.megatron.indexer_replay"
PAD = -1
NOT_RECORDED = -2

_PENDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("verl_ds4_indexer_replay", default=None)


class IndexerReplayError(ValueError):
    """Replayed indexer choices that do not fit the model or the batch."""


def mask_to_ids(mask: torch.Tensor, width: int) -> torch.Tensor:
    """``[T, E]`` bool selection -> ``[T, width]`` int32 ids, ascending, padded with :data:`PAD`."""
    rows, entries = mask.shape
    index = torch.arange(entries, device=mask.device).expand(rows, entries)
    key = torch.where(mask, index, index + entries).sort(dim=1).values[:, :width]
    ids = torch.where(key < entries, key, PAD)
    if ids.shape[1] < width:
        ids = torch.cat((ids, ids.new_full((rows, width - ids.shape[1]), PAD)), dim=1)
    return ids.to(torch.int32)


def ids_to_mask(ids: torch.Tensor, entries: int) -> torch.Tensor:
    """``[T, k]`` ids (negative: none) -> ``[T, entries]`` bool (an id ``>= entries`` is dropped: callers check first)."""
    ids = ids.long()
    column = torch.where((ids >= 0) & (ids < entries), ids, entries)
    out = torch.zeros(ids.shape[0], entries + 1, dtype=torch.bool, device=ids.device)
    return out.scatter_(1, column, True)[:, :entries]


class IndexerReplay:
    """One selecting layer's replay state (attached as ``module.indexer_replay``).

    ``target``: ``[local_rows, width]`` ids to replay (rows whose first id is :data:`NOT_RECORDED` choose
    natively), or ``None``; ``record``: keep the layer's final choice in ``last`` (the rollout's record).
    """

    def __init__(self, label: str, width: int):
        self.label, self.width = label, int(width)
        self.target: torch.Tensor | None = None
        self.record = False
        self.last: torch.Tensor | None = None

    def select(self, native: torch.Tensor, reachable: torch.Tensor) -> torch.Tensor:
        """The layer's choice ``[T, E]`` (own-sequence entries) given its native one and what each row reaches."""
        chosen = native
        if self.target is not None:
            target = self.target
            if target.shape != (native.shape[0], self.width):
                raise IndexerReplayError(
                    f"{FIELD} for {self.label}: expected [{native.shape[0]} local rows, {self.width}] ids, found "
                    f"{list(target.shape)}."
                )
            replayed = target[:, 0] != NOT_RECORDED
            count = reachable.sum(dim=1)
            beyond = replayed & ((target.long() >= count.unsqueeze(1)).any(dim=1) | (target < NOT_RECORDED).any(dim=1))
            if bool(beyond.any()):
                row = int(beyond.nonzero()[0, 0])
                raise IndexerReplayError(
                    f"{FIELD} for {self.label}: local row {row} reaches {int(count[row])} compressed blocks (ids 0.."
                    f"{int(count[row]) - 1}), found ids {target[row].tolist()}: the choices belong to another sequence "
                    "or another model (the sequence's compressed length does not match)."
                )
            mask = ids_to_mask(target, native.shape[1])
            chosen = torch.where(replayed.unsqueeze(1), mask, native)
        if self.record:
            self.last = mask_to_ids(chosen & reachable, self.width)
        return chosen


def selecting_layers(model) -> list[tuple[str, Any]]:
    """``(name, module)`` of every selecting attention of ``model``'s decoder, in order (MTP layers excluded).

    A module takes part when it has ``indexer_replay_width`` (an ``int``: its ``index_topk``; ``None``:
    this layer does not select, e.g. a window-only, HCA or V4.1 Reuse layer)."""
    out = []
    for name, module in model.named_modules():
        if ".mtp." in f".{name}." or getattr(module, "indexer_replay_width", None) is None:
            continue
        out.append((name, module))
    return out


def enable(model, record: bool = False) -> list[IndexerReplay]:
    """Attach an :class:`IndexerReplay` to every selecting layer (idempotent); refuses a model without one."""
    layers = selecting_layers(model)
    if not layers:
        raise IndexerReplayError(
            f"indexer replay ({SWITCH}=true) needs a model whose sparse-attention indexer can replay (verl-ds4's DS4 "
            f"CSA layers, V4.1's Full / Reindex layers); {type(model).__name__} has none (no indexer, or an attention "
            f"without replay support such as Megatron-LM's DSv4HybridAttention). Set {SWITCH}=false."
        )
    replays = []
    for name, module in layers:
        replay = getattr(module, "indexer_replay", None)
        if replay is None:
            replay = IndexerReplay(name, module.indexer_replay_width)
            module.indexer_replay = replay
        replay.record = record
        replays.append(replay)
    return replays


def _replays(model) -> list[IndexerReplay]:
    replays = [getattr(m, "indexer_replay", None) for _, m in selecting_layers(model)]
    if not replays or any(r is None for r in replays):
        raise IndexerReplayError("indexer replay is not enabled on this model: call indexer_replay.enable(model) first.")  # error-catalogue: internal: the engine enables it at start-up
    return replays


def check_shape(ids: torch.Tensor, model, where: str = FIELD) -> None:
    """Refuse ids whose trailing shape is not ``[selecting layers, index_topk]`` of ``model``."""
    replays = _replays(model)
    width = max(r.width for r in replays)
    if ids.dim() < 2 or tuple(ids.shape[-2:]) != (len(replays), width):
        raise IndexerReplayError(
            f"{where}: expected [tokens, {len(replays)} selecting layers, {width} (index_topk)] ids for this model "
            f"({', '.join(r.label for r in replays[:3])}{', ...' if len(replays) > 3 else ''}), found "
            f"{list(ids.shape)}. The rollout recorded another model's layers, or another per-layer order."
        )


def load(model, rows: torch.Tensor | None) -> None:
    """Hand each selecting layer its slice of ``rows`` ``[local_rows, layers, width]`` (``None``: native)."""
    global _ANNOUNCED
    replays = _replays(model)
    if rows is not None:
        check_shape(rows, model)
        if not _ANNOUNCED:
            _ANNOUNCED = True
            logger.info("verl-ds4 indexer replay: replaying the rollout's choices, %s on this rank (%d selecting layers)",
                        list(rows.shape), len(replays))  # fmt: skip
    for i, replay in enumerate(replays):
        replay.target = None if rows is None else rows[:, i, : replay.width]


def recorded(model) -> torch.Tensor:
    """``[rows, layers, width]`` int32: the choices of the last forward (layers that recorded)."""
    replays = _replays(model)
    if any(r.last is None for r in replays):
        raise IndexerReplayError("no recorded indexer choices: run a forward with enable(model, record=True) first.")  # error-catalogue: internal: the rollout records before it reads
    width = max(r.width for r in replays)
    return torch.stack([torch.nn.functional.pad(r.last, (0, width - r.width), value=PAD) for r in replays], dim=1)


def clear(model) -> None:
    for replay in _replays(model):
        replay.target, replay.last = None, None


@contextlib.contextmanager
def micro_batch_scope():
    """A scope in which :func:`set_pending` names the micro-batch's field for the forward to pack."""
    token = _PENDING.set([])
    try:
        yield
    finally:
        _PENDING.reset(token)


def set_pending(ids: torch.Tensor | None) -> None:
    """The jagged ``[B, j, layers, width]`` field of the micro-batch in the open scope (``None``: none)."""
    holder = _PENDING.get()
    if holder is None:
        raise RuntimeError("set_pending outside micro_batch_scope()")  # error-catalogue: internal: the engine opens the scope
    holder[:] = [ids]


def pending() -> tuple[bool, torch.Tensor | None]:
    """``(replay on, field)`` for the forward running now: ``(False, None)`` outside a replaying scope."""
    holder = _PENDING.get()
    if not holder:
        return False, None
    return True, holder[0]


def refuse_missing_field() -> None:
    """The refusal of a replaying forward whose micro-batch carries no :data:`FIELD`."""
    raise IndexerReplayError(
        f"indexer replay is on ({SWITCH}=true), but this micro-batch has no {FIELD!r} field: the rollout engine "
        "(actor_rollout_ref.rollout.name) returned no indexer choices. Expected per sample an integer tensor "
        "[seq_len, selecting layers, index_topk] (docs/rl-on-a-laptop.md, 'Indexer replay'); verl-ds4's cpu_demo "
        f"rollout records it, vLLM and SGLang do not yet. Set {SWITCH}=false, or use a rollout that returns it."
    )


def refuse_critic() -> None:
    """The refusal of a value-head engine (the critic) configured to replay."""
    raise IndexerReplayError(
        "critic.megatron.indexer_replay=true: indexer replay is for the actor's log-prob recompute and update "
        f"({SWITCH}); the critic and the reference choose natively. Remove it from the critic's config."
    )
