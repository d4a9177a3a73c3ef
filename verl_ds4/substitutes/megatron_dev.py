"""Find, unpack and check a Megatron-LM ``dev`` source tree (the code a GPU run executes).

The GPU image installs Megatron-LM ``dev`` at a pinned commit; a CPU machine has only the released
megatron-core (no DS4). The production-path proofs import ``dev``'s ``megatron/core`` (and
``megatron/training``, which Megatron-Bridge imports) from a ``git archive`` export instead:

1. ``MEGATRON_DEV_DIR`` (a folder holding ``megatron/core``), when set;
2. else an export already unpacked under :data:`UNPACK_ROOT` (``benchmarks/gpu/carry/megatron_dev_<commit>``);
3. else a ``megatron-lm-<commit>.tar.gz`` archive in ``../shared/third_party/megatron-lm-dev/`` beside the
   repository (CI has one), unpacked into (2) on first use.

Each tree is identified by its commit (a ``COMMIT`` file that :func:`unpack` writes, or the archive's
name); only :data:`PROVEN_COMMITS` are accepted (:func:`check_commit`): another commit is refused at
start-up with what differs and the fix. ``benchmarks/gpu/prepare_megatron_dev.sh`` makes an export on a
machine with a Megatron-LM mirror.
"""

from __future__ import annotations

import os
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ARCHIVE_DIR",
    "DEFAULT_COMMIT",
    "MegatronDevError",
    "MegatronDevTree",
    "PROVEN_COMMITS",
    "UNPACK_ROOT",
    "available",
    "roots_on_path",
    "check_commit",
    "find",
    "make_command",
    "unpack",
    "use",
]

#: Megatron-LM ``dev`` commits the production-path proofs ran on (newest last). The image pins the default, the newest.
PROVEN_COMMITS = ("12eed0a5ac3f1ced6a3a4f76727db530bdbf7391", "d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1")
DEFAULT_COMMIT = PROVEN_COMMITS[-1]

REPO = Path(__file__).resolve().parents[2]
#: Where archives are unpacked (git-ignored: benchmarks/gpu/carry/).
UNPACK_ROOT = REPO / "benchmarks" / "gpu" / "carry"
#: The exports that CI and the project's machines have beside the repository.
ARCHIVE_DIR = REPO.parent / "shared" / "third_party" / "megatron-lm-dev"


class MegatronDevError(RuntimeError):
    """A Megatron-LM dev tree that is missing, or not one of the proven commits."""


@dataclass(frozen=True)
class MegatronDevTree:
    """One Megatron-LM ``dev`` source tree: ``root`` holds ``megatron/core`` (and ``megatron/training``)."""

    root: Path
    commit: str

    @property
    def short(self) -> str:
        return self.commit[:8]

    @property
    def tests(self) -> Path:
        """Megatron's own DS4 attention tests (their pure-PyTorch references), when the export has them."""
        return self.root / "tests" / "unit_tests" / "transformer" / "experimental_attention_variant"


def make_command(commit: str = DEFAULT_COMMIT) -> str:
    """The command that makes an export, for skip and error messages."""
    return (f"tar -xzf ../shared/third_party/megatron-lm-dev/megatron-lm-{commit}.tar.gz -C {_unpacked(commit)}"
            f" (or: MEGATRON_LM_COMMIT={commit} bash benchmarks/gpu/prepare_megatron_dev.sh, or set MEGATRON_DEV_DIR)")


def _unpacked(commit: str) -> Path:
    return UNPACK_ROOT / f"megatron_dev_{commit[:8]}"


def _archive(commit: str) -> Path:
    return ARCHIVE_DIR / f"megatron-lm-{commit}.tar.gz"


def _full(commit: str) -> str:
    matches = [c for c in PROVEN_COMMITS if c.startswith(commit)] if len(commit) >= 7 else []
    if len(matches) != 1:
        raise MegatronDevError(
            f"Megatron-LM dev commit {commit!r} is not one the production path was proven on "
            f"({', '.join(c[:12] for c in PROVEN_COMMITS)}); use one of those (MEGATRON_LM_COMMIT=...).")
    return matches[0]


def check_commit(tree_commit: str, where: Path) -> str:
    """Refuse a tree whose commit is not proven; returns the full commit."""
    if tree_commit not in PROVEN_COMMITS:
        raise MegatronDevError(
            f"the Megatron-LM dev tree at {where} is commit {tree_commit or '(unknown: no COMMIT file)'}, and the "
            f"production path was proven on {', '.join(c[:12] for c in PROVEN_COMMITS)} only. Its DS4 code may differ "
            f"from what the CPU substitutes were checked against. Export a proven commit: {make_command()}")
    return tree_commit


def unpack(commit: str = DEFAULT_COMMIT, archive: Path | None = None) -> MegatronDevTree:
    """Unpack the archive of ``commit`` into :data:`UNPACK_ROOT` (once) and return the tree."""
    commit = _full(commit)
    dest = _unpacked(commit)
    if (dest / "COMMIT").is_file() and (dest / "megatron" / "core").is_dir():
        return MegatronDevTree(dest, check_commit((dest / "COMMIT").read_text().strip(), dest))
    archive = archive or _archive(commit)
    if not archive.is_file():
        raise MegatronDevError(f"no Megatron-LM dev export of {commit[:12]} at {dest} and no archive at {archive}. "
                               f"Make one: {make_command(commit)}")
    # Extract into a folder of this process's own, then rename it into place: two processes (the two test lanes)
    # may unpack the same commit at once, and a killed unpack leaves only its own partial folder.
    import shutil
    import tempfile

    UNPACK_ROOT.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=dest.name + ".partial-", dir=UNPACK_ROOT))
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(partial, filter="data")
        (partial / "COMMIT").write_text(commit + "\n")
        if dest.exists() and not (dest / "COMMIT").is_file():
            shutil.rmtree(dest)  # an incomplete tree of an older layout (never another process's: it renames whole)
        try:
            partial.rename(dest)
        except OSError:
            if not (dest / "COMMIT").is_file():
                raise  # not another process's finished tree: say why
    finally:
        if partial.exists():
            shutil.rmtree(partial)  # another process's rename won; its tree is the same archive
    return MegatronDevTree(dest, commit)


def find(commit: str = DEFAULT_COMMIT) -> MegatronDevTree:
    """The tree of ``commit``: ``MEGATRON_DEV_DIR`` (its ``COMMIT`` file must name a proven commit), else the
    unpacked export, else the archive unpacked now. Raises :class:`MegatronDevError` with the command that makes
    one when none is found."""
    env = os.environ.get("MEGATRON_DEV_DIR")
    if env:
        root = Path(env)
        if not (root / "megatron" / "core").is_dir():
            raise MegatronDevError(f"MEGATRON_DEV_DIR={env} holds no megatron/core; point it at an export "
                                   f"({make_command(commit)})")
        marker = root / "COMMIT"
        return MegatronDevTree(root, check_commit(marker.read_text().strip() if marker.is_file() else "", root))
    return unpack(commit)


def available(commit: str = DEFAULT_COMMIT) -> bool:
    """Whether :func:`find` can return a tree without raising (for test skips)."""
    try:
        commit = _full(commit)
    except MegatronDevError:
        return False
    if os.environ.get("MEGATRON_DEV_DIR"):
        return (Path(os.environ["MEGATRON_DEV_DIR"]) / "megatron" / "core").is_dir()
    return (_unpacked(commit) / "COMMIT").is_file() or _archive(commit).is_file()


def roots_on_path() -> list[str]:
    """The ``sys.path`` entries that hold a Megatron-LM dev tree (one with DeepSeek-V4's attention)."""
    marker = Path("megatron", "core", "transformer", "experimental_attention_variant", "deepseek_v4_hybrid_attention.py")
    return [p for p in sys.path if p and (Path(p) / marker).is_file()]


def use(tree: MegatronDevTree) -> None:
    """Put ``tree`` first on ``sys.path`` so ``import megatron.core`` is dev's. Refuses when another
    ``megatron.core`` is already imported (one process runs one Megatron)."""
    loaded = sys.modules.get("megatron.core")
    if loaded is not None:
        where = Path(getattr(loaded, "__file__", "") or "").resolve()
        if tree.root.resolve() not in where.parents:
            raise MegatronDevError(f"megatron.core is already imported from {where}; import Megatron-LM dev "
                                   f"({tree.root}) in a fresh process, before anything imports megatron")
        return
    if str(tree.root) not in sys.path:
        sys.path.insert(0, str(tree.root))


def main(argv: list[str] | None = None) -> int:
    """``python -m verl_ds4.substitutes.megatron_dev --print-root [--commit C]``: the tree's folder (unpacked from
    the export now if needed), or the error with the command that makes one (exit 2)."""
    import argparse

    parser = argparse.ArgumentParser(description="Find (unpack if needed) a Megatron-LM dev export the production path "
                                                 "was proven on and print its folder.")
    parser.add_argument("--print-root", action="store_true", help="print the tree's folder (MEGATRON_DEV_DIR's value)")
    parser.add_argument("--commit", default=DEFAULT_COMMIT, help=f"a proven commit (default {DEFAULT_COMMIT[:12]})")
    args = parser.parse_args(argv)
    try:
        tree = find(args.commit)
    except MegatronDevError as e:
        print(f"[verl-ds4] {e}", file=sys.stderr)  # error-catalogue: a MegatronDevError, catalogued where raised
        return 2
    print(tree.root if args.print_root else f"{tree.root} (Megatron-LM dev {tree.commit[:12]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
