"""The CPU engines' config: verl-ds4's engine config that also admits fp32 parameters."""

from __future__ import annotations

from dataclasses import dataclass

from verl_ds4.engine.config import DS4McoreEngineConfig

__all__ = ["CPUMcoreEngineConfig"]

_FP32_NAMES = ("float32", "fp32")


@dataclass
class CPUMcoreEngineConfig(DS4McoreEngineConfig):
    """verl-ds4's engine config (verl's ``McoreEngineConfig`` + ``cp_balance``) that also accepts
    ``dtype: float32`` (CPU engine only).

    verl 0.9.1's Megatron engine config admits only ``bfloat16``/``float16`` parameters, the
    right choice on GPUs. On a CPU, fp32 parameters and compute are what make runs at
    different CP sizes comparable to fp32 tolerance (bf16 rounds differently when the same
    tokens are summed on one rank or two), and fp32 matmuls are no slower there. Select it
    with ``engine._target_=verl_ds4.cpu.engine.CPUMcoreEngineConfig engine.dtype=float32``;
    every other field and check is verl's. The DS4 GPU engines refuse an fp32 config
    (:meth:`verl_ds4.engine.megatron.DS4MegatronEngineWithLMHead`), so it cannot reach them
    unnoticed.
    """

    _mutable_fields = DS4McoreEngineConfig._mutable_fields | {"dtype"}

    def __post_init__(self) -> None:
        requested = self.dtype
        if requested not in _FP32_NAMES:
            super().__post_init__()
            return
        # verl's own checks, run on a half-precision stand-in, then the requested value back.
        self.dtype = "bfloat16"
        try:
            super().__post_init__()
        finally:
            self.dtype = "float32"
