"""verl resolves ``strategy=megatron`` to verl-ds4's engines through the ``verl.plugins`` entry point.

The subprocess tests start fresh interpreters (as a Ray worker would) with the installed package:
nothing is imported or registered by hand. ``VERL_ENGINE_DEVICE=cuda`` / ``VERL_ENGINE_VENDOR=nvidia``
make verl's registry answer as it does on an NVIDIA GPU machine.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

GPU_ENV = {"VERL_ENGINE_DEVICE": "cuda", "VERL_ENGINE_VENDOR": "nvidia", "VERL_DS4_LOG_LEVEL": "INFO"}


def _python(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **GPU_ENV, **env}
    full_env.pop("VERL_DS4_DISABLE_ENGINE", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env, timeout=300
    )


RESOLVE = """
    import sys
    import verl
    print("megatron imported by `import verl`:", "megatron.core" in sys.modules)
    from verl.workers.engine import EngineRegistry
    for model_type in ("language_model", "value_model"):
        cls = EngineRegistry.get_engine_cls(model_type, "megatron")
        print(model_type, cls.__module__ + "." + cls.__qualname__)
"""
DOCTOR = """
    from verl_ds4.cli import main
    print("doctor exit status", main(["doctor"]))
"""


def test_fresh_process_resolves_megatron_to_our_engines_and_doctor_agrees():
    result = _python(RESOLVE + DOCTOR)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    lines = out.splitlines()
    assert "megatron imported by `import verl`: False" in lines  # the plugin itself is cheap
    assert "language_model verl_ds4.engine.megatron.DS4MegatronEngineWithLMHead" in lines
    assert "value_model verl_ds4.engine.megatron.DS4MegatronEngineWithValueHead" in lines
    loaded = [line for line in result.stderr.splitlines() if "verl-ds4 plugin loaded" in line]
    assert len(loaded) == 1, result.stderr  # one line, not silent, not repeated

    # verl-ds4 doctor, in the same fresh process
    assert "doctor exit status 0" in lines
    assert "ok NVIDIA GPU: language_model" in out and "ok NVIDIA GPU: value_model" in out
    for label in ("verl", "megatron-core", "Megatron-Bridge", "TransformerEngine", "vLLM"):
        assert any(line.strip().startswith(label + " ") for line in lines), label
    # megatron-core 0.16.1 on CPU cannot run DS4 with CP, and the report says why.
    assert "DeepSeek-V4 with context parallelism on this stack:\n  NO, missing:" in out
    assert "PackedSeqParams has no cp_partition_mode" in out


@pytest.mark.parametrize("first", ["verl.trainer.sft_trainer", "verl.utils.checkpoint.checkpoint_handler"])
def test_the_plugin_registers_whatever_verl_module_is_imported_first(first):
    """`torchrun -m verl.trainer.sft_trainer` imports verl's checkpoint handler while verl loads the plugin: the
    plugin's hook on it waits for the engine (a module-level import of it made registration fail). Control: with
    the plugin disabled the same check sees verl's stock engine."""
    code = f"    import {first}\n" + RESOLVE.lstrip("\n")
    result = _python(code)
    assert result.returncode == 0 and "plugin FAILED" not in result.stderr, result.stderr[-3000:]
    assert "language_model verl_ds4.engine.megatron.DS4MegatronEngineWithLMHead" in result.stdout
    disabled = _python(code, VERL_USE_EXTERNAL_PLUGINS="none")
    assert "language_model verl.workers.engine.megatron.transformer_impl.MegatronEngineWithLMHead" in disabled.stdout


def test_without_the_entry_point_verl_keeps_its_own_engines():
    result = _python(RESOLVE, VERL_USE_EXTERNAL_PLUGINS="none")
    assert result.returncode == 0, result.stderr
    assert "language_model verl.workers.engine.megatron.transformer_impl.MegatronEngineWithLMHead" in result.stdout
    assert "verl-ds4 plugin loaded" not in result.stderr


def test_a_failed_registration_is_loud_and_self_check_raises():
    code = """
        import sys
        import verl
        sys.modules["verl_ds4.engine.megatron"] = None  # a broken install: our engine module cannot import
        import verl.workers.engine  # imports verl's Megatron engine: the plugin registers now, and fails
        from verl.workers.engine import EngineRegistry
        print("resolved:", EngineRegistry.get_engine_cls("language_model", "megatron").__module__)
        from verl_ds4.engine import plugin
        try:
            plugin.self_check()
        except RuntimeError as exc:
            print("SELF-CHECK RAISED:", str(exc).splitlines()[0])
    """
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert "resolved: verl.workers.engine.megatron.transformer_impl" in result.stdout  # verl's engine still works
    assert "SELF-CHECK RAISED: verl-ds4 plugin failed to register its engines" in result.stdout
    assert "ERROR" in result.stderr and "FAILED to register" in result.stderr
    assert "verl_ds4.engine.megatron" in result.stderr


# ------------------------------------------------------------------ hooks answer only inside our engines


def test_hooks_route_verls_rule_only_while_an_engine_is_active(restore_verl_hooks):
    import verl.models.mcore as verl_mcore
    import verl.utils.megatron.router_replay_utils as router_replay_utils
    from verl.models.mcore.model_forward import gptmodel_forward_model_engine as verls_forward

    from verl_ds4.engine.megatron import active_layout, hooks_installed, install_verl_hooks
    from verl_ds4.mcore.model_forward import gptmodel_forward_model_engine as our_forward
    from verl_ds4.mcore.resolver import ResolvedCPLayout

    install_verl_hooks()
    assert all(hooks_installed().values()), hooks_installed()
    hf_config = SimpleNamespace(architectures=["Qwen2ForCausalLM"])
    ds4_config = SimpleNamespace(experimental_attention_variant="dsv4_hybrid")

    assert verl_mcore.get_mcore_engine_forward_fn(hf_config) is verls_forward
    assert router_replay_utils._context_parallel_layout(ds4_config) == "contiguous"  # verl's own rule

    resolved = ResolvedCPLayout(layout="zigzag", min_local_rows=None, cp_size=2, tp_size=1)
    with active_layout(resolved):
        fn = verl_mcore.get_mcore_engine_forward_fn(hf_config)
        assert isinstance(fn, functools.partial) and fn.func is our_forward and fn.keywords["resolved"] is resolved
        fused = verl_mcore.get_mcore_forward_fused_model_engine_fn(hf_config)
        assert fused.keywords["resolved"] is resolved
        # The router-replay copy of the rule now answers with the engine's resolved layout.
        assert router_replay_utils._context_parallel_layout(ds4_config) == "zigzag"
    assert verl_mcore.get_mcore_engine_forward_fn(hf_config) is verls_forward


@pytest.mark.parametrize("model_type", ["language_model", "value_model"])
def test_register_engines_is_idempotent(model_type, restore_verl_hooks):
    from verl.workers.engine.base import EngineRegistry

    from verl_ds4.engine import plugin

    plugin.register_engines()
    plugin.register_engines()
    found = EngineRegistry._engines[model_type]["megatron"][("cuda", "nvidia")]
    assert found.__module__ == "verl_ds4.engine.megatron"
    assert plugin.self_check().error is None


def test_dynamic_cp_block_schedules_with_the_resolved_layout(monkeypatch, restore_verl_hooks):
    """verl's DCP block (transformer_impl.py:882) passes its own rule; the scheduler gets ours."""
    import verl.workers.engine.megatron.transformer_impl as impl
    from verl.utils.dynamic_cp_scheduler import DynamicCPScheduler

    from verl_ds4.engine.megatron import ResolvedDynamicCPScheduler, active_layout, install_verl_hooks
    from verl_ds4.mcore.resolver import ResolvedCPLayout

    install_verl_hooks()
    assert impl.DynamicCPScheduler is ResolvedDynamicCPScheduler  # the name verl's block looks up
    calls = []
    monkeypatch.setattr(DynamicCPScheduler, "schedule", lambda self, batch, group, **kw: calls.append(kw) or [])
    scheduler = impl.DynamicCPScheduler(max_seqlen_per_dp_cp_rank=256, dp_size=1, cp_size=2)
    # What verl 0.9.1 passes for DS4 without fused kernels: contiguous, but no minimum rows.
    verl_args = dict(tp_size=1, cp_layout="contiguous", min_local_rows=None)
    scheduler.schedule(None, None, **verl_args)
    assert calls[-1] == verl_args  # outside our engine: verl's behaviour, unchanged
    resolved = ResolvedCPLayout(layout="contiguous", min_local_rows=128, cp_size=2, tp_size=1, dynamic_cp=True)
    with active_layout(resolved):
        scheduler.schedule(None, None, **verl_args)
    assert calls[-1] == dict(tp_size=1, cp_layout="contiguous", min_local_rows=128)


# ------------------------------------------------------------------ hooks can be taken back


def test_uninstall_restores_verls_originals_exactly(restore_verl_hooks):
    """Negative control for the fixture: while installed the hooks are visible on verl's modules;
    uninstall puts verl's very objects back; install / uninstall repeat cleanly."""
    import verl.utils.megatron.router_replay_utils as router_replay_utils

    engines = restore_verl_hooks
    engines.install_verl_hooks()
    originals = engines.verl_originals()
    assert set(originals) == {hook.label for hook in engines.VERL_HOOKS}
    assert all(engines.hooks_installed().values())
    for hook in engines.VERL_HOOKS:  # a stale hook is visible until uninstalled
        assert getattr(hook.target, hook.name) is not originals[hook.label], hook.label
    assert router_replay_utils._context_parallel_layout.__verl_ds4_hook__

    for _ in range(2):
        engines.uninstall_verl_hooks()
        engines.uninstall_verl_hooks()  # idempotent
        assert not any(engines.hooks_installed().values()), engines.hooks_installed()
        assert engines.verl_originals() == {}
        for hook in engines.VERL_HOOKS:
            assert getattr(hook.target, hook.name) is originals[hook.label], hook.label
        assert not hasattr(router_replay_utils._context_parallel_layout, "__verl_ds4_hook__")
        engines.install_verl_hooks()
        engines.install_verl_hooks()  # idempotent: wraps verl's original once, never our own hook
        assert all(engines.hooks_installed().values())
        assert engines.verl_originals() == originals
        assert router_replay_utils._context_parallel_layout.__wrapped__ is originals[
            "router_replay_utils._context_parallel_layout"
        ]


def test_uninstall_refuses_to_drop_someone_elses_replacement(restore_verl_hooks, monkeypatch):
    import verl.models.mcore as verl_mcore

    engines = restore_verl_hooks
    engines.install_verl_hooks()
    originals = engines.verl_originals()
    theirs = lambda hf_config: None  # noqa: E731
    monkeypatch.setattr(verl_mcore, "get_mcore_engine_forward_fn", theirs)
    with pytest.raises(RuntimeError, match="get_mcore_engine_forward_fn.*something else replaced them"):
        engines.uninstall_verl_hooks()
    assert verl_mcore.get_mcore_engine_forward_fn is theirs  # kept
    label = "router_replay_utils._context_parallel_layout"
    assert list(engines.verl_originals()) == ["verl.models.mcore.get_mcore_engine_forward_fn"]  # the rest restored
    import verl.utils.megatron.router_replay_utils as router_replay_utils

    assert router_replay_utils._context_parallel_layout is originals[label]
    monkeypatch.undo()  # their replacement ends: our hook is back, and uninstall completes
    engines.uninstall_verl_hooks()
    assert verl_mcore.get_mcore_engine_forward_fn is originals["verl.models.mcore.get_mcore_engine_forward_fn"]


def test_unregister_engines_gives_verl_its_registry_and_call_sites_back(restore_verl_hooks):
    from verl.workers.engine.base import EngineRegistry

    from verl_ds4.engine import plugin

    engines = restore_verl_hooks
    plugin.register_engines()
    assert EngineRegistry._engines["language_model"]["megatron"][("cuda", "nvidia")].__module__ == engines.__name__
    removed = plugin.unregister_engines()
    assert {entry[0] for entry in removed} == {"language_model", "value_model"}
    for model_type in ("language_model", "value_model"):
        assert ("cuda", "nvidia") not in EngineRegistry._engines[model_type]["megatron"]
    assert not any(engines.hooks_installed().values())
    assert plugin.unregister_engines() == []  # idempotent
    plugin.register_engines()
    assert plugin.self_check().error is None and all(engines.hooks_installed().values())
