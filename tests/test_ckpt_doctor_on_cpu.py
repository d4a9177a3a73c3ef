"""``verl-ds4 doctor --checkpoint DIR``: every file against its manifest, with checksums (seconds, no verl).

A manifest that lies (sizes right, bytes wrong) is caught, file named, exit 1; the negative control: the same
folder intact passes with exit 0, and the default start-up check (sizes only) passes the lying one.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_ckpt_manifest_on_cpu import fake_step  # noqa: E402

from verl_ds4 import ckpt_manifest as cm  # noqa: E402
from verl_ds4.cli import main as cli_main  # noqa: E402
from verl_ds4.engine.ckpt_doctor import check_checkpoints  # noqa: E402


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_doctor_checkpoint_intact_passes_and_a_lying_manifest_fails(tmp_path, capsys):
    ckpt = tmp_path / "checkpoints"
    fake_step(ckpt, 40)
    fake_step(ckpt, 80)
    assert cli_main(["--verbose", "doctor", "--checkpoint", str(ckpt)]) == 0  # control: intact
    out = capsys.readouterr().out
    assert out.count("  ok      ") == 2 * len(cm.read_manifest(ckpt / "global_step_80")["files"])
    assert "0 damaged" in out and "DAMAGED" not in out
    shard = ckpt / "global_step_80" / "model" / "dist_ckpt" / "__1_0.distcp"
    _flip_last_byte(shard)  # same size, other bytes: the manifest now lies about it
    assert cm.verify_folder(ckpt / "global_step_80") == []  # the cheap check passes it
    assert cli_main(["--verbose", "doctor", "--checkpoint", str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED model/dist_ckpt/__1_0.distcp: its bytes differ from the manifest's checksum" in out
    assert f"{ckpt / 'global_step_80'}: DAMAGED" in out and f"{ckpt / 'global_step_40'}: intact" in out
    assert "1 damaged" in out and "fix:" in out
    assert shard.is_file() and (ckpt / "global_step_80").is_dir()  # nothing changed
    assert check_checkpoints(ckpt / "global_step_40") == 0  # one step folder
    assert check_checkpoints(ckpt / "global_step_80") == 1


def test_doctor_checkpoint_parts_legacy_and_nothing_to_check(tmp_path, capsys):
    step = tmp_path / "rl" / "global_step_3"
    (step / "actor").mkdir(parents=True)
    (step / "actor" / "w.bin").write_bytes(b"x" * 100)
    cm.write_manifest(step / "actor")
    (step / "data.pt").write_bytes(b"d")
    cm.write_manifest(step)
    assert check_checkpoints(step.parent) == 0
    assert "ok      actor/w.bin" in capsys.readouterr().out
    (step / "actor" / "w.bin").write_bytes(b"y" * 100)  # a part's file with other bytes
    assert check_checkpoints(step.parent) == 1
    assert "DAMAGED actor/w.bin" in capsys.readouterr().out
    fake_step(tmp_path / "old", 7, manifest=False)
    assert check_checkpoints(tmp_path / "old") == 0
    assert "structural checks only" in capsys.readouterr().out
    assert check_checkpoints(tmp_path / "nothing") == 1
    assert "no checkpoint to check" in capsys.readouterr().err
