"""The layout resolver and the engines' start-up checks (real megatron-core, real verl, CPU).

Models are real Megatron-Core ``GPTModel``s built on one gloo rank; CP sizes are passed to the
resolver directly (no forward runs here; see test_engine_data_paths_on_cpu.py for CP groups).
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from verl_ds4.mcore import resolver
from verl_ds4.mcore.resolver import CPLayoutError, ResolvedCPLayout
from verl_ds4.testing.tiny_gpt import PerTokenAttention, build_tiny_gpt


@pytest.fixture(scope="module")
def parallel_state():
    """Megatron parallel state on torch's thread-free "fake" backend (world size 1).

    No collective runs here; a real gloo group would leave threads in the pytest process that
    make later forked multi-process tests (ours and others') hang.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    mpu.initialize_model_parallel(create_gloo_process_groups=False)
    yield mpu
    mpu.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture
def with_cp_partition_mode(monkeypatch):
    """Emulate a Megatron-Core (Megatron-LM dev) whose PackedSeqParams has cp_partition_mode."""
    monkeypatch.setattr(resolver, "packed_seq_params_has_cp_partition_mode", lambda: True)


DS4_HF = SimpleNamespace(model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"])
DENSE_HF = SimpleNamespace(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
FIELDS = ("cp_partition_mode", "sequence_packing_scheduler")


# ------------------------------------------------------------------ resolve_cp_layout on real models


def test_standard_megatron_attention_resolves_zigzag(parallel_state):
    model = build_tiny_gpt()  # Megatron's DotProductAttention in every layer
    resolved = resolver.resolve_cp_layout(model, cp_size=2)
    assert resolved.layout == "zigzag"
    assert resolved.min_local_rows is None
    assert "DotProductAttention" in resolved.describe()


def test_declaring_module_decides_layout_and_min_rows(parallel_state):
    model = build_tiny_gpt(attention=lambda i: PerTokenAttention("contiguous", 128))
    resolved = resolver.resolve_cp_layout(model, cp_size=4, pad_to_length_bucket=64)
    assert (resolved.layout, resolved.min_local_rows, resolved.cp_size) == ("contiguous", 128, 4)
    options = resolved.plan_options()
    assert (options.layout.value, options.min_local_rows, options.cp_size, options.pad_to_length_bucket) == (
        "contiguous",
        128,
        4,
        64,
    )
    # Dynamic CP: the per-micro-batch size replaces the static one, only when enabled.
    with pytest.raises(CPLayoutError, match="dynamic"):
        resolved.plan_options(local_cp_size=2)
    dynamic = resolver.resolve_cp_layout(model, cp_size=4, dynamic_cp=True)
    assert dynamic.plan_options(local_cp_size=2).cp_size == 2


def test_dsv4_config_needs_contiguous_with_window_rows(parallel_state, with_cp_partition_mode):
    model = build_tiny_gpt()
    config = model.config
    config.experimental_attention_variant = "dsv4_hybrid"  # what Megatron-LM dev sets for DS4
    config.csa_window_size = 128
    resolved = resolver.resolve_cp_layout(model, config, cp_size=2)
    assert (resolved.layout, resolved.min_local_rows) == ("contiguous", 128)
    config.csa_window_size, config.csa_compress_ratios = 64, [0, 4, 128]  # D_window = max(W, ratio)
    assert resolver.resolve_cp_layout(model, config, cp_size=2).min_local_rows == 128
    config.csa_compress_ratios = [0, 4]
    assert resolver.resolve_cp_layout(model, config, cp_size=2).min_local_rows == 64


def test_dsv4_with_tp_is_rejected(parallel_state, with_cp_partition_mode):
    model = build_tiny_gpt()
    model.config.experimental_attention_variant = "dsv4_hybrid"
    with pytest.raises(CPLayoutError, match="tensor_model_parallel_size=2.*Set tensor_model_parallel_size=1"):
        resolver.resolve_cp_layout(model, cp_size=2, tp_size=2)
    with pytest.raises(CPLayoutError, match="tensor parallelism"):
        resolver.transformer_config_fills(DS4_HF, user_overrides={}, cp_size=2, tp_size=2, config_fields=FIELDS)


def test_dsv4_on_megatron_without_cp_partition_mode_is_rejected_at_startup(parallel_state):
    """Released Megatron-Core: contiguous rows cannot be signalled to Megatron's DS4 attention."""
    assert not resolver.packed_seq_params_has_cp_partition_mode()  # megatron-core 0.16.1
    model = build_tiny_gpt()
    model.config.experimental_attention_variant = "dsv4_hybrid"
    with pytest.raises(CPLayoutError, match="PackedSeqParams.cp_partition_mode.*experimental_attention_variant"):
        resolver.resolve_cp_layout(model, cp_size=2)
    # CP=1 needs no signalling.
    assert resolver.resolve_cp_layout(model, cp_size=1).layout == "contiguous"


def test_declaring_module_needs_no_packed_seq_params_field(parallel_state):
    model = build_tiny_gpt(attention=lambda i: PerTokenAttention("contiguous", 128))
    assert resolver.resolve_cp_layout(model, cp_size=2).layout == "contiguous"


def test_explicit_contiguous_on_zigzag_attention_is_rejected(parallel_state, with_cp_partition_mode):
    model = build_tiny_gpt()
    with pytest.raises(CPLayoutError, match="cp_partition_mode='contiguous'.*DotProductAttention.*cannot consume"):
        resolver.resolve_cp_layout(model, cp_size=2, user_overrides={"cp_partition_mode": "contiguous"})
    # Without CP the setting is harmless and kept.
    assert resolver.resolve_cp_layout(model, cp_size=1, user_overrides={"cp_partition_mode": "contiguous"})


def test_explicit_zigzag_for_ds4_is_rejected(parallel_state, with_cp_partition_mode):
    with pytest.raises(CPLayoutError, match="cp_partition_mode='zigzag'.*DeepSeek-V4.*contiguous"):
        resolver.transformer_config_fills(
            DS4_HF, user_overrides={"cp_partition_mode": "zigzag"}, cp_size=2, tp_size=1, config_fields=FIELDS
        )
    model = build_tiny_gpt(attention=lambda i: PerTokenAttention("contiguous", 128))
    with pytest.raises(CPLayoutError, match="cp_partition_mode='zigzag'.*PerTokenAttention"):
        resolver.resolve_cp_layout(model, cp_size=2, user_overrides={"cp_partition_mode": "zigzag"})


def test_modules_needing_different_layouts_are_rejected_unless_one_converts(parallel_state):
    mixed = build_tiny_gpt(
        num_layers=3, attention=lambda i: PerTokenAttention("contiguous", 128) if i else PerTokenAttention("zigzag")
    )
    with pytest.raises(CPLayoutError, match="different CP partition modes.*layers.0.*zigzag.*layers.1.*and 1 more.*contiguous"):
        resolver.resolve_cp_layout(mixed, cp_size=2)
    converting = build_tiny_gpt(
        num_layers=2,
        attention=lambda i: PerTokenAttention("contiguous", 128)
        if i
        else PerTokenAttention("zigzag", accepts=("contiguous",)),
    )
    resolved = resolver.resolve_cp_layout(converting, cp_size=2)
    assert (resolved.layout, resolved.min_local_rows) == ("contiguous", 128)


def test_bad_protocol_values_name_the_module(parallel_state):
    model = build_tiny_gpt(attention=lambda i: PerTokenAttention("ring", 128))
    with pytest.raises(CPLayoutError, match="layers.0.self_attention.core_attention.*'ring'"):
        resolver.resolve_cp_layout(model, cp_size=2)
    model = build_tiny_gpt(attention=lambda i: PerTokenAttention("contiguous", 0))
    with pytest.raises(CPLayoutError, match="min_local_rows=0"):
        resolver.resolve_cp_layout(model, cp_size=2)


class _ClassDeclared(torch.nn.Module):
    """The protocol as class attribute and property (how product modules declare it)."""

    required_cp_partition_mode = "contiguous"

    @property
    def min_local_rows(self):
        return 64


def test_protocol_reads_class_attributes_properties_and_instance_values(parallel_state):
    model = build_tiny_gpt()
    model.decoder.layers[0].self_attention.core_attention = _ClassDeclared()
    model.decoder.layers[1].self_attention.core_attention = PerTokenAttention("contiguous", 32)  # instance values
    resolved = resolver.resolve_cp_layout(model, cp_size=2)
    assert (resolved.layout, resolved.min_local_rows) == ("contiguous", 64)


def test_protocol_has_one_spelling(parallel_state):
    """The old spellings (a ``cp_layout_requirement`` tuple, ``cp_layout`` + ``min_local_rows()``) declare nothing."""
    model = build_tiny_gpt(attention=lambda i: torch.nn.Identity())
    for layer in model.decoder.layers:
        layer.self_attention.core_attention.cp_layout_requirement = ("contiguous", 32)
        layer.self_attention.core_attention.cp_layout = "contiguous"
    with pytest.raises(CPLayoutError, match="layers.0.self_attention.core_attention \\(Identity\\).*declares none"):
        resolver.resolve_cp_layout(model, cp_size=2)
    method = build_tiny_gpt(attention=lambda i: PerTokenAttention("contiguous"))
    for layer in method.decoder.layers:
        layer.self_attention.core_attention.min_local_rows = lambda: 32
    with pytest.raises(CPLayoutError, match="min_local_rows is a method.*Make it a property"):
        resolver.resolve_cp_layout(method, cp_size=2)


def test_resolved_layout_is_registered_without_touching_model_or_config(parallel_state):
    model = build_tiny_gpt(attention=lambda i: PerTokenAttention("contiguous", 16))
    resolved = resolver.resolve_cp_layout(model, cp_size=2)
    wrapper = torch.nn.Module()
    wrapper.module = model
    config_before = dict(vars(model.config))
    modules_before = set(vars(wrapper)) | set(vars(model))
    assert resolver.layout_of(wrapper) is None and resolver.layout_of(model.config) is None  # not yet
    resolver.register_layout([wrapper], resolved, model.config)
    assert resolver.layout_of(wrapper) is resolved and resolver.layout_of(model) is resolved
    assert resolver.layout_of(model.config) is resolved
    assert dict(vars(model.config)) == config_before  # nothing set on Megatron's objects
    assert set(vars(wrapper)) | set(vars(model)) == modules_before
    assert resolver.resolved_for(wrapper) is resolved  # found, not resolved again
    other = build_tiny_gpt(attention=lambda i: PerTokenAttention("contiguous", 16))
    assert resolver.layout_of(other) is None
    # Entries go with their objects (weak references).
    before = len(resolver.REGISTRY)
    del other
    scratch = build_tiny_gpt(attention=lambda i: PerTokenAttention("zigzag"))
    resolver.register_layout(scratch, resolver.resolve_cp_layout(scratch, cp_size=1))
    assert len(resolver.REGISTRY) == before + 2  # the model and its config
    del scratch
    import gc

    gc.collect()
    assert len(resolver.REGISTRY) == before
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.layout = "zigzag"


def test_known_attention_comes_from_the_table_not_a_default(parallel_state, monkeypatch):
    model = build_tiny_gpt()  # Megatron's DotProductAttention
    assert resolver.KNOWN_CP_PARTITION_MODES[("megatron.core", "DotProductAttention")] == "zigzag"
    assert resolver.resolve_cp_layout(model, cp_size=2).layout == "zigzag"
    # Negative control: without its table entry the same module is an undeclared attention.
    from verl_ds4.mcore import requirements

    table = {k: v for k, v in requirements.KNOWN_CP_PARTITION_MODES.items() if k[1] != "DotProductAttention"}
    monkeypatch.setattr(requirements, "KNOWN_CP_PARTITION_MODES", table)
    with pytest.raises(CPLayoutError, match="decoder.layers.0.self_attention.core_attention \\(DotProductAttention\\)"):
        resolver.resolve_cp_layout(model, cp_size=2)
    assert resolver.resolve_cp_layout(model, cp_size=1).layout == "zigzag"  # CP=1: nothing is required


def test_undeclared_attention_and_missing_attention_fail_under_cp_only(parallel_state):
    model = build_tiny_gpt(attention=lambda i: PerTokenAttention("contiguous") if i else torch.nn.Identity())
    with pytest.raises(CPLayoutError, match="layers.0.self_attention.core_attention \\(Identity\\) declares none"):
        resolver.resolve_cp_layout(model, cp_size=2)
    with pytest.raises(CPLayoutError, match="declares none"):
        resolver.resolve_cp_layout(model, cp_size=1, dynamic_cp=True)
    assert resolver.resolve_cp_layout(model, cp_size=1).layout == "contiguous"
    empty = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(CPLayoutError, match="found none"):
        resolver.resolve_cp_layout(empty, cp_size=2)
    assert resolver.resolve_cp_layout(empty, cp_size=1).layout == "zigzag"


def test_a_declaring_module_speaks_for_its_submodules(parallel_state):
    class Converting(torch.nn.Module):
        required_cp_partition_mode = "contiguous"
        min_local_rows = None

        def __init__(self, inner):
            super().__init__()
            self.inner = inner  # a zigzag DotProductAttention it feeds after converting the rows

    model = build_tiny_gpt()
    for layer in model.decoder.layers:
        layer.self_attention.core_attention = Converting(layer.self_attention.core_attention)
    assert resolver.resolve_cp_layout(model, cp_size=2).layout == "contiguous"


def test_an_undetermined_mode_is_not_picked_silently(parallel_state):
    model = build_tiny_gpt(
        attention=lambda i: PerTokenAttention("zigzag", accepts=("contiguous",))
        if i
        else PerTokenAttention("contiguous", accepts=("zigzag",))
    )
    with pytest.raises(CPLayoutError, match="can all consume contiguous and zigzag.*Set override_transformer_config"):
        resolver.resolve_cp_layout(model, cp_size=2)
    chosen = resolver.resolve_cp_layout(model, cp_size=2, user_overrides={"cp_partition_mode": "zigzag"})
    assert chosen.layout == "zigzag"


def test_ds4_config_with_declaring_modules_must_agree(parallel_state):
    model = build_tiny_gpt(attention=lambda i: PerTokenAttention("zigzag"))
    model.config.experimental_attention_variant = "dsv4_hybrid"
    with pytest.raises(CPLayoutError, match="different CP partition modes.*experimental_attention_variant.*contiguous"):
        resolver.resolve_cp_layout(model, cp_size=2)
    agreeing = build_tiny_gpt(attention=lambda i: PerTokenAttention("contiguous", 16))
    agreeing.config.experimental_attention_variant = "dsv4_hybrid"
    agreeing.config.csa_window_size = 32
    resolved = resolver.resolve_cp_layout(agreeing, cp_size=2)  # megatron-core 0.16.1: the modules read the rows
    assert (resolved.layout, resolved.min_local_rows) == ("contiguous", 32)


# ------------------------------------------------------------------ filling the user's overrides


def test_fills_only_missing_values_and_keeps_the_users_scheduler():
    fills = resolver.transformer_config_fills(DS4_HF, user_overrides={}, cp_size=2, tp_size=1, config_fields=FIELDS)
    assert fills == {"cp_partition_mode": "contiguous", "sequence_packing_scheduler": "default_dynamic_cp"}
    fills = resolver.transformer_config_fills(
        DS4_HF,
        user_overrides={"sequence_packing_scheduler": "dp_balanced"},
        cp_size=2,
        tp_size=1,
        config_fields=FIELDS,
    )
    assert fills == {"cp_partition_mode": "contiguous"}
    with pytest.raises(CPLayoutError, match="sequence_packing_scheduler='naive'"):
        resolver.transformer_config_fills(
            DS4_HF, user_overrides={"sequence_packing_scheduler": "naive"}, cp_size=2, tp_size=1, config_fields=FIELDS
        )
    # Fields the installed TransformerConfig lacks are never filled (megatron-core 0.16.1 has neither).
    assert resolver.transformer_config_fills(DS4_HF, user_overrides={}, cp_size=2, tp_size=1) == {}
    assert resolver.transformer_config_fills(DENSE_HF, user_overrides={}, cp_size=2, tp_size=1) == {}
    assert resolver.transformer_config_fills(DS4_HF, user_overrides={}, cp_size=1, tp_size=1) == {}


def _engine_config(**overrides):
    base = dict(
        use_mbridge=True,
        vanilla_mbridge=True,
        context_parallel_size=2,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        dynamic_context_parallel=False,
        pad_to_length=False,
        use_remove_padding=True,
        pad_to_length_bucket=None,
        override_transformer_config={},
        max_seqlen_per_dp_cp_rank=None,
    )
    base.update(overrides)
    return SimpleNamespace(**base)


def test_users_scheduler_survives_verls_build_tf_config(monkeypatch, restore_verl_hooks):
    """verl 0.9.1's real ``_build_tf_config`` overwrites the scheduler for deepseek_v4; ours keeps it.

    Only the bridge is replaced (mbridge is not installed here, and no bridge builds DS4 on CPU /
    megatron-core 0.16.1): it records the overrides verl hands it. The engine object is made without running verl's
    ``__init__`` (no GPU); ``_build_tf_config`` is verl's code.
    """
    import sys
    import types

    import verl.workers.config.megatron_peft as megatron_peft
    import verl.workers.engine.megatron.transformer_impl as impl

    from verl_ds4.engine.megatron import DS4MegatronEngineWithLMHead, install_verl_hooks

    install_verl_hooks()
    seen = []

    class RecordingBridge:
        @classmethod
        def from_config(cls, hf_config, dtype=None):
            bridge = cls()
            bridge.config = SimpleNamespace(fp16=False, bf16=False)
            return bridge

        def set_extra_args(self, **kwargs):
            seen.append(dict(kwargs))

    fake_mbridge = types.ModuleType("verl.models.mcore.mbridge")
    fake_mbridge.AutoBridge = RecordingBridge
    monkeypatch.setitem(sys.modules, "verl.models.mcore.mbridge", fake_mbridge)
    monkeypatch.setattr(impl, "check_mtp_config", lambda *a, **k: None)
    monkeypatch.setattr(impl, "get_mcore_weight_converter", lambda *a, **k: None)
    monkeypatch.setattr(megatron_peft, "get_peft_cls", lambda **k: None)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 1)

    def run(engine_cls, user):
        engine = object.__new__(engine_cls)
        engine.model_config = SimpleNamespace(
            model_type="language_model",
            hf_config=SimpleNamespace(**vars(DS4_HF)),
            share_embeddings_and_output_weights=False,
        )
        engine.engine_config = _engine_config(dtype="bfloat16", override_transformer_config=dict(user))
        engine.enable_routing_replay = False
        seen.clear()
        engine._build_tf_config()
        return seen[-1]

    user = {"sequence_packing_scheduler": "dp_balanced"}
    # verl's own engine replaces the user's value (the bug this engine fixes) ...
    assert run(impl.MegatronEngineWithLMHead, user)["sequence_packing_scheduler"] == "default_dynamic_cp"
    # ... ours keeps it, and fills nothing that megatron-core 0.16.1's TransformerConfig lacks.
    ours = run(DS4MegatronEngineWithLMHead, user)
    assert ours["sequence_packing_scheduler"] == "dp_balanced"
    assert "cp_partition_mode" not in ours
    # With a Megatron-Core that has the fields, missing values are filled and verl cannot replace them.
    monkeypatch.setattr(resolver, "transformer_config_fields", lambda: frozenset(FIELDS))
    ours = run(DS4MegatronEngineWithLMHead, user)
    assert (ours["sequence_packing_scheduler"], ours["cp_partition_mode"]) == ("dp_balanced", "contiguous")
    # Outside our engine the guard is inactive: verl's function behaves as before.
    assert run(impl.MegatronEngineWithLMHead, {})["sequence_packing_scheduler"] == "default_dynamic_cp"


# ------------------------------------------------------------------ engine start-up errors


@pytest.mark.parametrize(
    ("engine_name", "hf_config", "settings", "match"),
    [
        ("DS4MegatronEngineWithValueHead", DENSE_HF, {"dynamic_context_parallel": True}, "not supported for value"),
        ("DS4MegatronEngineWithLMHead", DS4_HF, {"tensor_model_parallel_size": 2}, "tensor parallelism"),
        (
            "DS4MegatronEngineWithLMHead",
            DS4_HF,
            {"override_transformer_config": {"cp_partition_mode": "zigzag"}},
            "needs the contiguous CP layout",
        ),
        (
            "DS4MegatronEngineWithLMHead",
            DENSE_HF,
            {"pad_to_length": True, "pad_to_length_bucket": 0},
            "pad_to_length_bucket",
        ),
    ],
)
def test_engine_rejects_bad_settings_before_building_anything(engine_name, hf_config, settings, match, monkeypatch):
    import verl_ds4.engine.megatron as engines

    def must_not_run(*args, **kwargs):  # verl's __init__ initialises parallel state and CUDA
        raise AssertionError("verl's engine __init__ ran before the start-up check")

    monkeypatch.setattr(engines.MegatronEngineWithLMHead, "__init__", must_not_run)
    model_config = SimpleNamespace(hf_config=hf_config, model_type="value_model")
    with pytest.raises(CPLayoutError, match=match):
        getattr(engines, engine_name)(model_config, _engine_config(**settings), None, None)


def test_engine_layout_method_and_active_context(parallel_state):
    from verl_ds4.engine.megatron import DS4MegatronEngineWithLMHead, active_layout, current_layout

    engine = object.__new__(DS4MegatronEngineWithLMHead)
    engine.engine_config = _engine_config(context_parallel_size=1)
    engine.tf_config = None
    model = build_tiny_gpt(attention=lambda i: PerTokenAttention("contiguous", 128))
    with pytest.raises(RuntimeError, match="initialize"):
        engine._get_context_parallel_layout(model)
    resolved = engine._resolve_cp_layout([model])
    assert engine._get_context_parallel_layout(model) == "contiguous"
    assert resolver.layout_of(model) is resolved
    assert current_layout() is None
    with active_layout(resolved):
        assert current_layout() is resolved
    assert current_layout() is None
    assert isinstance(resolved, ResolvedCPLayout)


def test_pad_to_length_bucket_comes_from_the_engine_setting(parallel_state):
    from verl_ds4.engine.megatron import DS4MegatronEngineWithLMHead

    engine = object.__new__(DS4MegatronEngineWithLMHead)
    engine.engine_config = _engine_config(context_parallel_size=1, pad_to_length=True, pad_to_length_bucket=96)
    engine.tf_config = None
    resolved = engine._resolve_cp_layout([build_tiny_gpt(attention=lambda i: PerTokenAttention("zigzag"))])
    assert resolved.pad_to_length_bucket == 96
    assert os.environ.get("VERL_DS4_DISABLE_ENGINE") is None


def test_the_ds4_proxy_resolves_contiguous_with_window_rows(parallel_state):
    """The project's pure-PyTorch DS4 attention (verl_ds4.models.ds4) on megatron-core 0.16.1."""
    from verl_ds4.models.ds4.proxy import build_proxy_model

    model = build_proxy_model(dtype=torch.float32)
    assert model.config.experimental_attention_variant == "dsv4_hybrid"
    resolved = resolver.resolve_cp_layout(model, cp_size=2)
    # D_window over the layers: max(csa_window_size, compression ratio) (the proxy's own property agrees)
    assert (resolved.layout, resolved.min_local_rows) == ("contiguous", model.config.min_local_rows)
    assert resolved.min_local_rows == max(model.config.csa_window_size, *model.config.csa_compress_ratios)
    assert "DS4HybridSelfAttention" in resolved.describe()
    with pytest.raises(CPLayoutError, match="cp_partition_mode='zigzag'"):
        resolver.resolve_cp_layout(model, cp_size=2, user_overrides={"cp_partition_mode": "zigzag"})


def test_cp_balance_reaches_the_plan_and_needs_the_contiguous_layout(parallel_state):
    from verl_ds4.engine.config import DS4McoreEngineConfig
    from verl_ds4.engine.megatron import DS4MegatronEngineWithLMHead

    engine = object.__new__(DS4MegatronEngineWithLMHead)
    engine.tf_config = None
    engine.engine_config = DS4McoreEngineConfig(context_parallel_size=1, cp_balance="ds4")
    resolved = engine._resolve_cp_layout([build_tiny_gpt(attention=lambda i: PerTokenAttention("contiguous", 128))])
    assert resolved.balance == "ds4" and resolved.plan_options(None).balance == "ds4"
    assert "balanced under the ds4 cost model" in resolved.describe()
    with pytest.raises(CPLayoutError, match="cp_balance='ds4' reorders the sequences of the contiguous CP layout"):
        engine._resolve_cp_layout([build_tiny_gpt(attention=lambda i: PerTokenAttention("zigzag"))])
    # verl's own engine config has no cp_balance: batch order
    engine.engine_config = _engine_config(context_parallel_size=1)
    assert engine._resolve_cp_layout([build_tiny_gpt(attention=lambda i: PerTokenAttention("contiguous", 128))]).balance is None


def test_bad_cp_balance_fails_at_config_and_engine_start_up():
    from verl_ds4.engine.config import DS4McoreEngineConfig
    from verl_ds4.engine.megatron import DS4MegatronEngineWithLMHead

    with pytest.raises(ValueError, match="expected null .* one of \\['ds4', 'dense'\\]"):
        DS4McoreEngineConfig(cp_balance="fast")
    config = SimpleNamespace(cp_balance="fast", dtype="bfloat16")  # e.g. set on a config object later
    with pytest.raises(ValueError, match="cp_balance='fast'"):
        DS4MegatronEngineWithLMHead._check_startup_settings(
            object.__new__(DS4MegatronEngineWithLMHead), SimpleNamespace(hf_config=DENSE_HF), config
        )


# ------------------------------------------------------------------ DeepSeek-V4.1 on Megatron-LM dev

# Stand-ins with the module path and class name of the dev branch's V4.1 core attention (megatron.core
# source read at e80d15ffa5, experimental_attention_variant/csa2.py: CompressedSparseAttention2; after
# the refactor into the csa2/ package, 02ab972cd1: csa2/attention.py's CSA2Attention). megatron-core 0.16.1 has neither, so the resolver is checked
# on classes that only carry dev's names: it must know them by the table, not by a default.
DEV_CSA2 = "megatron.core.transformer.experimental_attention_variant.csa2"


def _dev_class(module: str, name: str = "CompressedSparseAttention2"):
    return type(name, (torch.nn.Module,), {"__module__": module})


def _v41_config(model, **fields):
    config = model.config
    config.experimental_attention_variant = "dsv4_hybrid"
    values = dict(dsv4_version="v4.1", csa_window_size=128, csa_compress_ratios=[0, 0, 2, 1], engram_layer_ids=None)
    values.update(fields)
    for key, value in values.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("module, name", [(DEV_CSA2, "CompressedSparseAttention2"), (DEV_CSA2 + ".attention", "CSA2Attention")])
def test_dev_v41_attention_resolves_contiguous_with_the_v41_rows(parallel_state, with_cp_partition_mode, module, name):
    csa2 = _dev_class(module, name)
    model = build_tiny_gpt(attention=lambda i: csa2())
    config = _v41_config(model)
    resolved = resolver.resolve_cp_layout(model, config, cp_size=4)
    assert (resolved.layout, resolved.min_local_rows) == ("contiguous", 128)
    assert "dsv4_version='v4.1'" in resolved.describe() and name in resolved.describe()
    # rows = max(window, largest ratio, Engram lookback): a window below the lookback is raised to it
    config.csa_window_size, config.engram_layer_ids, config.engram_max_ngram_size = 2, [1, 14], 4
    assert resolver.resolve_cp_layout(model, config, cp_size=4).min_local_rows == 3
    del config.engram_max_ngram_size  # Megatron's own default (EngramConfig: 3)
    assert resolver.resolve_cp_layout(model, config, cp_size=4).min_local_rows == 2
    # Megatron-Core without PackedSeqParams.cp_partition_mode cannot tell CSA2 the layout: refused
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(resolver, "packed_seq_params_has_cp_partition_mode", lambda: False)
        with pytest.raises(CPLayoutError, match=f"PackedSeqParams.cp_partition_mode.*{name}"):
            resolver.resolve_cp_layout(model, config, cp_size=4)


def test_dev_v41_refuses_zigzag_naming_v41(parallel_state, with_cp_partition_mode):
    csa2 = _dev_class(DEV_CSA2)
    model = build_tiny_gpt(attention=lambda i: csa2())
    config = _v41_config(model)
    with pytest.raises(CPLayoutError, match="cp_partition_mode='zigzag'.*dsv4_version='v4.1' \\(DeepSeek-V4.1.*cannot consume zigzag"):
        resolver.resolve_cp_layout(model, config, cp_size=2, user_overrides={"cp_partition_mode": "zigzag"})
    v41_hf = SimpleNamespace(model_type="deepseek_v41")
    with pytest.raises(CPLayoutError, match="cp_partition_mode='zigzag'.*DeepSeek-V4.1 attention \\(CSA2\\) and Engram"):
        resolver.transformer_config_fills(v41_hf, user_overrides={"cp_partition_mode": "zigzag"}, cp_size=2, tp_size=1,
                                          config_fields=FIELDS)
    with pytest.raises(CPLayoutError, match="tensor_model_parallel_size=2"):
        resolver.transformer_config_fills(v41_hf, user_overrides={}, cp_size=2, tp_size=2, config_fields=FIELDS)
    assert resolver.transformer_config_fills(v41_hf, user_overrides={}, cp_size=2, tp_size=1, config_fields=FIELDS) == {
        "cp_partition_mode": "contiguous", "sequence_packing_scheduler": "default_dynamic_cp"}


def test_v41_unknown_attention_is_refused_never_guessed(parallel_state, with_cp_partition_mode):
    """Negative controls: dev's class name under another module, another name under dev's module, and
    Megatron's zigzag attention, each in a V4.1 config: refused under CP (a V4 config would have let an
    unknown core attention through on the config's word)."""
    for stand_in in (_dev_class("my_project.attention"), _dev_class(DEV_CSA2, "CompressedSparseAttention3")):
        model = build_tiny_gpt(attention=lambda i, cls=stand_in: cls())
        config = _v41_config(model)
        with pytest.raises(CPLayoutError, match=f"core_attention \\({stand_in.__name__}\\) declares none"):
            resolver.resolve_cp_layout(model, config, cp_size=2)
        assert resolver.resolve_cp_layout(model, config, cp_size=1).layout == "contiguous"  # CP=1: nothing split
    plain = build_tiny_gpt()  # Megatron's DotProductAttention: zigzag, which V4.1 cannot take
    with pytest.raises(CPLayoutError, match="different CP partition modes.*v4.1.*DotProductAttention.*zigzag"):
        resolver.resolve_cp_layout(plain, _v41_config(plain), cp_size=2)
    # one V4.1 layer swapped for an unknown class is enough
    csa2, other = _dev_class(DEV_CSA2), _dev_class("my_project.attention", "Mystery")
    mixed = build_tiny_gpt(num_layers=3, attention=lambda i: other() if i == 2 else csa2())
    with pytest.raises(CPLayoutError, match="layers.2.self_attention.core_attention \\(Mystery\\)"):
        resolver.resolve_cp_layout(mixed, _v41_config(mixed), cp_size=2)
    # and the table entry is what makes dev's class known: without it the same model is refused
    model = build_tiny_gpt(attention=lambda i: csa2())
    from verl_ds4.mcore import requirements

    table = {k: v for k, v in requirements.KNOWN_CP_PARTITION_MODES.items() if k not in requirements.DS41_CORE_ATTENTIONS}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(requirements, "KNOWN_CP_PARTITION_MODES", table)
        with pytest.raises(CPLayoutError, match="CompressedSparseAttention2\\) declares none"):
            resolver.resolve_cp_layout(model, _v41_config(model), cp_size=2)


def test_v41_config_without_a_window_is_refused(parallel_state, with_cp_partition_mode):
    csa2 = _dev_class(DEV_CSA2)
    model = build_tiny_gpt(attention=lambda i: csa2())
    with pytest.raises(CPLayoutError, match="csa_window_size=None; expected the V4.1 window"):
        resolver.resolve_cp_layout(model, _v41_config(model, csa_window_size=None), cp_size=2)
