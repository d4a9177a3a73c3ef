"""Megatron's model-parallel RNG tracker on torch's CPU generator.

Megatron's tracker holds CUDA generator states; on CPU it is replaced by
:class:`CPURNGStatesTracker` (same interface), seeded like Megatron seeds its tracker, so
checkpoints carry and restore RNG state.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["CPURNGStatesTracker", "install_cpu_rng_tracker"]


class CPURNGStatesTracker:
    """Megatron ``CudaRNGStatesTracker`` interface over torch's CPU generator.

    ``add(name, seed)`` records a generator state seeded with ``seed``; ``fork(name)`` swaps
    it into torch's default CPU generator for the block and stores it back afterwards;
    ``get_states``/``set_states`` carry the states through checkpoints.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} was never added to the CPU RNG tracker")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def install_cpu_rng_tracker(seed: int) -> CPURNGStatesTracker:
    """Replace Megatron's CUDA RNG tracker with a seeded :class:`CPURNGStatesTracker`.

    Seeds follow Megatron's ``model_parallel_cuda_manual_seed`` scheme (an offset per TP
    rank for the model-parallel stream, per EP/ETP rank for the expert stream) so every
    rank draws what it would draw on a GPU mesh of the same shape.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CPURNGStatesTracker()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    ep_rank = mpu.get_expert_model_parallel_rank()
    etp_rank = mpu.get_expert_tensor_parallel_rank()
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + 100 * ep_rank + etp_rank + 1)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return tracker
