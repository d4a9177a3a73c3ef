"""Checkpoint manifests and the start-up check, on fake checkpoint folders (no training, seconds).

Each injected fault (a shard cut short, a folder missing, a tracker naming a missing step, a save stopped
before its manifest, a write failing for lack of space under RLIMIT_FSIZE, a manifest that lies) is
followed by the start-up decision (:func:`verl_ds4.recipes.ckpt_resume.choose_resume`), and each has a
negative control: the same folder without the fault resumes from the newest step, or the check without
the fix misses it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from verl_ds4 import ckpt_manifest as cm
from verl_ds4.recipes import ckpt_resume as cr

TRACKER = "latest_checkpointed_iteration.txt"


def fake_step(ckpt_dir: Path, step: int, *, manifest: bool = True, shard_bytes: int = 300_000) -> Path:
    """A global_step_N shaped like the CPU SFT job's (model/optimizer/extra dist_ckpt, data_0.pt, ...)."""
    folder = ckpt_dir / f"global_step_{step}"
    for part in ("model", "optimizer", "extra"):
        dist = folder / part / "dist_ckpt"
        dist.mkdir(parents=True)
        for name in ("__0_0.distcp", "__1_0.distcp"):
            (dist / name).write_bytes(os.urandom(shard_bytes))
        torch.save({"step": step}, dist / "common.pt")
        (dist / "metadata.json").write_text("{}")
        (dist / ".metadata").write_bytes(b"meta")
    torch.save({"sampler": step}, folder / "data_0.pt")
    (folder / "ckpt_contents.json").write_text("{}")
    if manifest:
        cm.mark_manifests_since(ckpt_dir, step)
        cm.write_manifest(folder, global_step=step)
    (ckpt_dir / TRACKER).write_text(str(step))
    return folder


@pytest.fixture
def two_steps(tmp_path):
    ckpt = tmp_path / "checkpoints"
    fake_step(ckpt, 40)
    fake_step(ckpt, 80)
    return ckpt


def _shard(ckpt, step=80):
    return ckpt / f"global_step_{step}" / "model" / "dist_ckpt" / "__0_0.distcp"


def test_intact_checkpoint_resumes_from_the_newest(two_steps):
    result = cr.choose_resume(two_steps, "auto")
    assert result.step == 80 and not result.moved and result.messages == []
    assert result.seconds < 2


def test_shard_cut_short_falls_back_to_the_newest_intact(two_steps):
    shard = _shard(two_steps)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    result = cr.choose_resume(two_steps, "auto")
    assert result.step == 40
    text = "\n".join(result.messages)
    assert str(shard) in text and "cut short" in text and "resuming from" in text and "step 40" in text
    assert (two_steps / TRACKER).read_text() == "40"
    assert not (two_steps / "global_step_80").exists()
    assert [p.name.startswith("damaged_global_step_80") for p in two_steps.iterdir() if "damaged" in p.name] == [True]
    assert (two_steps / "global_step_40").is_dir()  # nothing intact deleted
    assert cr.choose_resume(two_steps, "auto").messages == []  # the next start: quiet, from 40


def test_a_folder_missing_falls_back(two_steps):
    import shutil

    shutil.rmtree(two_steps / "global_step_80" / "optimizer")
    result = cr.choose_resume(two_steps, "auto")
    assert result.step == 40
    assert "optimizer/dist_ckpt/__0_0.distcp: missing" in "\n".join(result.messages)


def test_a_tracker_naming_a_missing_step(two_steps):
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    (two_steps / TRACKER).write_text("120")
    assert find_latest_ckpt_path(str(two_steps)) is None  # control: verl would start from scratch silently
    result = cr.choose_resume(two_steps, "auto")
    assert result.step == 80 and "does not exist" in "\n".join(result.messages)
    assert find_latest_ckpt_path(str(two_steps)).endswith("global_step_80")


def test_a_save_stopped_before_its_manifest(two_steps):
    (two_steps / TRACKER).write_text("40")  # verl-ds4 advances the tracker after the manifest
    (two_steps / "global_step_80" / cm.MANIFEST_NAME).unlink()
    result = cr.choose_resume(two_steps, "auto")
    assert result.step == 40 and "the save did not finish" in "\n".join(result.messages)


def test_a_save_stopped_between_manifest_and_tracker_uses_the_complete_step(two_steps):
    (two_steps / TRACKER).write_text("40")
    result = cr.choose_resume(two_steps, "auto")
    assert result.step == 80 and (two_steps / TRACKER).read_text() == "80"


def test_a_write_failing_for_lack_of_space(two_steps):
    """A writer under RLIMIT_FSIZE (a full disk's EFBIG) dies mid-shard, before the manifest."""
    script = textwrap.dedent(f"""
        import os, resource, signal, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        from test_ckpt_manifest_on_cpu import fake_step
        from pathlib import Path
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
        try:
            fake_step(Path({str(two_steps)!r}), 120)
        except OSError as e:
            print("write failed:", e.strerror)
            sys.exit(3)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "File too large" in proc.stdout
    assert (two_steps / "global_step_120").is_dir() and (two_steps / TRACKER).read_text() == "80"
    result = cr.choose_resume(two_steps, "auto")
    assert result.step == 80 and "global_step_120" in "\n".join(result.messages)


def test_explicit_path_to_a_damaged_checkpoint_is_refused(two_steps):
    shard = _shard(two_steps)
    assert cr.choose_resume(two_steps, "resume_path", two_steps / "global_step_80").step == 80  # control
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(cm.CheckpointDamagedError) as err:
        cr.choose_resume(two_steps, "resume_path", two_steps / "global_step_80")
    text = str(err.value)
    assert str(shard) in text and "Fix:" in text and "global_step_40" in text
    assert (two_steps / "global_step_80").is_dir()  # an explicit path is never moved


def test_no_intact_checkpoint_is_refused_not_a_fresh_start(two_steps):
    for step in (40, 80):
        (two_steps / f"global_step_{step}" / "data_0.pt").unlink()
    with pytest.raises(cm.CheckpointDamagedError, match="no intact checkpoint"):
        cr.choose_resume(two_steps, "auto", apply=False)
    assert cr.choose_resume(two_steps, "disable").folder is None


def test_legacy_checkpoints_without_manifest_still_load_said_once(tmp_path):
    ckpt = tmp_path / "old"
    fake_step(ckpt, 40, manifest=False)
    fake_step(ckpt, 80, manifest=False)
    result = cr.choose_resume(ckpt, "auto")
    assert result.step == 80
    assert len([m for m in result.messages if "no manifest" in m]) == 1
    # The structural checks still catch a torch file cut short (control: the intact one passes above).
    data = ckpt / "global_step_80" / "data_0.pt"
    data.write_bytes(data.read_bytes()[:-30])
    result = cr.choose_resume(ckpt, "auto")
    assert result.step == 40 and str(data) in "\n".join(result.messages)


def test_a_manifest_that_lies_is_caught_by_the_full_check(two_steps):
    shard = _shard(two_steps)
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF  # same size, other bytes
    shard.write_bytes(bytes(data))
    assert cm.verify_folder(two_steps / "global_step_80") == []  # the default check is sizes only
    problems = cm.verify_folder(two_steps / "global_step_80", full=True)
    assert [p.path for p in problems] == [shard] and "checksum" in problems[0].what
    # A whole-file checksum (written on request) catches a byte outside the sampled blocks.
    cm.write_manifest(two_steps / "global_step_40", full=True)
    middle = _shard(two_steps, 40)
    data = bytearray(middle.read_bytes())
    data[70_000] ^= 0xFF  # between two sampled blocks
    middle.write_bytes(bytes(data))
    assert "whole file" in cm.verify_folder(two_steps / "global_step_40", full=True)[0].what


def test_parts_are_verified_through_the_step_manifest(tmp_path):
    step = tmp_path / "global_step_3"
    fake_step(step.parent, 3, manifest=False)
    (step / "actor").mkdir()
    (step / "actor" / "w.bin").write_bytes(b"x" * 100)
    cm.write_manifest(step / "actor")
    cm.write_manifest(step)
    assert json.loads((step / cm.MANIFEST_NAME).read_text())["parts"] == ["actor"]
    assert cm.verify_folder(step) == []
    (step / "actor" / "w.bin").write_bytes(b"x" * 99)
    assert "w.bin" in str(cm.verify_folder(step)[0])


def test_the_launcher_check_cli(two_steps, capsys):
    args = [f"trainer.default_local_dir={two_steps}", "trainer.resume_mode=auto"]
    assert cr.main(["--", *args]) == 0
    assert "resume from" in capsys.readouterr().out
    assert cr.main(["--", *args, f"trainer.resume_from_path={two_steps / 'global_step_80'}"]) == 0
    _shard(two_steps).write_bytes(b"")
    assert cr.main(["--", *args, f"trainer.resume_from_path={two_steps / 'global_step_80'}"]) == 2
    assert "refusing to resume" in capsys.readouterr().err


def test_the_full_check_cli_reports_and_changes_nothing(two_steps, capsys):
    """``ckpt_resume --check DIR`` is the doctor's full check (one implementation, the same report)."""
    import re

    from verl_ds4.engine.ckpt_doctor import check_checkpoints

    assert cr.main(["--check", str(two_steps)]) == 0  # control: intact
    capsys.readouterr()
    shard = _shard(two_steps)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size: only the checksum sees it
    shard.write_bytes(bytes(data))
    assert cr.choose_resume(two_steps, "auto", apply=False).step == 80  # the cheap check passes it
    assert cr.main(["--check", str(two_steps)]) == 1
    out = capsys.readouterr().out
    rel = shard.relative_to(two_steps / "global_step_80").as_posix()
    assert f"{two_steps / 'global_step_80'}: DAMAGED" in out and f"DAMAGED {rel}: its bytes differ" in out
    assert "1 damaged" in out
    assert check_checkpoints(two_steps) == 1
    untimed = lambda text: re.sub(r"in [0-9.]+ s", "in T s", text)  # noqa: E731
    assert untimed(capsys.readouterr().out) == untimed(out)  # the doctor's own report, line for line
    assert (two_steps / "global_step_80").is_dir() and (two_steps / TRACKER).read_text() == "80"
    assert cr.main(["--check", str(two_steps / "global_step_40")]) == 0
    assert cr.main(["--check", str(two_steps / "nothing")]) == 1
    assert "no checkpoint to check" in capsys.readouterr().err
