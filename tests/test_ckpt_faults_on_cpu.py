"""SIGKILL inside an SFT save, and rotation (``max_ckpt_to_keep``) only after the new checkpoint is complete.

The save path is the real one down to the files: verl's ``CheckpointHandler.save_checkpoint`` with verl-ds4's
hook (:func:`verl_ds4.engine.checkpoint.handler_save_checkpoint`), verl-ds4's
:class:`~verl_ds4.engine.checkpoint.ManifestCheckpointEngine` over a stand-in for verl's Megatron engine that
writes two shards and registers the folder with verl's own checkpoint manager (``register_checkpoint``,
``remove_previous_save_local_path``). A forked child saves steps 1, 2 and 3 (``max_ckpt_to_keep=2``, one
rank: verl's barrier is a no-op in the child) and stops at a chosen point of step 3, where the parent
SIGKILLs it. Then the start-up check (:func:`verl_ds4.recipes.ckpt_resume.choose_resume`) must pick the
newest intact step and no intact checkpoint may be gone. Negative controls: the save that is not killed
rotates step 1 away, and the engine without verl-ds4's mixin (verl's order: rotation right after the
engine's files) deletes step 1 although step 3 never completes. Each case takes well under a second.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from verl_ds4 import ckpt_manifest as cm
from verl_ds4.engine import checkpoint as ck
from verl_ds4.recipes import ckpt_resume as cr
from verl_ds4.testing.ckpt_faults import standin_handler

# verl.workers.engine first: imported first in a fresh process, checkpoint_handler reaches verl-ds4's plugin
# (which imports it back) half-initialised, and the plugin fails to register.
pytest.importorskip("verl.workers.engine")
handler_module = pytest.importorskip("verl.utils.checkpoint.checkpoint_handler")
from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager  # noqa: E402

TRACKER = "latest_checkpointed_iteration.txt"
KEEP = 2


class _Points:
    """Where the child stops: the parent reads the point's name on the pipe and SIGKILLs it."""

    armed: str | None = None
    fd: int | None = None

    @classmethod
    def reach(cls, name: str) -> None:
        if cls.armed == name:
            os.write(cls.fd, f"{name}\n".encode())
            time.sleep(60)


class _StandInMegatronEngine:
    """verl's Megatron engine as far as saving goes: shards, ckpt_contents.json, verl's manager's rotation."""

    checkpoint_config = type("C", (), {"async_save": False})()

    def __init__(self):
        self.checkpoint_mananager = BaseCheckpointManager.__new__(BaseCheckpointManager)  # verl's rotation code
        self.checkpoint_mananager.previous_saved_paths = []

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        dist = Path(local_path) / "model" / "dist_ckpt"
        dist.mkdir(parents=True, exist_ok=True)
        for shard in range(2):
            (dist / f"__{shard}_0.distcp").write_bytes(os.urandom(200_000))
            _Points.reach(f"after_shard_{shard}")  # after_shard_0: between the shards
        (Path(local_path) / "ckpt_contents.json").write_text("{}")
        self.checkpoint_mananager.register_checkpoint(local_path, max_ckpt_to_keep)  # rotates when given a number


class ManifestEngine(ck.ManifestCheckpointEngine, _StandInMegatronEngine):
    pass


def _handler(ckpt: Path, engine):
    return standin_handler(ckpt, engine, KEEP)


def _child(ckpt: Path, point: str | None, fd: int, mixin: bool) -> None:
    """Save steps 1-3 through verl's handler with verl-ds4's hook; stop at ``point`` of step 3."""
    torch.distributed.barrier = lambda *a, **k: None  # one rank (this child only)
    verl_save = getattr(handler_module.CheckpointHandler.save_checkpoint, "__wrapped__",
                        handler_module.CheckpointHandler.save_checkpoint)
    save = ck.handler_save_checkpoint(verl_save)
    real_write, real_rotate, real_torch_save = ck.write_manifest, ck.rotate, torch.save

    def write_manifest(folder, **kwargs):
        _Points.reach("before_step_manifest")
        path = real_write(folder, **kwargs)
        _Points.reach("before_tracker")
        return path

    def rotate(engine, keep):
        _Points.reach("before_rotation")
        return real_rotate(engine, keep)

    def torch_save(obj, f, *args, **kwargs):
        _Points.reach("before_dataloader_state")
        return real_torch_save(obj, f, *args, **kwargs)

    ck.write_manifest, ck.rotate, handler_module.torch.save = write_manifest, rotate, torch_save
    handler = _handler(ckpt, ManifestEngine() if mixin else _StandInMegatronEngine())
    _Points.fd = fd
    for step in (1, 2, 3):
        _Points.armed = point if step == 3 else None
        save(handler, step)


def _run(ckpt: Path, point: str | None, mixin: bool = True) -> bool:
    """Fork the child; SIGKILL it at ``point``. True when it was killed there."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        code = 0
        try:
            _child(ckpt, point, write_fd, mixin)
        except BaseException:  # noqa: BLE001 - reported through the exit status
            import traceback

            traceback.print_exc()
            code = 3
        os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        reached = pipe.readline().strip()
    if reached:
        assert reached == point
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if reached:
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    else:
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "the child's save failed (its traceback above)"
    return bool(reached)


def _intact(ckpt: Path) -> list[int]:
    return [s for s, folder in cm.step_folders(ckpt).items() if cm.verify_folder(folder, require_manifest=True) == []]


#: kill point -> (the step the next start resumes from, the steps left intact)
CASES = {
    "after_shard_0": (2, [1, 2]),  # between the shards
    "after_shard_1": (2, [1, 2]),  # shards written, before ckpt_contents.json and the dataloader state
    "before_dataloader_state": (2, [1, 2]),
    "before_step_manifest": (2, [1, 2]),  # every rank's files written, the manifest not yet
    "before_tracker": (3, [1, 2, 3]),  # the manifest is whole: step 3 is used, the tracker set to it
    "before_rotation": (3, [1, 2, 3]),
}


@pytest.mark.parametrize("point", list(CASES))
def test_sigkill_inside_a_save_resumes_from_the_newest_intact_step(tmp_path, point):
    ckpt = tmp_path / "checkpoints"
    assert _run(ckpt, point)
    expected_step, intact = CASES[point]
    assert _intact(ckpt) == intact  # nothing intact was deleted: rotation waits for a complete step
    assert (ckpt / TRACKER).read_text() == ("3" if point == "before_rotation" else "2")
    result = cr.choose_resume(ckpt, "auto")
    assert result.step == expected_step and result.seconds < 1, result.messages
    assert (ckpt / TRACKER).read_text() == str(expected_step)
    if expected_step == 2:
        assert [p.name for p, _ in result.moved] == ["global_step_3"]  # renamed aside, not deleted
        assert any(p.name.startswith("damaged_global_step_3") for p in ckpt.iterdir())
    assert _intact(ckpt) == [s for s in intact if s <= expected_step]
    assert cr.choose_resume(ckpt, "auto").messages == []  # the start after that one: quiet


def test_rotation_deletes_the_oldest_only_once_the_new_checkpoint_is_complete(tmp_path):
    ckpt = tmp_path / "checkpoints"
    assert not _run(ckpt, None)  # control: a complete save of step 3 rotates step 1 away
    assert _intact(ckpt) == [2, 3] and not (ckpt / "global_step_1").exists()
    assert (ckpt / TRACKER).read_text() == "3" and cr.choose_resume(ckpt, "auto").step == 3


def test_without_the_mixin_verls_order_deletes_an_intact_checkpoint_before_the_new_one_is_complete(tmp_path):
    ckpt = tmp_path / "checkpoints"
    assert _run(ckpt, "before_dataloader_state", mixin=False)
    assert not (ckpt / "global_step_1").exists()  # gone although step 3 never completed
    assert sorted(cm.step_folders(ckpt)) == [2, 3]
