"""``verl-ds4 doctor --checkpoint DIR``: the full check of checkpoints against their manifests, file by file.

``DIR`` is a ``trainer.default_local_dir`` (every ``global_step_N`` in it is checked) or one checkpoint folder
(a ``global_step_N``, an RL step's ``actor/``, an ``sft_to_hf`` folder). Every file the manifest lists is
re-read: its size, the CRC-32 of its sampled blocks and, where the manifest has it
(``VERL_DS4_CKPT_CHECKSUM=full`` at save time), the whole file's CRC-32; so a manifest that lies (sizes right,
bytes wrong) is caught here, where the start-up check (sizes only) passes it. Parts with their own manifest
(``actor/``, ``critic/``) are checked the same way. A folder without a manifest (written before manifests
existed) gets the structural checks only. Nothing is changed. ``python -m verl_ds4.recipes.ckpt_resume --check DIR``
calls :func:`check_checkpoints` (the same report). Exit status 0 when every checkpoint is intact,
1 otherwise (a damaged one, or nothing to check).

Standard library and :mod:`verl_ds4.ckpt_manifest` only: no verl, no model, seconds.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from verl_ds4.ckpt_manifest import (
    MANIFEST_NAME,
    check_file,
    has_manifest,
    manifest_since,
    read_manifest,
    step_folders,
    step_of,
    verify_folder,
)

__all__ = ["check_checkpoints", "checkpoint_targets", "file_results"]


def file_results(folder: Path, *, require_manifest: bool = False) -> list[tuple[Path, str | None]]:
    """``[(file, problem or None)]`` of one checkpoint folder, full checksums; parts are listed file by file."""
    try:
        manifest = read_manifest(folder)
    except ValueError as e:
        return [(folder / MANIFEST_NAME, str(e).split(": ", 1)[-1])]
    if manifest is None:
        if require_manifest:
            return [(folder / MANIFEST_NAME, "missing: the save did not finish (a manifest is written last)")]
        return [(p.path, p.what) for p in verify_folder(folder)]  # structural checks of an older checkpoint
    results = [(folder / rel, check_file(folder / rel, entry, True)) for rel, entry in sorted(manifest["files"].items())]
    for part in manifest.get("parts", []):
        results += file_results(folder / part, require_manifest=True)
    return results


def checkpoint_targets(target: Path) -> tuple[Path, dict[int | None, Path]]:
    """(the checkpoint folder, {step: folder}) for a default_local_dir, one global_step_N, or any folder."""
    steps = step_folders(target)
    if steps:
        return target, dict(steps)
    step = step_of(target)
    if step is not None:
        return target.parent, {step: target}
    if has_manifest(target):
        return target.parent, {None: target}
    return target, {}


def check_checkpoints(target: str | Path, out=None) -> int:
    """Print each checkpoint's per-file results under ``target``; 0 when all are intact, 1 otherwise."""
    out = out or sys.stdout
    target = Path(target).expanduser().absolute()
    t0 = time.perf_counter()
    ckpt_dir, folders = checkpoint_targets(target)
    if not folders:
        print(f"verl-ds4 doctor: {target}: no checkpoint to check (expected a trainer.default_local_dir with "
              f"global_step_N folders, one global_step_N, or a folder holding {MANIFEST_NAME}); fix the path",
              file=sys.stderr)
        return 1
    damaged = files = 0
    for step, folder in folders.items():
        covered = step is not None and manifest_since(ckpt_dir) is not None and step >= manifest_since(ckpt_dir)
        if not folder.is_dir():
            results = [(folder, "missing (no such folder)")]
        else:
            results = file_results(folder, require_manifest=covered)
        bad = [(p, what) for p, what in results if what is not None]
        kind = "intact" if has_manifest(folder) else "no manifest (an older checkpoint): structural checks only"
        print(f"{folder}: {'DAMAGED' if bad else kind}", file=out)
        if has_manifest(folder):
            for path, what in results:
                files += 1
                rel = path.relative_to(folder) if path.is_relative_to(folder) else path
                print(f"  {'ok     ' if what is None else 'DAMAGED'} {rel}" + (f": {what}" if what else ""), file=out)
        else:
            for path, what in bad:
                print(f"  DAMAGED {path}: {what}", file=out)
        damaged += bool(bad)
    print(f"checked {len(folders)} checkpoint(s), {files} file(s) with checksums, in "
          f"{time.perf_counter() - t0:.2f} s: {damaged} damaged", file=out)
    if damaged:
        print("fix: resume from an intact checkpoint (RESUME_MODE=auto skips damaged ones), or restore the damaged "
              "files from a copy", file=out)
    return 1 if damaged else 0
