"""Faults injected into a real checkpoint folder (tests and ``benchmarks/bench_ckpt_manifest.py``).

Each injector takes a ``trainer.default_local_dir`` that holds intact ``global_step_N`` folders written by a
real run (every one with its manifest, the tracker on the newest) and damages its newest step the way the
named fault leaves it on disk. :data:`FAULTS` maps each fault to its injector and to what the next start
must do (``"previous"``: resume from the step before the newest; ``"newest"``: from the newest).

The state each injector leaves is the one the fault leaves, not a guess at it:

* ``shard_cut_short``: a ``.distcp`` shard truncated to half (a full disk, an interrupted copy);
* ``folder_missing``: ``optimizer/`` removed (a copy or a sync that lost a folder);
* ``tracker_names_missing_step``: the tracker names a step with no folder (verl alone would start from
  scratch without a word);
* ``write_fails_for_lack_of_space``: the newest step written again file by file (manifest last, the tracker
  on the previous step while it is written, as a save does) by a child process under ``RLIMIT_FSIZE``, whose
  write of the first file above the limit fails with ``EFBIG`` (a full disk's error); the save stops there;
* ``stopped_before_manifest``: every file written, the manifest not (a rank killed before the manifest);
* ``manifest_lies``: one byte of a shard flipped, sizes unchanged (caught by the full check only; the
  cheap start-up check passes it, so the next start uses it: this is the documented limit).

A real SIGKILL of the ranks inside a real save is in ``tests/test_cpu_sft_on_cpu.py`` (and on the local
Slurm in ``tests/test_cluster_launchers_real_on_cpu.py``); the stand-in engine's kill points are in
``tests/test_ckpt_faults_on_cpu.py``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from verl_ds4.ckpt_manifest import MANIFEST_NAME, TRACKER_NAME, step_folders

__all__ = ["FAULTS", "inject", "newest_step", "standin_handler"]


def newest_step(ckpt_dir: Path) -> tuple[int, Path]:
    steps = step_folders(ckpt_dir)
    if len(steps) < 2:
        raise ValueError(f"{ckpt_dir}: expected at least two global_step_N folders, found {sorted(steps)}")
    step = max(steps)
    return step, steps[step]


def _previous(ckpt_dir: Path) -> int:
    return sorted(step_folders(ckpt_dir))[-2]


def _shard(folder: Path) -> Path:
    shards = sorted((folder / "model" / "dist_ckpt").glob("*.distcp"), key=lambda p: (-p.stat().st_size, p.name))
    if not shards:
        raise ValueError(f"{folder}: no model/dist_ckpt/*.distcp shard")
    return shards[0]


def shard_cut_short(ckpt_dir: Path) -> Path:
    shard = _shard(newest_step(ckpt_dir)[1])
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    return shard


def folder_missing(ckpt_dir: Path) -> Path:
    folder = newest_step(ckpt_dir)[1] / "optimizer"
    shutil.rmtree(folder)
    return folder


def tracker_names_missing_step(ckpt_dir: Path) -> Path:
    step, _ = newest_step(ckpt_dir)
    tracker = ckpt_dir / TRACKER_NAME
    tracker.write_text(str(step + 2))
    return tracker


_WRITER = textwrap.dedent("""
    import os, resource, shutil, signal, sys
    from pathlib import Path
    source, target, limit = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write(), as on a full disk (not the signal)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    files = sorted((p for p in source.rglob("*") if p.is_file() and p.name != sys.argv[4]), key=lambda p: str(p))
    try:
        for path in files + [source / sys.argv[4]]:  # the manifest last, as a save writes it
            out = target / path.relative_to(source)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, out)
    except OSError as e:
        print(f"write failed: {out}: {e.strerror}")
        sys.exit(3)
""")


def write_fails_for_lack_of_space(ckpt_dir: Path) -> Path:
    step, folder = newest_step(ckpt_dir)
    (ckpt_dir / TRACKER_NAME).write_text(str(_previous(ckpt_dir)))  # a save advances it only after its manifest
    source = folder.with_name(folder.name + ".source")
    folder.rename(source)
    limit = _shard(source).stat().st_size // 2
    proc = subprocess.run([sys.executable, "-c", _WRITER, str(source), str(folder), str(limit), MANIFEST_NAME],
                          capture_output=True, text=True, timeout=120)
    shutil.rmtree(source)
    if proc.returncode != 3 or "File too large" not in proc.stdout:
        raise RuntimeError(f"the writer under RLIMIT_FSIZE={limit} did not fail as expected (exit "
                           f"{proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return Path(proc.stdout.split("write failed: ", 1)[1].split(": ")[0])


def stopped_before_manifest(ckpt_dir: Path) -> Path:
    _, folder = newest_step(ckpt_dir)
    (folder / MANIFEST_NAME).unlink()
    (ckpt_dir / TRACKER_NAME).write_text(str(_previous(ckpt_dir)))
    return folder / MANIFEST_NAME


def manifest_lies(ckpt_dir: Path) -> Path:
    shard = _shard(newest_step(ckpt_dir)[1])
    with open(shard, "r+b") as f:
        f.seek(0)
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    return shard


#: fault -> (injector, what the next start does: "previous" or "newest" step)
FAULTS = {
    "shard_cut_short": (shard_cut_short, "previous"),
    "folder_missing": (folder_missing, "previous"),
    "tracker_names_missing_step": (tracker_names_missing_step, "newest"),
    "write_fails_for_lack_of_space": (write_fails_for_lack_of_space, "previous"),
    "stopped_before_manifest": (stopped_before_manifest, "previous"),
    "manifest_lies": (manifest_lies, "newest"),
}


def inject(fault: str, ckpt_dir: str | Path) -> Path:
    """Damage the newest step of ``ckpt_dir`` with ``fault``; returns the file or folder it damaged."""
    if fault not in FAULTS:
        raise ValueError(f"fault={fault!r}: expected one of {sorted(FAULTS)}")
    return FAULTS[fault][0](Path(ckpt_dir))


def standin_handler(ckpt: str | Path, engine, max_ckpt_to_keep: int | None):
    """verl's SFT ``CheckpointHandler`` over ``engine`` without verl's constructor (which needs a trainer): rank 0 of
    one, SPMD, saving into ``ckpt``, a dataloader whose state is ``{"sampler": 1}`` (the save-path tests)."""
    from verl.utils.checkpoint import checkpoint_handler as handler_module

    handler = handler_module.CheckpointHandler.__new__(handler_module.CheckpointHandler)
    handler.default_local_dir, handler.default_hdfs_dir, handler.engine = str(ckpt), None, engine
    handler.rank, handler.dp_rank, handler.is_mp_src_rank_with_outputs = 0, 0, True
    handler.max_ckpt_to_keep, handler.lora_train_meta = max_ckpt_to_keep, None
    handler.mode = handler_module.OrchestrationMode.SPMD
    handler.train_dataloader = type("Loader", (), {"state_dict": lambda self: {"sampler": 1}})()
    return handler
