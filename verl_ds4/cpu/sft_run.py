"""Launch verl's SFT trainer on CPU processes (tests and the CPU demo share this).

:func:`sft_command` builds the ``torchrun ... -m verl.trainer.sft_trainer engine=megatron
optim=megatron`` command line for the assets written by
:func:`verl_ds4.cpu.sft_data.prepare_cpu_sft_assets`; :func:`cpu_env` is the
environment that selects the CPU platform and loads the CPU engines; :func:`parse_losses`
reads verl's console lines (``step:N - ... train/loss:X``).
"""

from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path
from typing import Iterable

__all__ = ["cpu_env", "engine_dtype_args", "free_port", "kill_run", "parse_losses", "sft_command"]

_STEP_LOSS = re.compile(r"step:(\d+) - .*?train/loss:([-+0-9.eE]+|nan|inf)")


def free_port() -> int:
    """A TCP port that was free a moment ago (for torchrun's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_env(base: dict | None = None) -> dict:
    """``base`` (default: ``os.environ``) plus the CPU platform and engine selection."""
    env = dict(os.environ if base is None else base)
    env["VERL_PLATFORM"] = "cpu"
    env["VERL_USE_EXTERNAL_MODULES"] = "verl_ds4.cpu.platform,verl_ds4.cpu.engine"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def sft_command(
    assets: dict,
    *,
    ckpt_dir: str | Path,
    steps: int,
    cp: int = 2,
    nproc: int = 2,
    batch: int = 16,
    micro_batch: int = 8,
    lr: float = 3e-3,
    save_freq: int = -1,
    resume_mode: str = "disable",
    ds4_chat: bool = True,
    dtype: str = "float32",
    port: int | None = None,
    python: str = sys.executable,
    extra: Iterable[str] = (),
) -> list[str]:
    """The torchrun command line of one CPU SFT run (verl's own trainer, Megatron engine)."""
    args = [
        python, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port or free_port()}",
        "-m", "verl.trainer.sft_trainer", "engine=megatron", "optim=megatron",
        f"model.path={assets['model']}",
        f"model.external_lib={assets['external_lib']}",
        f"data.train_files={assets['train']}",
        "data.val_files=null",
        f"data.train_batch_size={batch}",
        f"data.micro_batch_size_per_gpu={micro_batch}",
        "data.use_dynamic_bsz=False",
        "data.max_length=256",
        "data.num_workers=0",
        *engine_dtype_args(dtype),
        f"engine.context_parallel_size={cp}",
        "engine.sequence_parallel=False",
        "engine.use_distributed_optimizer=True",
        "engine.use_dist_checkpointing=True",
        f"optim.lr={lr}",
        "optim.clip_grad=1.0",
        "trainer.device=cpu",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={ckpt_dir}",
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=100",
        f"trainer.save_freq={save_freq}",
        f"trainer.resume_mode={resume_mode}",
    ]
    if ds4_chat:
        args += ["data.custom_cls.path=pkg://verl_ds4.models.ds4.sft_dataset", "data.custom_cls.name=DS4ChatSFTDataset"]
    return args + list(extra)


def engine_dtype_args(dtype: str) -> list[str]:
    """Hydra overrides for the engine's parameter dtype; ``float32`` selects :class:`CPUMcoreEngineConfig`.

    verl's own ``McoreEngineConfig`` admits only ``bfloat16``/``float16``.
    """
    if dtype in ("float32", "fp32"):
        return ["engine._target_=verl_ds4.cpu.engine.CPUMcoreEngineConfig", "engine.dtype=float32"]
    return [f"engine.dtype={dtype}"]


def parse_losses(text: str) -> dict[int, float]:
    """``{step: loss}`` from verl's console tracking lines (the last value wins for a repeated step)."""
    return {int(step): float(loss) for step, loss in _STEP_LOSS.findall(text)}


def kill_run(proc) -> None:
    """SIGKILL a launched ``torchrun`` (a ``subprocess.Popen``) and every process it started.

    torchrun starts each worker in a session of its own, so killing torchrun's process group
    would leave the workers training; the descendants are collected first and killed by pid.
    """
    import psutil

    try:
        root = psutil.Process(proc.pid)
        family = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        family = []
    for member in family:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=30)
    proc.wait(timeout=30)
