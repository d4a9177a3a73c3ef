"""verl's own ``TrainingWorker`` on the CPU Megatron engine, configured as verl's trainers configure it.

    worker, model_config = cpu_training_worker("value_model", f"{assets}/model", cp=2,
                                               overrides=["engine.forward_only=True"])

The config tree is verl's ``sft_trainer_engine`` composed with Hydra (``engine=megatron``,
``optim=megatron``, fp32, no sequence parallelism, dist-checkpointing, ``trainer.device=cpu``) plus
``overrides``; the worker is built from it with ``TrainingWorkerConfig`` and ``reset()`` (the
engines are constructed). The caller must have initialised ``torch.distributed`` and imported
``verl`` with the CPU platform and engines (``VERL_USE_EXTERNAL_MODULES``). Used by the critic-path
check (:mod:`.value_forward`) and the engine differential (:mod:`verl_ds4.testing.engine_differential`).
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["cpu_training_worker"]


def cpu_training_worker(model_type: str, model_path: str, cp: int, overrides: Sequence[str] = ()):
    """``(worker, model_config)``: a reset ``TrainingWorker(model_type=...)`` for ``model_path`` at CP ``cp``."""
    from hydra import compose, initialize_config_module
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    from verl_ds4.cpu.sft_run import engine_dtype_args

    if model_type not in ("language_model", "value_model"):
        raise ValueError(f"model_type={model_type!r}; expected 'language_model' or 'value_model' (verl's TrainingWorker).")
    with initialize_config_module("verl.trainer.config", version_base=None):
        cfg = compose(
            "sft_trainer_engine",
            overrides=[
                "engine=megatron",
                "optim=megatron",
                f"model.path={model_path}",
                *engine_dtype_args("float32"),
                f"engine.context_parallel_size={cp}",
                "engine.sequence_parallel=False",
                "engine.use_dist_checkpointing=True",
                "trainer.device=cpu",
                *overrides,
            ],
        )
    model_config = omega_conf_to_dataclass(cfg.model)
    worker = TrainingWorker(
        TrainingWorkerConfig(
            model_type=model_type,
            model_config=model_config,
            engine_config=omega_conf_to_dataclass(cfg.engine),
            optimizer_config=omega_conf_to_dataclass(cfg.optim),
            checkpoint_config=omega_conf_to_dataclass(cfg.checkpoint),
            profiler_config=omega_conf_to_dataclass(cfg.profiler),
        )
    )
    worker.reset()
    return worker, model_config
