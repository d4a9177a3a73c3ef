"""The tests' rule for a Megatron-LM dev export: use it where one can be found, skip with the command that makes one
where not (a user's machine), and never skip in CI when the archives are beside the repository."""

from __future__ import annotations

import os

import pytest

from verl_ds4.substitutes import megatron_dev

__all__ = ["export_mark", "production_marks", "tree"]


def export_mark(*commits: str):
    """A ``skipif`` mark for tests that need the exports of ``commits`` (default: the image's pin); raises in CI when
    the archives are there but an export cannot be made (a skip there would hide the comparison)."""
    commits = commits or (megatron_dev.DEFAULT_COMMIT,)
    missing = [c for c in commits if not megatron_dev.available(c)]
    if missing and os.environ.get("CI") == "true" and megatron_dev.ARCHIVE_DIR.is_dir():
        raise RuntimeError(f"CI has {megatron_dev.ARCHIVE_DIR} but no export of {', '.join(c[:12] for c in missing)}: "
                           "the tests that compare with Megatron-LM dev must not be skipped there")
    return pytest.mark.skipif(bool(missing), reason=(
        f"no Megatron-LM dev export of {', '.join(c[:12] for c in missing)}: {megatron_dev.make_command(missing[0])}"
        if missing else ""))


def tree(commit: str = megatron_dev.DEFAULT_COMMIT) -> megatron_dev.MegatronDevTree:
    """The export of ``commit`` (unpacked on first use)."""
    return megatron_dev.find(commit)


def production_marks(*commits: str) -> list:
    """The marks of a production-path test file (Megatron-LM dev's DS4 built by Megatron-Bridge): skip where the
    production path cannot run (not Python 3.12, no Megatron-Bridge with its DS4 bridge: the reason says what to
    install), then the export rule of :func:`export_mark` for ``commits``."""
    from verl_ds4.substitutes.environment import require_bridge

    try:
        require_bridge()
    except RuntimeError as err:
        return [pytest.mark.skip(reason=f"the production path cannot run here: {err}")]
    return [export_mark(*commits)]
