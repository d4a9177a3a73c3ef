"""RL saves: verl's tracker advances only after the step's manifest, and a save SIGKILLed inside is skipped.

verl's own ``PPOTrainer._save_checkpoint`` (v1 trainer, every mode) runs on a stand-in trainer (config,
a worker group that writes ``actor/`` and its manifest as verl-ds4's engine does, a dataloader state) with
verl-ds4's real checkpoint callback (:class:`RunRecordCallback`, which installs the hook of
:func:`verl_ds4.engine.checkpoint.trainer_save_checkpoint`). No Ray, no model; the trainer module's
import (a few seconds) is the cost. Negative controls: verl's method without the hook has the tracker
advanced before the callback runs, and a kill at the same point then leaves a tracker naming an unfinished step.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_rl_resume_check_on_cpu import _config  # noqa: E402

from verl_ds4 import ckpt_manifest as cm  # noqa: E402
from verl_ds4.engine import checkpoint as ck  # noqa: E402
from verl_ds4.recipes import ckpt_resume as cr  # noqa: E402
from verl_ds4.recipes.resume_check import RunRecordCallback  # noqa: E402

trainer_base = pytest.importorskip("verl.trainer.ppo.v1.trainer_base")
TRACKER = "latest_checkpointed_iteration.txt"


class _WorkerGroup:
    def save_checkpoint(self, local_path, remote_path, global_step, max_ckpt_to_keep=None):
        os.makedirs(local_path, exist_ok=True)
        Path(local_path, "shard_0.distcp").write_bytes(os.urandom(20_000))
        cm.write_manifest(local_path, global_step=global_step)  # the engine's part manifest (ManifestCheckpointEngine)


class _Loader:
    def state_dict(self):
        return {"sampler": 1}


class SpyCallback(RunRecordCallback):
    """The real callback; records the tracker as on_save finds it, and can stop there (``kill_fd``)."""

    seen: list
    kill_fd = None

    def on_save(self, trainer, global_step, checkpoint_dir, async_save=False, **kwargs):
        tracker = Path(self.config.trainer.default_local_dir) / TRACKER
        self.seen.append(tracker.read_text() if tracker.is_file() else None)
        if self.kill_fd is not None:  # before the step's manifest: tell the parent, wait for its SIGKILL
            os.write(self.kill_fd, b"at on_save\n")
            time.sleep(60)
        super().on_save(trainer, global_step, checkpoint_dir, async_save, **kwargs)


def _trainer(tmp_path: Path):
    config = _config(tmp_path)
    config = OmegaConf.merge(config, {"trainer": {"default_hdfs_dir": None},
                                      "actor_rollout_ref": {"actor": {"checkpoint": {"async_save": False}}}})
    callback = SpyCallback(config)  # installs the hook on verl's PPOTrainer
    callback.seen = []
    trainer = type("StandInTrainer", (), {})()
    trainer.config, trainer.checkpoint_callback = config, callback
    trainer.actor_rollout_wg, trainer.use_critic, trainer.train_dataloader = _WorkerGroup(), False, _Loader()
    trainer.trainer_mode = "sync"
    return trainer, Path(config.trainer.default_local_dir)


def _save(trainer, step):
    trainer.global_steps = step
    trainer_base.PPOTrainer._save_checkpoint(trainer)  # verl's method, through the class attribute


@pytest.fixture(autouse=True)
def _restore_verl():
    yield
    ck.uninstall_trainer_hook()


def test_tracker_advances_only_after_the_step_manifest_and_without_the_hook_before(tmp_path):
    trainer, ckpt = _trainer(tmp_path)
    assert getattr(trainer_base.PPOTrainer._save_checkpoint, "__verl_ds4_hook__", False)
    _save(trainer, 1)
    _save(trainer, 2)
    assert trainer.checkpoint_callback.seen == [None, "1"]  # when the manifest was written, the tracker was old
    assert (ckpt / TRACKER).read_text() == "2" and not (ckpt / (TRACKER + ck.PENDING_SUFFIX)).exists()
    assert cm.verify_folder(ckpt / "global_step_2", require_manifest=True) == []
    assert cm.read_manifest(ckpt / "global_step_2")["parts"] == ["actor"]
    assert "open" not in vars(trainer_base)  # verl's module is left as it was
    ck.uninstall_trainer_hook()  # negative control: verl's own order
    assert not getattr(trainer_base.PPOTrainer._save_checkpoint, "__verl_ds4_hook__", False)
    _save(trainer, 3)
    assert trainer.checkpoint_callback.seen[-1] == "3"  # verl wrote the tracker before the callback's manifest


def _killed_in_on_save(trainer, step):
    """Fork; the child saves ``step`` and is SIGKILLed by the parent inside the callback, before the manifest."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: save, stop in on_save
        os.close(read_fd)
        trainer.checkpoint_callback.kill_fd = write_fd
        try:
            _save(trainer, step)
        finally:
            os._exit(3)  # never reached when killed
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        assert pipe.readline() == "at on_save\n"
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


@pytest.mark.parametrize("hooked", [True, False])
def test_sigkill_before_the_step_manifest(tmp_path, hooked):
    trainer, ckpt = _trainer(tmp_path)
    _save(trainer, 1)
    _save(trainer, 2)
    if not hooked:
        ck.uninstall_trainer_hook()
    _killed_in_on_save(trainer, 3)
    assert (ckpt / "global_step_3" / "actor" / cm.MANIFEST_NAME).is_file()  # the workers' part was complete
    assert not (ckpt / "global_step_3" / cm.MANIFEST_NAME).exists()
    # With the hook the tracker still names the last complete step; without it (control) the unfinished one.
    assert (ckpt / TRACKER).read_text() == ("2" if hooked else "3")
    result = cr.choose_resume(ckpt, "auto")
    assert result.step == 2 and [p.name for p, _ in result.moved] == ["global_step_3"]
    assert "the save did not finish" in "\n".join(result.messages)
    assert all(cm.verify_folder(ckpt / f"global_step_{s}", require_manifest=True) == [] for s in (1, 2))
    assert result.seconds < 1


def test_an_async_save_writes_no_tracker_and_nothing_is_renamed(tmp_path):
    trainer, ckpt = _trainer(tmp_path)
    _save(trainer, 1)
    trainer.config.actor_rollout_ref.actor.checkpoint.async_save = True
    _save(trainer, 2)  # verl skips the tracker; the callback writes no manifest (files may still be in flight)
    assert (ckpt / TRACKER).read_text() == "1" and not (ckpt / (TRACKER + ck.PENDING_SUFFIX)).exists()
    assert not (ckpt / "global_step_2" / cm.MANIFEST_NAME).exists()
