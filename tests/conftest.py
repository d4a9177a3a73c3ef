"""Shared fixtures.

``extended``: a marker for the slow end-to-end proofs outside the README's test command (CI's 40-minute budget):
skipped here unless ``VERL_DS4_EXTENDED=1``; ``bash benchmarks/extended_proofs.sh`` runs them and commits their result
(:mod:`verl_ds4.testing.extended`).

``restore_verl_hooks``: tests that install, uninstall or re-register verl-ds4's global patches on
verl (the hooks of :mod:`verl_ds4.engine.megatron`, the engine registrations of
:mod:`verl_ds4.engine.plugin`) leave them as they found them, so the test files pass in any order
(``tests/test_hook_order_on_cpu.py`` runs them shuffled).

``LANE2_FILES``: the test files of the second test lane (``scripts/dev.sh test`` runs them again on
Python 3.12 with megatron-core 0.19.2, in ``.venv312``): the layout, mcore, engine, resolver and DS4
model tests, minus the ``slow`` ones. Their tests get the ``lane2`` marker, so ``pytest -m lane2``
selects that lane. Left to lane 1 only, to keep CI under 30 minutes: the balance planner
(``test_cp_balance``: NumPy, no Megatron), the engine plugin's subprocess checks, the engine
differential against verl's stock engine (four torchrun jobs, ~100 s; verl is the same 0.9.1 in both
lanes, and our engine's data paths on megatron-core 0.19.2 are ``test_engine_data_paths``), the
attention-only fidelity test (the full model's fidelity test runs in both) and the proxy.
The production-path tests (``test_production_*``: Megatron-LM dev's DS4 built by Megatron-Bridge, which needs
Python 3.12) are lane-2 files that skip in lane 1.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

LANE2_FILES = frozenset({
    "test_layout_plan_on_cpu.py",
    "test_thd_differential_on_cpu.py",
    "test_megatron_api_on_cpu.py",
    "test_layout_resolver_on_cpu.py",
    "test_host_transfers_on_cpu.py",
    "test_engine_data_paths_on_cpu.py",
    "test_ds4_model_parts_on_cpu.py",
    "test_ds4_model_fidelity_on_cpu.py",
    "test_ds4_cp_parity_on_cpu.py",
    "test_ds4_mtp_indexer_loss_on_cpu.py",
    "test_ds4_router_replay_on_cpu.py",
    "test_ds4_hf_checkpoint_on_cpu.py",
    "test_dynamic_cp_scheduler_on_cpu.py",
    # the production path (Megatron-LM dev + Megatron-Bridge, Python 3.12): run in lane 2, skipped in lane 1
    "test_production_path_on_cpu.py",
    "test_production_cp_parity_on_cpu.py",
    "test_production_engine_on_cpu.py",
    "test_production_rl_on_cpu.py",
})  # fmt: skip


def _lane2_only() -> bool:
    return os.environ.get("VERL_DS4_TEST_LANE") == "2"


def pytest_ignore_collect(collection_path, config):
    """Lane 2 does not import the other test files (their imports may need what lane 1 has)."""
    if _lane2_only() and collection_path.name.startswith("test_") and collection_path.suffix == ".py":
        return collection_path.name not in LANE2_FILES or None
    return None


def pytest_collection_modifyitems(config, items):
    """Mark the lane-2 tests; with ``VERL_DS4_TEST_LANE=2`` (lane 2 of ``scripts/dev.sh test``) keep only them.
    Skip the ``extended`` proofs unless ``VERL_DS4_EXTENDED=1`` (:mod:`verl_ds4.testing.extended`)."""
    from verl_ds4.testing import extended

    if not extended.enabled():
        for item in items:
            if item.get_closest_marker("extended"):
                item.add_marker(pytest.mark.skip(reason=extended.REASON))
    for item in items:
        if Path(str(item.fspath)).name in LANE2_FILES:
            item.add_marker(pytest.mark.lane2)
    if _lane2_only():
        # Lane 2 also leaves out the ``slow`` tests (CP = 8 parity, the 8-rank THD differential): lane 1 runs them,
        # and CI's time is shared.
        other = [item for item in items
                 if Path(str(item.fspath)).name not in LANE2_FILES or item.get_closest_marker("slow")]
        if other:
            config.hook.pytest_deselected(items=other)
            dropped = set(map(id, other))
            items[:] = [item for item in items if id(item) not in dropped]


@pytest.fixture
def restore_verl_hooks():
    """Yield :mod:`verl_ds4.engine.megatron`; afterwards put hooks and registrations back as before."""
    from verl_ds4.engine import megatron as engines
    from verl_ds4.engine import plugin

    hooked_before = all(engines.hooks_installed().values())
    registered_before = list(plugin.STATE.registered)
    yield engines
    if registered_before and plugin.STATE.registered != registered_before:
        plugin.register_engines()
    if hooked_before:
        engines.install_verl_hooks()
    elif any(engines.hooks_installed().values()):
        engines.uninstall_verl_hooks()


@pytest.fixture(autouse=True)
def _transformer_engine_env_restored():
    """Megatron-Core sets ``NVTE_FLASH_ATTN`` / ``NVTE_FUSED_ATTN`` / ``NVTE_UNFUSED_ATTN`` in ``os.environ`` when it
    builds a language model (``LanguageModule._set_attention_backend``, from the config's attention backend), and
    refuses to build a model whose backend disagrees with values already there. A model built in the pytest process
    would leak them into every later test and its subprocesses (the production path's verl overrides ask for the flash
    backend: a leaked ``NVTE_FUSED_ATTN=1`` from an ``auto`` model refused it). Each test gets them back as they were."""
    names = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
    before = {name: os.environ.get(name) for name in names}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
