"""Our Megatron DS4 on an HF DeepSeek-V4 folder: per-sequence logits at any CP size (the public check).

    from verl_ds4.models.ds4 import hf_logits
    logits = hf_logits("path/to/ds4", [ids_a, ids_b], cp=4)    # [L_i, vocab] each, input order

:func:`hf_logits` loads the folder into :class:`verl_ds4.models.ds4.model.DS4Model`
(:mod:`verl_ds4.models.ds4.hf_checkpoint`), packs the sequences THD with the contiguous CP layout
(:mod:`verl_ds4.mcore.thd`: one plan, the model's ``min_local_rows``), runs the model on ``cp``
ranks (real gloo processes when ``cp > 1``, :func:`verl_ds4.mcore.distributed.run_distributed`) and
gathers the logits in rank order. :func:`packed_logits` is the per-rank step, also used by the
fidelity tests with in-memory models.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["ModelRefused", "hf_logits", "packed_logits", "pack_sequences", "run_on_cp_ranks", "min_local_rows_of"]


class ModelRefused(ValueError):
    """The ``ValueError`` a rank's ``build`` raised (a folder or config refused, the same on every rank), raised
    again in the caller of :func:`run_on_cp_ranks` with its message, not as a rank's traceback."""


_REFUSED = "verl-ds4: build refused"


def min_local_rows_of(model) -> int:
    """The largest D_window over the model's DS4 attention layers (rows every CP rank must hold): the
    model config's ``min_local_rows``, else the rule of a ``dsv4_hybrid`` config (Megatron-LM dev's DS4), else the
    largest ``min_local_rows`` its attention modules declare (the layout protocol the resolver reads)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "min_local_rows", None) is not None:
        return int(config.min_local_rows)
    from verl_ds4.mcore.resolver import ds4_config_min_local_rows

    if config is not None and (rows := ds4_config_min_local_rows(config)) is not None:
        return rows  # Megatron-LM dev's DS4 (the production model): its config says it
    declared = [
        int(m.min_local_rows)
        for m in model.modules()
        if getattr(m, "required_cp_partition_mode", None) is not None and getattr(m, "min_local_rows", None)
    ]
    if not declared:
        raise ValueError(f"{type(model).__name__} declares no min_local_rows: expected a DS4 model (DS4 attention layers).")
    return max(declared)


def pack_sequences(model, sequences: Sequence[torch.Tensor], cp_rank: int = 0, cp_size: int = 1):
    """``(nested, plan, params, ids)``: ``sequences`` packed by verl-ds4's THD plan with the contiguous layout
    and ``model``'s ``min_local_rows``, and rank ``cp_rank``'s ids ``[1, rows]`` with their ``PackedSeqParams``."""
    from verl_ds4.layout import PlanOptions
    from verl_ds4.mcore.thd import make_plan, pack_input, packed_seq_params_for

    lengths = [int(s.numel()) for s in sequences]
    offsets = torch.tensor([0, *lengths], device=sequences[0].device).cumsum(0)  # on the ids' device (CUDA too)
    nested = torch.nested.nested_tensor_from_jagged(torch.cat([s.view(-1).long() for s in sequences]), offsets=offsets)
    plan = make_plan(nested, PlanOptions(layout="contiguous", cp_size=cp_size, min_local_rows=min_local_rows_of(model)))
    params = packed_seq_params_for(plan, layout_consumer_checked=True)
    ids, _ = pack_input(nested, plan, cp_rank)
    return nested, plan, params, ids


def packed_logits(
    model,
    sequences: Sequence[torch.Tensor],
    cp_rank: int = 0,
    cp_size: int = 1,
    hash_ids_shift: int = 0,
) -> list[torch.Tensor]:
    """This rank's share of one packed forward, gathered: per-sequence logits ``[L_i, vocab]``.

    ``hash_ids_shift`` (a negative control only) hands the hash layers this rank's packed ids
    rolled by that many rows, i.e. ids packed with a wrong plan.
    """
    from verl_ds4.mcore.thd import postprocess_thd_engine

    nested, _, params, ids = pack_sequences(model, sequences, cp_rank, cp_size)
    hash_ids = torch.roll(ids, hash_ids_shift, dims=1) if hash_ids_shift else None
    with torch.no_grad():
        logits = model(ids, None, None, packed_seq_params=params, hash_token_ids=hash_ids)
        jagged = postprocess_thd_engine(logits, params, nested, len(sequences), cp_layout="contiguous")
    return list(jagged.unbind())


def _rank_main(rank: int, world: int, build: Callable, sequences, hash_ids_shift: int):
    import logging

    from megatron.core import parallel_state

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    try:
        try:
            model = build(world)
        except ValueError as e:  # every rank builds the same folder: each refuses it, none waits in a collective
            return (_REFUSED, str(e))
        out = packed_logits(model, sequences, parallel_state.get_context_parallel_rank(), world, hash_ids_shift)
        return [t.tolist() for t in out] if rank == 0 else None
    finally:
        parallel_state.destroy_model_parallel()


def run_on_cp_ranks(build: Callable[[int], torch.nn.Module], sequences, cp: int, dtype=torch.float64, hash_ids_shift: int = 0, timeout: float = 300.0):
    """``build(cp_size) -> model`` on every one of ``cp`` gloo ranks, one packed forward, rank 0's
    gathered per-sequence logits (in ``dtype``). ``cp = 1`` also runs in a child process (a fresh
    Megatron parallel state). A ``ValueError`` of ``build`` (a refused folder) is raised here as
    :class:`ModelRefused` with its message."""
    from verl_ds4.mcore.distributed import run_distributed

    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}.")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise RuntimeError(
            "run_on_cp_ranks / hf_logits fork fresh gloo ranks and must be called from a process that has not "
            "initialised torch.distributed (a fork after gloo started can hang). Call it from a plain process."
        )
    results = run_distributed(_rank_main, world_size=cp, args=(build, list(sequences), hash_ids_shift), timeout=timeout)
    refused = next((r[1] for r in results if isinstance(r, tuple) and r[:1] == (_REFUSED,)), None)
    if refused is not None:
        raise ModelRefused(refused)  # error-catalogue: passes on a message catalogued where it is built
    return [torch.tensor(rows, dtype=dtype) for rows in results[0]]


class _FolderBuilder:
    def __init__(self, folder, dtype, allow_mtp_skip):
        self.folder, self.dtype, self.allow_mtp_skip = folder, dtype, allow_mtp_skip

    def __call__(self, cp_size: int):
        from verl_ds4.models.ds4.hf_checkpoint import load_hf_checkpoint

        model, _ = load_hf_checkpoint(self.folder, dtype=self.dtype, allow_mtp_skip=self.allow_mtp_skip, cp_size=cp_size)
        return model.eval()


def hf_logits(checkpoint_dir, sequences: Sequence[torch.Tensor], cp: int = 1, dtype: torch.dtype = torch.float64, *, allow_mtp_skip: bool = False, timeout: float = 300.0) -> list[torch.Tensor]:
    """Per-sequence logits ``[L_i, vocab]`` (input order) of our Megatron DS4 loaded from ``checkpoint_dir``,
    run with context parallelism ``cp`` on gloo ranks. ``sequences``: 1-D integer token-id tensors."""
    from verl_ds4.models.ds4.hf_checkpoint import read_config

    read_config(checkpoint_dir)  # fail here, not on every rank, for a folder that is not DS4
    seqs = [torch.as_tensor(s).view(-1).long() for s in sequences]
    if not seqs or any(s.numel() == 0 for s in seqs):
        raise ValueError("hf_logits needs at least one sequence and no empty sequence.")
    return run_on_cp_ranks(_FolderBuilder(str(checkpoint_dir), dtype, allow_mtp_skip), seqs, cp, dtype=dtype, timeout=timeout)
