"""Checkpoint manifests: a checkpoint is *intact* when it ends with a manifest that its files still match.

Standard library only (floor 0): the launchers' start-up check reads it in seconds, before any model or
process group exists.

* :func:`write_manifest` - written **last** into a finished checkpoint folder (after every rank wrote its
  files): every file under the folder (relative path, size, a CRC-32 of a few sampled 64 KiB blocks; the
  CRC-32 of the whole file when ``full=True`` or ``VERL_DS4_CKPT_CHECKSUM=full``), written to a temporary
  name and renamed, so a manifest is either whole or absent. A sub-folder that holds its own manifest (an
  RL step's ``actor/`` and ``critic/``) is listed as a *part* and not repeated.
* :func:`verify_folder` - the problems of one checkpoint folder, each naming the file: by default sizes
  only (a ``stat`` per file); ``full=True`` re-reads the sampled blocks and, where the manifest has them,
  whole-file CRC-32s (``verl-ds4 doctor --checkpoint DIR``). A folder without a manifest is a *legacy*
  checkpoint (written before manifests existed): only the cheap structural checks run (``torch.save``
  files end with their zip directory; verl's ``ckpt_contents.json`` and Megatron's ``metadata.json``
  where a ``dist_ckpt`` folder is). In a checkpoint folder whose marker (:data:`MARKER_NAME`) says
  manifests were written since step S, a step >= S without a manifest is an unfinished save.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
import zlib
from pathlib import Path

__all__ = [
    "CheckpointDamagedError",
    "MANIFEST_NAME",
    "MARKER_NAME",
    "Problem",
    "check_file",
    "read_manifest",
    "manifest_since",
    "mark_manifests_since",
    "TRACKER_NAME",
    "step_folders",
    "step_of",
    "verify_folder",
    "write_manifest",
]

MANIFEST_NAME = "verl_ds4_manifest.json"
TRACKER_NAME = "latest_checkpointed_iteration.txt"  # verl's tracker (verl.utils.checkpoint.checkpoint_manager)
MARKER_NAME = "verl_ds4_manifests.json"  # in trainer.default_local_dir: {"since_step": S}
FORMAT = "verl-ds4 checkpoint manifest"
VERSION = 1
BLOCK = 1 << 16  # bytes per sampled block
SAMPLES = 4  # sampled blocks per file: the first, the last, and evenly spaced between
_STEP = re.compile(r"^global_step_(\d+)$")
# Files that are not part of a checkpoint's state (written beside it, or by this module).
_SKIP = {MANIFEST_NAME, MANIFEST_NAME + ".tmp"}


class CheckpointDamagedError(ValueError):
    """A checkpoint that would be loaded is damaged or unfinished (the message names the file and the fix)."""


@dataclasses.dataclass(frozen=True)
class Problem:
    """One reason a checkpoint folder is not intact: the file and what is wrong with it."""

    path: Path
    what: str

    def __str__(self) -> str:
        return f"{self.path}: {self.what}"


def _sample_offsets(size: int) -> list[int]:
    if size <= SAMPLES * BLOCK:
        return [0] if size else []
    last = size - BLOCK
    return sorted({round(i * last / (SAMPLES - 1)) for i in range(SAMPLES)})


def sampled_crc32(path: Path, size: int) -> int:
    """CRC-32 over the sampled blocks of a file of ``size`` bytes (the whole file when it is small)."""
    crc = 0
    with open(path, "rb") as f:
        for offset in _sample_offsets(size):
            f.seek(offset)
            crc = zlib.crc32(f.read(BLOCK if size > SAMPLES * BLOCK else size), crc)
    return crc


def full_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            crc = zlib.crc32(chunk, crc)
    return crc


def _walk(folder: Path) -> tuple[list[Path], list[str]]:
    """(files, parts): the files under ``folder``, skipping sub-folders with their own manifest (parts)."""
    files: list[Path] = []
    parts: list[str] = []
    for root, dirs, names in os.walk(folder):
        root_path = Path(root)
        for d in list(dirs):
            if (root_path / d / MANIFEST_NAME).is_file():
                parts.append((root_path / d).relative_to(folder).as_posix())
                dirs.remove(d)
        files += [root_path / n for n in names if not (root_path == folder and n in _SKIP)]
    return sorted(files), sorted(parts)


def _full_requested(full: bool | None) -> bool:
    if full is not None:
        return full
    return os.environ.get("VERL_DS4_CKPT_CHECKSUM", "").strip().lower() == "full"


def write_manifest(folder: str | Path, *, global_step: int | None = None, full: bool | None = None,
                   written_by: str = "verl-ds4") -> Path:
    """Write :data:`MANIFEST_NAME` into a finished checkpoint ``folder`` (atomically) and return its path.

    Call it once every rank has finished writing into ``folder``, and before the tracker names it.
    """
    folder = Path(folder)
    full = _full_requested(full)
    files, parts = _walk(folder)
    entries = {}
    for path in files:
        size = path.stat().st_size
        entry = {"size": size, "sample_crc32": sampled_crc32(path, size)}
        if full:
            entry["crc32"] = full_crc32(path)
        entries[path.relative_to(folder).as_posix()] = entry
    manifest = {
        "format": FORMAT, "version": VERSION, "global_step": global_step, "written_by": written_by,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "checksum": "crc32 full" if full else f"crc32 of {SAMPLES} sampled {BLOCK}-byte blocks",
        "files": entries, "parts": parts,
    }
    out = folder / MANIFEST_NAME
    tmp = folder / (MANIFEST_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return out


def read_manifest(folder: Path) -> dict | None:
    """The manifest of ``folder`` (None when there is none); a manifest that cannot be read raises ValueError."""
    path = folder / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable manifest ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{path}: not a {FORMAT} (format {manifest.get('format') if isinstance(manifest, dict) else '?'!r})")
    return manifest


def check_file(path: Path, entry: dict, full: bool) -> str | None:
    """What is wrong with one file against its manifest ``entry`` (None: it matches)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"missing (the manifest lists {entry['size']} bytes)"
    if size != entry["size"]:
        return f"{size} bytes, the manifest says {entry['size']} (cut short or rewritten)"
    if full:
        if sampled_crc32(path, size) != entry["sample_crc32"]:
            return "its bytes differ from the manifest's checksum (sampled blocks)"
        if "crc32" in entry and full_crc32(path) != entry["crc32"]:
            return "its bytes differ from the manifest's checksum (whole file)"
    return None


def _verify_against(folder: Path, manifest: dict, full: bool) -> list[Problem]:
    problems = []
    for rel, entry in sorted(manifest["files"].items()):
        what = check_file(folder / rel, entry, full)
        if what is not None:
            problems.append(Problem(folder / rel, what))
    for part in manifest.get("parts", []):
        problems += verify_folder(folder / part, full=full, require_manifest=True)
    return problems


def _zip_complete(path: Path) -> bool:
    """A ``torch.save`` file (a zip) that ends with its end-of-central-directory record."""
    size = path.stat().st_size
    if size < 22:
        return False
    with open(path, "rb") as f:
        f.seek(max(0, size - (1 << 16) - 22))
        return b"PK\x05\x06" in f.read()


def _legacy_problems(folder: Path) -> list[Problem]:
    problems = []
    for root, dirs, names in os.walk(folder):
        root_path = Path(root)
        if root_path.name == "dist_ckpt":
            for marker in ("metadata.json", ".metadata"):
                if marker not in names:
                    problems.append(Problem(root_path / marker, "missing: written when a dist-checkpoint save finished"))
        if "model" in dirs and "ckpt_contents.json" not in names:
            problems.append(Problem(root_path / "ckpt_contents.json", "missing: verl writes it last in an engine save"))
        for name in names:
            if name.endswith(".pt") and not _zip_complete(root_path / name):
                problems.append(Problem(root_path / name, "cut short (a torch.save file without its zip directory at the end)"))
    return problems


def verify_folder(folder: str | Path, *, full: bool = False, require_manifest: bool = False) -> list[Problem]:
    """The problems of checkpoint ``folder`` (an empty list: intact). See the module docstring."""
    folder = Path(folder)
    if not folder.is_dir():
        return [Problem(folder, "missing (no such folder)")]
    try:
        manifest = read_manifest(folder)
    except ValueError as e:
        return [Problem(folder / MANIFEST_NAME, str(e).split(": ", 1)[-1])]
    if manifest is None:
        if require_manifest:
            return [Problem(folder / MANIFEST_NAME, "missing: the save did not finish (a manifest is written last)")]
        return _legacy_problems(folder)
    return _verify_against(folder, manifest, full)


def has_manifest(folder: str | Path) -> bool:
    return (Path(folder) / MANIFEST_NAME).is_file()


def step_of(folder: str | Path) -> int | None:
    """``N`` of a ``global_step_N`` folder (None for any other name)."""
    match = _STEP.match(Path(folder).name)
    return int(match.group(1)) if match else None


def step_folders(ckpt_dir: str | Path) -> dict[int, Path]:
    """``{step: folder}`` of the ``global_step_N`` folders in ``ckpt_dir``."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return {}
    found = {int(m.group(1)): p for p in ckpt_dir.iterdir() if p.is_dir() and (m := _STEP.match(p.name))}
    return dict(sorted(found.items()))


def manifest_since(ckpt_dir: str | Path) -> int | None:
    """The first step saved with manifests in ``ckpt_dir`` (its marker), or None for a legacy folder."""
    path = Path(ckpt_dir) / MARKER_NAME
    try:
        return int(json.loads(path.read_text())["since_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def mark_manifests_since(ckpt_dir: str | Path, step: int) -> None:
    """Record in ``ckpt_dir`` that every save from ``step`` on ends with a manifest (kept if already earlier)."""
    ckpt_dir = Path(ckpt_dir)
    current = manifest_since(ckpt_dir)
    if current is not None and current <= step:
        return
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_dir / (MARKER_NAME + ".tmp")
    tmp.write_text(json.dumps({"since_step": step}) + "\n")
    os.replace(tmp, ckpt_dir / MARKER_NAME)


def verify_step(ckpt_dir: str | Path, step: int, folder: Path | None = None, *, full: bool = False) -> list[Problem]:
    """The problems of ``global_step_<step>`` in ``ckpt_dir``; a step the marker covers must have a manifest."""
    folder = Path(ckpt_dir) / f"global_step_{step}" if folder is None else folder
    since = manifest_since(ckpt_dir)
    return verify_folder(folder, full=full, require_manifest=since is not None and step >= since)
