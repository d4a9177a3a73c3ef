"""The CP layout API probe: Megatron-LM dev's and main's spellings, and neither (the releases: megatron-core
0.16.1 in lane 1, 0.19.2 in lane 2).

The API that is not installed is a stand-in: a dataclass subclass of the installed ``PackedSeqParams``
/ ``TransformerConfig`` with the other spelling's fields (names from Megatron-LM main's
``megatron/core/context_parallel`` and its docs).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.transformer_config import TransformerConfig

from verl_ds4.mcore import megatron_api, resolver
from verl_ds4.mcore.resolver import CPLayoutError


@dataclasses.dataclass
class DevPacked(PackedSeqParams):
    cp_partition_mode: str | None = None


@dataclasses.dataclass
class DevConfig(TransformerConfig):
    cp_partition_mode: str | None = None


@dataclasses.dataclass
class MainPacked(PackedSeqParams):
    cp_partition_route: object = None


@dataclasses.dataclass
class MainConfig(TransformerConfig):
    attention_cp_layout: str | None = None
    linear_cp_layout: str | None = None


DEV = megatron_api.probe(DevPacked, DevConfig)
MAIN = megatron_api.probe(MainPacked, MainConfig)
DS4 = SimpleNamespace(model_type="deepseek_v4")


def _fields(api):
    return set(api.config_fields)


def test_installed_megatron_core_release_has_neither():
    api = megatron_api.installed_api()
    assert api.kind == "none" and not api.can_tell_attention
    assert megatron_api.installed_api() is api  # probed once, cached
    assert api.packed_seq_params_fields("contiguous") == {}


def test_probe_classifies_both_stand_ins():
    assert DEV.kind == "dev" and MAIN.kind == "main"
    assert DEV.packed_seq_params_fields("contiguous") == {"cp_partition_mode": "contiguous"}
    assert MAIN.packed_seq_params_fields("contiguous") == {}  # the route stays None: no conversion needed
    # negative control: a route field alone (no config field) is not main
    assert megatron_api.probe(MainPacked, TransformerConfig).kind == "none"


@pytest.mark.parametrize("api,keys", [(DEV, {"cp_partition_mode"}), (MAIN, {"attention_cp_layout", "linear_cp_layout"})])
def test_ds4_fills_the_installed_spelling(api, keys):
    fills = resolver.transformer_config_fills(
        DS4, user_overrides={}, cp_size=2, tp_size=1, config_fields=_fields(api), api=api
    )
    assert {k for k, v in fills.items() if v == "contiguous"} == keys
    # a user's explicit value is kept, never overridden
    user = {k: "contiguous" for k in keys}
    kept = resolver.transformer_config_fills(DS4, user_overrides=user, cp_size=2, tp_size=1, config_fields=_fields(api), api=api)
    assert not keys & set(kept)


def test_explicit_zigzag_in_main_words_is_refused_for_ds4():
    with pytest.raises(CPLayoutError, match="zigzag"):
        resolver.transformer_config_fills(
            DS4, user_overrides={"attention_cp_layout": "zigzag"}, cp_size=2, tp_size=1,
            config_fields=_fields(MAIN), api=MAIN,
        )  # fmt: skip


@pytest.mark.parametrize(
    "api,key", [(MAIN, "cp_partition_mode"), (DEV, "attention_cp_layout"), (DEV, "linear_cp_layout")]
)
def test_the_other_spelling_is_a_start_up_error_naming_both(api, key):
    with pytest.raises(CPLayoutError) as info:
        resolver.transformer_config_fills(
            SimpleNamespace(model_type="llama"), user_overrides={key: "contiguous"}, cp_size=2, tp_size=1, api=api
        )
    assert "cp_partition_mode" in str(info.value) and "attention_cp_layout" in str(info.value)
    # negative control: the installed spelling passes
    own = api.config_keys[0]
    resolver.transformer_config_fills(SimpleNamespace(model_type="llama"), user_overrides={own: "contiguous"},
                                      cp_size=2, tp_size=1, api=api)  # fmt: skip


def test_neither_api_refuses_layout_keys_and_keeps_self_describing_modules():
    none = megatron_api.installed_api()
    with pytest.raises(CPLayoutError, match="neither"):
        none.check_overrides({"attention_cp_layout": "contiguous"})
    # cp_partition_mode stays the resolver's preference key for self-describing modules (as before)
    none.check_overrides({"cp_partition_mode": "contiguous"})
    none.check_overrides({"sequence_packing_scheduler": "dp_balanced"})  # other keys untouched


def test_doctor_names_the_api(capsys):
    from verl_ds4.engine import doctor_cli

    doctor_cli.run(SimpleNamespace(require_ds4=False))
    out = capsys.readouterr().out
    assert "Megatron-Core CP layout API:" in out and "none:" in out


def test_dynamic_cp_group_getter_of_either_release(monkeypatch):
    """cp_context finds the dynamic-CP group under Megatron-LM dev's name or megatron-core 0.19's."""
    from verl_ds4.mcore import thd

    calls = []

    def getter(name):
        return lambda group_size: calls.append((name, group_size)) or "group"

    monkeypatch.setattr(thd.torch.distributed, "get_rank", lambda group: 1)
    for present in (("get_dynamic_data_context_parallel_groups",), ("get_hybrid_data_context_parallel_groups",),
                    thd.DYNAMIC_CP_GROUP_GETTERS):  # fmt: skip
        calls.clear()
        monkeypatch.setattr(thd, "mpu", SimpleNamespace(**{name: getter(name) for name in present}))
        assert thd.cp_context(2) == (2, 1, "group", {"local_cp_size": 2, "cp_group": "group"})
        assert calls == [(present[0], 2)]  # Megatron-LM dev's name first where both exist
    # negative control: neither name -> a clear error naming both
    monkeypatch.setattr(thd, "mpu", SimpleNamespace())
    with pytest.raises(ValueError, match="get_dynamic_data_context_parallel_groups / get_hybrid"):
        thd.cp_context(2)


def test_gpu_ds4_engines_install_the_mtp_cp_fix_only_where_it_applies():
    """verl-ds4's GPU DS4 engines install fix 3 of verl_ds4.substitutes.upstream_fixes (the MTP loss as each CP rank's
    share of the CP-global mean) at start-up (verl_ds4.engine.dev_corrections), and hand dev's DS4 the real lengths in
    cu_seqlens_q: the fix for DS4 at CP > 1 on a Megatron whose process_mtp_loss still normalises per rank
    (megatron-core 0.19.2 and both proven dev commits; 0.16.1 has no process_mtp_loss). Controls: CP 1, a non-DS4
    model and the CPU engines (their own model, no Megatron MTP) install nothing and keep verl's padded lengths."""
    import megatron.core.transformer.multi_token_prediction as mtp

    from verl_ds4 import ds4_facts
    from verl_ds4.cpu.engine import CPUMegatronEngineWithLMHead
    from verl_ds4.engine import dev_corrections
    from verl_ds4.engine import megatron as engines
    from verl_ds4.substitutes import upstream_fixes
    from verl_ds4.substitutes.upstream_fixes import mtp_loss_is_rank_mean

    upstream_fixes.PROCESS_PATCHES.undo()  # a GPU DS4 engine built earlier in this process may have installed it
    original = getattr(mtp, "process_mtp_loss", None)
    assert not getattr(original, "_verl_ds4_cp_token_share", False)
    applies = original is not None and mtp_loss_is_rank_mean(original)
    ds4 = SimpleNamespace(model_type=ds4_facts.HF_MODEL_TYPE)
    other = SimpleNamespace(model_type="qwen3")
    gpu = engines.DS4MegatronEngineWithLMHead.sparse_attention_in_megatron
    cpu = CPUMegatronEngineWithLMHead.sparse_attention_in_megatron
    assert gpu and not cpu
    assert dev_corrections.real_cu_seqlens(ds4, gpu)
    assert not dev_corrections.real_cu_seqlens(ds4, cpu) and not dev_corrections.real_cu_seqlens(other, gpu)
    try:
        assert not dev_corrections.install(ds4, 1, gpu)
        assert not dev_corrections.install(other, 2, gpu)
        assert not dev_corrections.install(ds4, 2, cpu)
        assert getattr(mtp, "process_mtp_loss", None) is original
        assert dev_corrections.install(ds4, 2, gpu) is applies
        if applies:
            assert mtp.process_mtp_loss is not original and mtp.process_mtp_loss.__wrapped__ is original
            assert not dev_corrections.install(ds4, 4, gpu)  # once per process
    finally:
        upstream_fixes.PROCESS_PATCHES.undo()
    assert getattr(mtp, "process_mtp_loss", None) is original
