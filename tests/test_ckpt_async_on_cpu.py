"""Async saves (issue 44): the manifest and the tracker follow the finalisation of every rank's write.

The save path is the real one except the model: verl's ``CheckpointHandler.save_checkpoint`` with verl-ds4's
hook, verl-ds4's :class:`~verl_ds4.engine.checkpoint.ManifestCheckpointEngine` over a stand-in engine whose
save schedules a real Megatron ``AsyncRequest`` (a forked writer that writes its shard once the test opens a
gate) through verl's own ``MegatronCheckpointManager._dispatch_finalize`` and ``_finalize_save`` (its
``ckpt_contents.json``, its tracker write two folders up, its ``register_checkpoint``), on Megatron's process-wide
``async_calls`` queue, in a one-rank gloo group. The CPU job's real async saves, killed in flight and resumed,
are in ``tests/test_cpu_sft_on_cpu.py``. Negative controls: verl alone (the engine without the mixin) never
finalises the save, and the refusal outside verl's SFT trainer is lifted where that trainer drives the process.
"""

from __future__ import annotations

import os
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from verl_ds4 import ckpt_manifest as cm
from verl_ds4.engine import checkpoint as ck
from verl_ds4.recipes import ckpt_resume as cr
from verl_ds4.substitutes.cuda_literals import cuda_literals_on_cpu
from verl_ds4.testing.ckpt_faults import standin_handler

pytest.importorskip("verl.workers.engine")  # first: see tests/test_ckpt_faults_on_cpu.py
handler_module = pytest.importorskip("verl.utils.checkpoint.checkpoint_handler")
manager_module = pytest.importorskip("verl.utils.checkpoint.megatron_checkpoint_manager")
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest  # noqa: E402
from megatron.core.dist_checkpointing.strategies.base import async_calls  # noqa: E402

TRACKER = cm.TRACKER_NAME


def _write_when_open(shard: str, gate: str) -> None:
    """The forked writer: waits for the gate file, then writes the shard (Megatron's writer's place)."""
    while not os.path.exists(gate):
        time.sleep(0.01)
    Path(shard).write_bytes(os.urandom(100_000))


class _Manager(manager_module.MegatronCheckpointManager):
    """verl's manager with the state its finalisation reads (no model); its contents file kept minimal."""

    def __init__(self):  # noqa: D107 - verl's own __init__ needs a model
        self.rank, self.previous_saved_paths = 0, []
        self.checkpoint_config = types.SimpleNamespace(async_save=True)

    def _write_checkpoint_manifest(self, local_path, global_step, saved_any_dist_ckpt):
        Path(local_path, "ckpt_contents.json").write_text('{"step": %d}' % global_step)


class _StandInEngine:
    """verl's Megatron engine as far as an async save goes (the CPU engine's device context)."""

    checkpoint_config = types.SimpleNamespace(async_save=True)
    checkpoint_device_context = staticmethod(cuda_literals_on_cpu)
    gate = ""

    def __init__(self, *args, **kwargs):
        self.checkpoint_mananager = _Manager()
        self.steps = 0

    def train_batch(self, *args, **kwargs):
        self.steps += 1

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        shard = Path(local_path) / "model" / "dist_ckpt" / "__0_0.distcp"
        shard.parent.mkdir(parents=True, exist_ok=True)
        manager = self.checkpoint_mananager
        request = AsyncRequest(_write_when_open, (str(shard), self.gate), [])
        with cuda_literals_on_cpu():
            manager._dispatch_finalize([request], lambda: manager._finalize_save(
                local_path=local_path, hdfs_path=hdfs_path, global_step=global_step,
                max_ckpt_to_keep=max_ckpt_to_keep, saved_any_dist_ckpt=True))


class ManifestEngine(ck.ManifestCheckpointEngine, _StandInEngine):
    pass


def _handler(ckpt: Path, engine):
    return standin_handler(ckpt, engine, 2)


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo group (Megatron's finalisation all-reduces); Megatron's queue left empty afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        for gate in ("gate", "gate1", "gate2"):  # a test that failed early leaves its writer at a closed gate
            (tmp_path / gate).touch()
        with cuda_literals_on_cpu():
            async_calls.maybe_finalize_async_calls(blocking=True)
        dist.destroy_process_group()


def _save(handler, step):
    verl_save = getattr(handler_module.CheckpointHandler.save_checkpoint, "__wrapped__",
                        handler_module.CheckpointHandler.save_checkpoint)
    ck.handler_save_checkpoint(verl_save)(handler, step)


def _wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def test_manifest_and_tracker_follow_the_finalisation_in_order(one_rank, tmp_path):
    ckpt = tmp_path / "run" / "checkpoints"
    engine = ManifestEngine()
    handler = _handler(ckpt, engine)
    step1 = ckpt / "global_step_1"
    engine.gate = str(tmp_path / "gate1")
    _save(handler, 1)
    # The save returned; the writer waits at its gate: the step has its dataloader state and nothing that says done.
    assert (step1 / "data_0.pt").is_file() and not (step1 / "model" / "dist_ckpt" / "__0_0.distcp").exists()
    assert not (step1 / cm.MANIFEST_NAME).exists() and not (ckpt / TRACKER).exists()
    assert (ckpt / (TRACKER + ck.PENDING_SUFFIX)).read_text() == "1"  # verl's handler wrote it, under our name
    engine.train_batch()  # a training step's poll: the write is not done, nothing is finalised
    assert not (step1 / cm.MANIFEST_NAME).exists() and not (step1 / "ckpt_contents.json").exists()
    with pytest.raises(cm.CheckpointDamagedError, match="no intact checkpoint"):  # killed now: nothing to resume
        cr.choose_resume(ckpt, "auto", apply=False)

    Path(engine.gate).touch()
    _wait_for(step1 / "model" / "dist_ckpt" / "__0_0.distcp")
    deadline = time.monotonic() + 30
    while not (step1 / cm.MANIFEST_NAME).exists():  # the next steps' polls finalise it once the writer exited
        assert time.monotonic() < deadline, "the finished write was never finalised"
        engine.train_batch()
        time.sleep(0.05)
    assert engine.steps >= 2 and async_calls.get_num_unfinalized_calls() == 0
    manifest = cm.read_manifest(step1)
    # verl's finalisation (ckpt_contents.json) ran before the manifest, which lists it and the shard
    assert {"ckpt_contents.json", "data_0.pt", "model/dist_ckpt/__0_0.distcp"} <= set(manifest["files"])
    assert (ckpt / TRACKER).read_text() == "1" and not (ckpt / (TRACKER + ck.PENDING_SUFFIX)).exists()
    # verl's own tracker write (two folders up from the step: the folder above the run's) went to os.devnull
    assert not (ckpt.parent / TRACKER).exists()
    assert cr.choose_resume(ckpt, "auto", apply=False).step == 1

    # The next save finalises the previous one first; the end of verl's SFT fit finalises the last one (blocking).
    engine.gate = str(tmp_path / "gate2")
    _save(handler, 2)
    assert not (ckpt / "global_step_2" / cm.MANIFEST_NAME).exists() and (ckpt / TRACKER).read_text() == "1"
    trainer = types.SimpleNamespace(engine=engine)
    opened = []

    def fit(self):  # verl's loop: returns right after the last save was scheduled; the gate opens later
        os.system(f"(sleep 0.5; touch {engine.gate}) &")
        opened.append(time.monotonic())
        return "done"

    assert ck.sft_fit(fit)(trainer) == "done"
    assert time.monotonic() - opened[0] >= 0.4  # it waited for the write
    assert (ckpt / TRACKER).read_text() == "2" and cm.verify_step(ckpt, 2, full=True) == []
    assert engine.checkpoint_mananager.previous_saved_paths == [str(step1), str(ckpt / "global_step_2")]


def test_negative_control_verl_alone_never_finalises_an_async_save(one_rank, tmp_path):
    ckpt = tmp_path / "checkpoints"
    engine = _StandInEngine()
    engine.gate = str(tmp_path / "gate")
    Path(engine.gate).touch()
    verl_save = getattr(handler_module.CheckpointHandler.save_checkpoint, "__wrapped__",
                        handler_module.CheckpointHandler.save_checkpoint)
    verl_save(_handler(ckpt, engine), 1)
    _wait_for(ckpt / "global_step_1" / "model" / "dist_ckpt" / "__0_0.distcp")
    time.sleep(0.5)
    engine.train_batch()  # verl's engine polls nothing
    # The shard is written but Megatron's queue still holds the save: verl's finalisation never ran.
    assert async_calls.get_num_unfinalized_calls() == 1
    assert not (ckpt / "global_step_1" / "ckpt_contents.json").exists()
    assert (ckpt / TRACKER).read_text() == "1"  # verl's handler wrote the tracker before the shard was written


def test_async_save_outside_verls_sft_trainer_is_refused_at_construction(monkeypatch):
    for name in (ck.SFT_TRAINER_MODULE, "__main__"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    built = []

    class Base:
        def __init__(self, *args, **kwargs):
            built.append(args)

    class Engine(ck.ManifestCheckpointEngine, Base):
        pass

    config = types.SimpleNamespace(async_save=True)
    with pytest.raises(ck.AsyncSaveUnsupportedError, match="supported in verl's torchrun SFT trainer") as err:
        Engine(None, None, None, config)
    assert "actor_rollout_ref.actor.checkpoint.async_save=false" in str(err.value) and not built  # nothing built
    Engine(None, None, None, types.SimpleNamespace(async_save=False))  # a sync save needs no trainer
    assert len(built) == 1

    # Negative control: where verl's SFT trainer drives the process (here under ``python -m``), it is accepted
    # and the trainer's fit finalises the last save.
    class SFTTrainer:
        def fit(self):
            return "fit"

    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name=ck.SFT_TRAINER_MODULE)
    main.SFTTrainer = SFTTrainer
    monkeypatch.setitem(sys.modules, "__main__", main)
    try:
        Engine(None, None, None, config)
        assert getattr(SFTTrainer.fit, "__verl_ds4_hook__", False) and len(built) == 2
        trainer = SFTTrainer()
        trainer.engine = types.SimpleNamespace(finish_async_saves=lambda blocking: built.append(("finish", blocking)))
        assert trainer.fit() == "fit" and built[-1] == ("finish", True)
    finally:
        ck.uninstall_sft_fit_hook()
    assert not getattr(SFTTrainer.fit, "__verl_ds4_hook__", False)
