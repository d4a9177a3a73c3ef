"""The extended proofs: slow end-to-end tests kept out of the README's test command (CI's 40-minute budget).

A test marked ``@pytest.mark.extended`` is skipped by ``bash scripts/dev.sh test`` with the command that runs it;
``bash benchmarks/extended_proofs.sh`` runs every one of them (``VERL_DS4_EXTENDED=1``) and writes what they printed
and their times to ``benchmarks/results/extended_proofs.txt``, which is committed. Each is a variant of a proof that
CI still runs in a shorter form (docs/benchmarks.md, "Extended proofs", says which covers which).
"""

from __future__ import annotations

import os

ENV = "VERL_DS4_EXTENDED"
COMMAND = "bash benchmarks/extended_proofs.sh"
REASON = (f"an extended proof (slow, outside the README's test command): {COMMAND} runs it ({ENV}=1); its last result "
          "is in benchmarks/results/extended_proofs.txt")


def enabled() -> bool:
    """Whether this pytest run includes the extended proofs (``VERL_DS4_EXTENDED=1``)."""
    value = os.environ.get(ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value}: expected 1 (run the extended proofs) or 0 (skip them, the default)")
    return value == "1"


def proven_commits() -> tuple[str, ...]:
    """The Megatron-LM dev commits a comparison with dev runs at: the pin in CI, every proven commit when extended."""
    from verl_ds4.substitutes import megatron_dev

    return megatron_dev.PROVEN_COMMITS if enabled() else (megatron_dev.DEFAULT_COMMIT,)


def commit_params(commits: tuple[str, ...]) -> list:
    """``commits`` as pytest parameters; a commit other than the pin is marked ``extended`` (``-m extended``)."""
    import pytest

    from verl_ds4.substitutes import megatron_dev

    return [c if c == megatron_dev.DEFAULT_COMMIT else pytest.param(c, marks=pytest.mark.extended) for c in commits]
