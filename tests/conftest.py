"""Shared fixtures.

``restore_verl_hooks``: tests that install, uninstall or re-register verl-ds4's global patches on
verl (the hooks of :mod:`verl_ds4.engine.megatron`, the engine registrations of
:mod:`verl_ds4.engine.plugin`) leave them as they found them, so the test files pass in any order
(``tests/test_hook_order_on_cpu.py`` runs them shuffled).
"""

from __future__ import annotations

import pytest


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
