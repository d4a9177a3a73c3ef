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
    "check_reach",
    "clear",
    "enable",
    "forget_targets",
    "fill_rows",
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

    def __init__(self, label: str, width: int, ratio: int | None = None):
        self.label, self.width = label, int(width)
        self.ratio = None if ratio is None else int(ratio)  # compress ratio m: row t reaches blocks 0..(t + 1) // m - 1
        self.target: torch.Tensor | None = None
        self.record = False
        self.last: torch.Tensor | None = None

    def select(self, native: torch.Tensor, reachable: torch.Tensor, start: int = 0, total: int | None = None) -> torch.Tensor:
        """The layer's choice ``[c, E]`` (own-sequence entries) given its native one and what each row reaches, for
        local rows ``start..start + c`` of ``total`` (default: all rows at once; a layer that chooses in row chunks
        calls it chunk by chunk in order, and the record is the chunks' records in order)."""
        chosen = native
        rows = native.shape[0]
        total = rows if total is None else int(total)
        if self.target is not None:
            if self.target.shape != (total, self.width):
                raise IndexerReplayError(
                    f"{FIELD} for {self.label}: expected [{total} local rows, {self.width}] ids, found "
                    f"{list(self.target.shape)}."
                )
            target = self.target[start : start + rows]
            replayed = target[:, 0] != NOT_RECORDED
            count = reachable.sum(dim=1)
            beyond = replayed & ((target.long() >= count.unsqueeze(1)).any(dim=1) | (target < NOT_RECORDED).any(dim=1))
            if bool(beyond.any()):  # (load_indexer_replay checked the whole field on every rank already)
                row = int(beyond.nonzero()[0, 0])
                _refuse_beyond(self.label, f"local row {start + row}", int(count[row]), target[row].tolist())
            mask = ids_to_mask(target, native.shape[1])
            chosen = torch.where(replayed.unsqueeze(1), mask, native)
        if self.record:
            ids = mask_to_ids(chosen & reachable, self.width)
            self.last = ids if start == 0 or self.last is None else torch.cat((self.last, ids))
        return chosen


def _refuse_beyond(label: str, where: str, count: int, ids: list[int]) -> None:
    raise IndexerReplayError(
        f"{FIELD} for {label}: {where} reaches {count} compressed blocks (ids 0..{count - 1}), found ids {ids}: the "
        "choices belong to another sequence or another model (the sequence's compressed length does not match)."
    )


def _compress_ratio(module) -> int | None:
    """A selecting layer's compress ratio (DS4: ``spec.compress_ratio``; V4.1: ``role.ratio``), else ``None``."""
    for owner, name in (("spec", "compress_ratio"), ("role", "ratio")):
        value = getattr(getattr(module, owner, None), name, None)
        if value is not None and int(value) > 0:
            return int(value)
    return None


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
            replay = IndexerReplay(name, module.indexer_replay_width, _compress_ratio(module))
            module.indexer_replay = replay
        replay.record = record
        replays.append(replay)
    return replays


def _replays(model) -> list[IndexerReplay]:
    replays = [getattr(m, "indexer_replay", None) for _, m in selecting_layers(model)]
    if not replays or any(r is None for r in replays):
        raise IndexerReplayError("indexer replay is not enabled on this model: call indexer_replay.enable(model) first.")  # error-catalogue: internal: the engine enables it at start-up
    return replays


def check_reach(ids: torch.Tensor, offsets: torch.Tensor, model) -> None:
    """Refuse a field ``[tokens, layers, width]`` (all sequences of the micro-batch, ``offsets`` ``[B + 1]``)
    with an id past its row's compressed length in some layer.

    Run on the whole field, before the forward: every CP rank holds the same field and so refuses together
    (a refusal raised by one rank's layer, on its own rows only, would leave the other ranks waiting in the
    halo exchange)."""
    replays = _replays(model)
    ids = ids.to(torch.long)
    lengths = (offsets[1:] - offsets[:-1]).to(device=ids.device, dtype=torch.long)
    starts = offsets[:-1].to(device=ids.device, dtype=torch.long)
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=ids.device), lengths)
    position = torch.arange(ids.shape[0], device=ids.device) - starts[seq]
    bad = torch.zeros(ids.shape[0], len(replays), dtype=torch.bool, device=ids.device)
    for i, replay in enumerate(replays):
        if replay.ratio is None:
            raise IndexerReplayError(  # error-catalogue: internal: the layers verl-ds4 builds all carry their ratio
                f"{replay.label}: its compress ratio is unknown, so its replayed {FIELD} ids cannot be checked before "
                "the forward; expected a module with spec.compress_ratio (DS4) or role.ratio (V4.1)."
            )
        layer = ids[:, i, : replay.width]
        count = ((position + 1) // replay.ratio).unsqueeze(1)
        replayed = layer[:, 0] != NOT_RECORDED
        bad[:, i] = replayed & ((layer >= count) | (layer < NOT_RECORDED)).any(dim=1)
    if bool(bad.any()):  # one host read for the whole field
        row, i = (int(v) for v in bad.nonzero()[0])
        s, t = int(seq[row]), int(position[row])
        count = (t + 1) // replays[i].ratio
        _refuse_beyond(replays[i].label, f"sequence {s} row {t}", count, ids[row, i, : replays[i].width].tolist())


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


def forget_targets(model) -> None:
    """Drop every selecting layer's replay target (the next forward chooses natively); a model without
    replay attached is left as it is. The engine forward calls it for every forward outside a replaying
    micro-batch, so a target never outlives the micro-batch it was packed for. (Not at the scope's end:
    an activation recompute in that micro-batch's backward runs the forward again and needs it.)"""
    for _, module in selecting_layers(model):
        replay = getattr(module, "indexer_replay", None)
        if replay is not None:
            replay.target = None


def clear(model) -> None:
    """Drop the targets and the record, and stop recording (the rollout, after reading its record)."""
    for replay in _replays(model):
        replay.target, replay.last, replay.record = None, None, False


def fill_rows(rows: torch.Tensor | None, length: int, trailing: tuple[int, int] | None = None) -> torch.Tensor:
    """One sequence's field ``[length, layers, width]`` int32: the recorded ``rows`` (those past ``length``
    dropped), then :data:`NOT_RECORDED` for the rows nobody recorded (never run, e.g. the last token; all of
    them when ``rows`` is ``None``). ``trailing``: the ``(layers, width)`` expected (``None``: ``rows``')."""
    if rows is None:
        if trailing is None:
            raise ValueError("fill_rows: without rows, pass trailing=(layers, width).")  # error-catalogue: internal: a caller's argument
        return torch.full((length, *trailing), NOT_RECORDED, dtype=torch.int32)
    kept = torch.as_tensor(rows)[:length].to(torch.int32)
    if kept.dim() != 3 or (trailing is not None and tuple(kept.shape[1:]) != tuple(trailing)):
        raise ValueError(  # error-catalogue: internal: the rollout's own record of earlier steps
            f"{FIELD} rows: expected [rows, {', '.join(map(str, trailing)) if trailing else 'layers, width'}], found "
            f"{list(kept.shape)}; pass the choices recorded for this sequence by this model."
        )
    out = kept.new_full((length, *kept.shape[1:]), NOT_RECORDED)
    out[: kept.shape[0]] = kept
    return out


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
