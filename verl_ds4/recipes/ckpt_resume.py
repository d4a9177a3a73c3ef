"""Which checkpoint a start resumes from, verified before anything loads it.

verl resumes from the ``global_step_N`` that ``latest_checkpointed_iteration.txt`` names (a tracker that
names a missing folder makes verl start from scratch without a word), and a damaged one fails minutes
later inside Megatron's loader. :func:`choose_resume` checks it against its manifest
(:mod:`verl_ds4.ckpt_manifest`) first:

* ``resume_mode=auto``: a damaged or unfinished checkpoint is skipped for the newest intact one, loudly
  (what is wrong, which file, which step is used); the damaged folders newer than it are renamed to
  ``damaged_global_step_N`` (nothing is deleted) and the tracker is set to the step used. A step whose
  manifest is whole but that the tracker does not name yet (a save stopped between the two) is used.
  Checkpoints but no intact one: refused (never a silent start from scratch).
* an explicit ``resume_from_path``: refused with the file and the fix when damaged.
* a checkpoint written before manifests existed: structural checks only, said once.

``python -m verl_ds4.recipes.ckpt_resume [--full] -- OVERRIDES...`` is the launchers' start-up check
(reads ``trainer.default_local_dir``, ``trainer.resume_mode``, ``trainer.resume_from_path`` from the
trainer's overrides; no model, no process group); exit 2 with the reason on a refusal.
``python -m verl_ds4.recipes.ckpt_resume --check DIR`` is ``verl-ds4 doctor --checkpoint DIR``
(:func:`verl_ds4.engine.ckpt_doctor.check_checkpoints`): the same report, changes nothing.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

from verl_ds4.ckpt_manifest import TRACKER_NAME as TRACKER
from verl_ds4.ckpt_manifest import CheckpointDamagedError, has_manifest, manifest_since, step_folders, step_of, verify_step

__all__ = ["CheckpointDamagedError", "Resume", "choose_resume", "main"]



@dataclasses.dataclass
class Resume:
    """What :func:`choose_resume` decided (``folder`` None: a fresh start)."""

    folder: Path | None
    step: int | None = None
    messages: list[str] = dataclasses.field(default_factory=list)
    moved: list[tuple[Path, Path]] = dataclasses.field(default_factory=list)  # (damaged folder, where it went)
    tracker_set: int | None = None
    seconds: float = 0.0


def _read_tracker(ckpt_dir: Path) -> tuple[int | None, str | None]:
    path = ckpt_dir / TRACKER
    if not path.is_file():
        return None, None
    text = path.read_text().strip()
    try:
        return int(text), None
    except ValueError:
        return None, f"{path}: holds {text[:40]!r}, not a step number"


def _write_tracker(ckpt_dir: Path, step: int) -> None:
    tmp = ckpt_dir / (TRACKER + ".tmp")
    tmp.write_text(str(step))
    os.replace(tmp, ckpt_dir / TRACKER)


def _problems_text(problems) -> str:
    shown = [f"  - {p}" for p in problems[:8]]
    if len(problems) > 8:
        shown.append(f"  - ... and {len(problems) - 8} more")
    return "\n".join(shown)


def _legacy_note(folder: Path, ckpt_dir: Path) -> str | None:
    if has_manifest(folder) or manifest_since(ckpt_dir) is not None:
        return None
    return (f"verl-ds4: note: {folder} has no manifest (written before verl-ds4 wrote them): it is loaded after "
            "the structural checks only (torch files complete, dist-checkpoint metadata present)")


def _explicit(path: Path, full: bool) -> Resume:
    ckpt_dir = path.parent
    step = step_of(path)
    problems = verify_step(ckpt_dir, step if step is not None else -1, path, full=full)
    if problems:
        intact = [s for s in reversed(step_folders(ckpt_dir)) if s != step and not verify_step(ckpt_dir, s, full=full)]
        hint = f" (the newest intact one there: {ckpt_dir / f'global_step_{intact[0]}'})" if intact else ""
        raise CheckpointDamagedError(
            f"verl-ds4: refusing to resume from {path}: the checkpoint is damaged or unfinished:\n"
            f"{_problems_text(problems)}\n"
            f"Fix: point trainer.resume_from_path (launcher RESUME_FROM) at an intact checkpoint{hint}, or use "
            "trainer.resume_mode=auto (RESUME_MODE=auto), which skips damaged checkpoints for the newest intact one."
        )
    note = _legacy_note(path, ckpt_dir)
    return Resume(path, step, [note] if note else [])


def choose_resume(ckpt_dir, mode: str = "auto", resume_from_path=None, *, full: bool = False,
                  apply: bool = True) -> Resume:
    """Verify the checkpoint a start would resume from; with ``mode="auto"`` fall back to the newest intact one.

    ``apply=False`` decides without renaming folders or rewriting the tracker. Raises
    :class:`CheckpointDamagedError` on a refusal (see the module docstring).
    """
    t0 = time.perf_counter()
    if mode not in ("auto", "resume_path", "disable"):
        raise CheckpointDamagedError(
            f"verl-ds4: trainer.resume_mode={mode!r}: expected auto, resume_path or disable (launcher RESUME_MODE)"
        )
    if mode == "disable":
        return Resume(None)
    if resume_from_path not in (None, "", "null"):
        result = _explicit(Path(str(resume_from_path)).expanduser().absolute(), full)
        result.seconds = time.perf_counter() - t0
        return result
    if mode == "resume_path":
        raise CheckpointDamagedError(
            "verl-ds4: trainer.resume_mode=resume_path needs trainer.resume_from_path (launcher RESUME_FROM): "
            "set it to a global_step_N folder, or use RESUME_MODE=auto"
        )
    ckpt_dir = Path(str(ckpt_dir)).expanduser().absolute()
    steps = step_folders(ckpt_dir)
    tracked, tracker_problem = _read_tracker(ckpt_dir)
    result = Resume(None)
    if not steps:
        if tracked is not None or tracker_problem:
            raise CheckpointDamagedError(
                f"verl-ds4: refusing to start: {ckpt_dir / TRACKER} names step {tracked if tracked is not None else '?'}"
                f" but {ckpt_dir} holds no global_step_N folder (verl would start from scratch without a word).\n"
                "Fix: restore the checkpoints there, or start fresh with trainer.resume_mode=disable "
                "(RESUME_MODE=disable) or a new trainer.default_local_dir (WORK_DIR=...)"
            )
        result.seconds = time.perf_counter() - t0
        return result
    problems = {}
    chosen = None
    for step in reversed(steps):  # newest first
        found = verify_step(ckpt_dir, step, steps[step], full=full)
        if not found:
            # Newer than the tracker: only a whole manifest says the save finished before the tracker was written.
            if tracked is None or step <= tracked or has_manifest(steps[step]):
                chosen = step
                break
            found = [f"{steps[step]}: newer than the tracker ({tracked}) and has no manifest: an unfinished save"]
        problems[step] = found
    if tracker_problem:
        result.messages.append(f"verl-ds4: {tracker_problem}")
    if tracked is not None and tracked not in steps:
        result.messages.append(f"verl-ds4: {ckpt_dir / TRACKER} names step {tracked}, but {ckpt_dir / f'global_step_{tracked}'} "
                               "does not exist (verl would start from scratch)")
    for step, found in problems.items():
        result.messages.append(f"verl-ds4: checkpoint {steps[step]} is damaged or unfinished:\n{_problems_text(found)}")
    if chosen is None:
        raise CheckpointDamagedError(
            "\n".join(result.messages) + f"\nverl-ds4: refusing to start: no intact checkpoint in {ckpt_dir} "
            "(resume_mode=auto would otherwise start from scratch).\nFix: restore an intact checkpoint there, or "
            "start fresh with trainer.resume_mode=disable (RESUME_MODE=disable) or a new trainer.default_local_dir "
            "(WORK_DIR=...)"
        )
    result.folder, result.step = steps[chosen], chosen
    if problems or tracked != chosen:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for step in problems:
            target = ckpt_dir / f"damaged_global_step_{step}_{stamp}"
            result.moved.append((steps[step], target))
        result.tracker_set = chosen
        result.messages.append(
            f"verl-ds4: resume_mode=auto: resuming from {steps[chosen]} (step {chosen}), the newest intact checkpoint"
            + (f"; the damaged ones are renamed to damaged_global_step_N_{stamp} (delete them when you no longer "
               "need them)" if problems else "")
            + f"; {TRACKER} set to {chosen}"
        )
        if apply:
            for source, target in result.moved:
                os.replace(source, target)
            _write_tracker(ckpt_dir, chosen)
    note = _legacy_note(result.folder, ckpt_dir)
    if note:
        result.messages.append(note)
    result.seconds = time.perf_counter() - t0
    return result


def _override(overrides: list[str], key: str):
    value = None
    for arg in overrides:
        name, sep, text = arg.lstrip("+").partition("=")
        if sep and name == key:
            value = text
        elif arg == f"~{key}":
            value = None
    return value


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Verify the checkpoint a start resumes from (before anything loads it).")
    parser.add_argument("--full", action="store_true", help="re-read the bytes (checksums), not only the sizes")
    parser.add_argument("--check", metavar="DIR", help="only report: verl-ds4 doctor --checkpoint DIR (every "
                        "global_step_N in DIR, or one checkpoint folder, file by file with checksums; changes "
                        "nothing; exit 1 if one is damaged or there is nothing to check)")
    parser.add_argument("overrides", nargs="*", help="the trainer's Hydra overrides (after --)")
    args = parser.parse_args(argv)
    if args.check:
        from verl_ds4.engine.ckpt_doctor import check_checkpoints  # one full check: the doctor's

        return check_checkpoints(args.check)
    ckpt_dir = _override(args.overrides, "trainer.default_local_dir")
    mode = _override(args.overrides, "trainer.resume_mode") or "auto"
    path = _override(args.overrides, "trainer.resume_from_path")
    if ckpt_dir is None and path in (None, "", "null"):
        print("verl-ds4: checkpoint check skipped: no trainer.default_local_dir in the overrides")
        return 0
    try:
        result = choose_resume(ckpt_dir, mode, path, full=args.full)
    except CheckpointDamagedError as e:
        print(str(e), file=sys.stderr)
        return 2
    for message in result.messages:
        print(message, file=sys.stderr)
    where = f"{result.folder} (intact)" if result.folder is not None else "none (a fresh start)"
    print(f"[verl-ds4] checkpoint check: resume from {where}, checked in {result.seconds:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
