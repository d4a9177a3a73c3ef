"""DS4 facts and start-up rules (``verl_ds4.ds4_facts``): one rule, the same answer everywhere.

Each rule has a focused test with a case that passes and one that is refused; the last tests
show the engine's resolver and the recipe validator reach the same verdict through it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from verl_ds4 import ds4_facts
from verl_ds4.ds4_facts import Violation

ROOT = Path(__file__).resolve().parents[1]


def test_window_rows_is_the_one_d_window_rule():
    """D_window = max(window, 2*m) for CSA (m=4), max(window, m) otherwise."""
    rows = ds4_facts.window_rows
    assert rows(128, 0) == 128 and rows(128, 4) == 128 and rows(128, 128) == 128
    assert rows(2, 4) == 8 and rows(2, 0) == 2 and rows(32, 128) == 128


def test_min_local_rows_is_the_largest_layer_need():
    assert ds4_facts.min_local_rows(128, ds4_facts.with_mtp(ds4_facts.FLASH_LAYER_RATIOS, 1)) == 128
    assert ds4_facts.min_local_rows(16, (0, 4, 0)) == 16
    assert ds4_facts.min_local_rows(4, (0, 4, 0)) == 8  # the CSA pool, not the window
    assert ds4_facts.min_local_rows(16, (0, 4, 128)) == 128  # one HCA layer decides
    assert ds4_facts.min_local_rows(16, ()) == 16


def test_published_layer_ratios_and_mtp():
    flash, pro = ds4_facts.FLASH_LAYER_RATIOS, ds4_facts.PRO_LAYER_RATIOS
    assert len(flash) == 43 and len(pro) == 61
    assert ds4_facts.with_mtp(flash, 1) == flash + (0,)
    from verl_ds4.layout.cost import DS4_FLASH_LAYER_RATIOS, DS4_PRO_LAYER_RATIOS

    assert DS4_FLASH_LAYER_RATIOS == ds4_facts.with_mtp(flash, 1) and DS4_PRO_LAYER_RATIOS == ds4_facts.with_mtp(pro, 1)


@pytest.mark.parametrize("name, ratios", [("flash", ds4_facts.FLASH_LAYER_RATIOS), ("pro", ds4_facts.PRO_LAYER_RATIOS)])
def test_yaml_model_files_carry_the_facts(name, ratios):
    block = yaml.safe_load((ROOT / "configs" / "ds4_model" / f"{name}.yaml").read_text())
    assert tuple(block["compress_ratios"]) == ratios and block["num_layers"] == len(ratios)
    from verl_ds4.models.ds4.provider import DS4ModelFacts

    facts = DS4ModelFacts.from_recipe_block(block, name)
    assert facts.min_local_rows == 128
    # every key of the YAML block is read: by DS4ModelFacts and its sizes (memory model), or by the
    # full-size meta-device build and the published totals (tests/test_ds4_full_size_on_cpu.py)
    import dataclasses

    from verl_ds4.models.ds4.sizes import DS4Sizes

    read = {"name", "hf_model_type", "num_layers", "mtp_layers", "hidden_size", "num_attention_heads",
            "n_routed_experts", "num_experts_per_tok", "csa_window_size", "index_topk", "compress_ratios",
            "max_position_embeddings"}  # fmt: skip
    assert facts.max_position_embeddings == block["max_position_embeddings"]  # read: ds4.max_seq_len's limit
    read |= {f.name for f in dataclasses.fields(DS4Sizes)}
    read |= {"qk_rope_head_dim", "routed_scaling_factor", "num_hash_layers", "published_total_billions",
             "published_activated_billions"}  # fmt: skip
    assert set(block) <= read, sorted(set(block) - read)
    assert facts.sizes is not None and facts.sizes.compress_ratios == ratios


def test_layer_ratios_read_from_hf_configs_like_transformers():
    from transformers import DeepseekV4Config

    for n in (1, 2, 7):
        config = DeepseekV4Config(num_hidden_layers=n)  # transformers' default layer pattern
        expected = tuple(ds4_facts.LAYER_TYPE_RATIOS[t] for t in config.layer_types)
        assert ds4_facts.layer_compress_ratios(config) == expected
        assert ds4_facts.layer_compress_ratios(config.to_dict()) == expected
        assert ds4_facts.layer_compress_ratios({"num_hidden_layers": n}) == expected  # no kinds in the file
    legacy = {"num_hidden_layers": 3, "compress_ratios": [0, 4, 128, 0]}  # MTP entry beyond the layers
    assert ds4_facts.layer_compress_ratios(legacy) == (0, 4, 128)
    assert ds4_facts.mtp_layers({"num_nextn_predict_layers": 2}) == 2 and ds4_facts.mtp_layers({}) == 0
    with pytest.raises(ValueError, match="unknown attention kinds"):
        ds4_facts.layer_compress_ratios({"num_hidden_layers": 1, "layer_types": ["full_attention"]})
    with pytest.raises(ValueError, match="must be"):
        ds4_facts.layer_compress_ratios({"num_hidden_layers": 1, "compress_ratios": [16]})
    with pytest.raises(ValueError, match="one per layer"):
        ds4_facts.check_compress_ratios((0, 4), 3)


def test_tensor_parallel_rule():
    assert ds4_facts.check_tensor_parallel(1) is None
    violation = ds4_facts.check_tensor_parallel(2)
    assert isinstance(violation, Violation) and violation.value == 2
    assert "tensor_model_parallel_size=2" in violation.engine_message()
    assert violation.recipe_problem()[1].startswith("is 2, but DS4's hybrid attention does not support")


def test_cp_partition_mode_rule():
    assert ds4_facts.check_cp_partition_mode(None, cp_size=4) is None  # unset: the engine fills contiguous
    assert ds4_facts.check_cp_partition_mode("contiguous", cp_size=4) is None
    assert ds4_facts.check_cp_partition_mode("zigzag", cp_size=1) is None  # nothing is split
    violation = ds4_facts.check_cp_partition_mode("zigzag", cp_size=2)
    assert violation is not None and violation.recipe_problem()[1].startswith("is 'zigzag' with CP=2")
    assert ds4_facts.check_cp_partition_mode("zigzag", cp_size=1, dynamic_cp=True) is not None


def test_packing_scheduler_rule():
    for ok in (None, *ds4_facts.SEQUENCE_PACKING_SCHEDULERS):
        assert ds4_facts.check_packing_scheduler(ok, cp_size=2) is None
    assert ds4_facts.check_packing_scheduler("naive", cp_size=1) is None
    assert "sequence_packing_scheduler='naive'" in ds4_facts.check_packing_scheduler("naive", 2).engine_message()


def test_rows_per_rank_rule():
    assert ds4_facts.check_rows_per_rank(128, 128, "max_seqlen_per_dp_cp_rank") is None
    for short in (127, None):
        violation = ds4_facts.check_rows_per_rank(short, 128, "max_seqlen_per_dp_cp_rank")
        assert violation is not None and ">= 128" in violation.fix


def test_fill_transformer_config_fills_only_what_is_unset():
    fields = ("cp_partition_mode", "sequence_packing_scheduler")
    assert ds4_facts.fill_transformer_config({}, fields, cp_size=1, dynamic_cp=False) == {}
    assert ds4_facts.fill_transformer_config({}, fields, cp_size=2, dynamic_cp=False) == {
        "cp_partition_mode": "contiguous",
        "sequence_packing_scheduler": ds4_facts.DEFAULT_SEQUENCE_PACKING_SCHEDULER,
    }
    user = {"sequence_packing_scheduler": "dp_balanced"}
    assert ds4_facts.fill_transformer_config(user, fields, 2, False) == {"cp_partition_mode": "contiguous"}
    assert ds4_facts.fill_transformer_config({}, ("cp_partition_mode",), 2, False) == {"cp_partition_mode": "contiguous"}


# ----------------------------------------------------------- the engine and the validator agree


def test_engine_and_validator_row_minimum_are_one_rule():
    """The validator's row minimum (DS4ModelFacts) is the resolver's (from a TransformerConfig)."""
    from types import SimpleNamespace

    from verl_ds4.mcore.resolver import _ds4_window
    from verl_ds4.models.ds4.provider import DS4ModelFacts

    for window, ratios in ((128, (0, 4, 128)), (16, (0, 4, 0)), (16, (4, 128)), (2, (4,))):
        facts = DS4ModelFacts("t", "deepseek_v4", len(ratios), 1, 64, 1, 2, 1, window, 4, ratios, "test")
        tf_config = SimpleNamespace(csa_window_size=window, csa_compress_ratios=list(ds4_facts.with_mtp(ratios, 1)))
        assert facts.min_local_rows == _ds4_window(tf_config) == ds4_facts.min_local_rows(window, ratios + (0,))
    # negative control: the validator's old rule (the window alone) differs where an HCA layer decides
    assert ds4_facts.min_local_rows(16, (4, 128)) != 16


def test_engine_and_validator_refuse_with_the_same_reason():
    from verl_ds4.mcore.resolver import CPLayoutError, transformer_config_fills

    hf = type("HF", (), {"model_type": ds4_facts.HF_MODEL_TYPE})()
    fields = ("cp_partition_mode", "sequence_packing_scheduler")
    cases = [
        (dict(user_overrides={}, cp_size=1, tp_size=2), ds4_facts.check_tensor_parallel(2)),
        (dict(user_overrides={"cp_partition_mode": "zigzag"}, cp_size=2, tp_size=1),
         ds4_facts.check_cp_partition_mode("zigzag", 2)),
        (dict(user_overrides={"sequence_packing_scheduler": "naive"}, cp_size=2, tp_size=1),
         ds4_facts.check_packing_scheduler("naive", 2)),
    ]  # fmt: skip
    for kwargs, violation in cases:
        with pytest.raises(CPLayoutError) as info:
            transformer_config_fills(hf, config_fields=fields, **kwargs)
        assert str(info.value) == violation.engine_message()
        assert violation.reason in violation.recipe_problem()[1]
    assert transformer_config_fills(hf, user_overrides={}, cp_size=2, tp_size=1, config_fields=fields)


def test_ds4_cost_model_is_built_from_the_models_config():
    """cp_balance=ds4 balances DS4-Pro with Pro's layers, not Flash's (the default shape)."""
    import numpy as np
    from transformers import DeepseekV4Config

    from verl_ds4.engine.config import cp_balance_cost_model, ds4_cost_shape
    from verl_ds4.layout.cost import DS4CostShape, ds4_cost_model

    pro = DeepseekV4Config(num_hidden_layers=61, compress_ratios=list(ds4_facts.PRO_LAYER_RATIOS), index_topk=1024)
    shape = ds4_cost_shape(pro)
    assert shape.layer_ratios == ds4_facts.with_mtp(ds4_facts.PRO_LAYER_RATIOS, 1) and shape.index_topk == 1024
    model = cp_balance_cost_model("ds4", pro)
    flash = ds4_cost_model(DS4CostShape())
    lengths = np.array([100, 4096, 65536])
    assert not np.allclose(model.prefix_cost(lengths), flash.prefix_cost(lengths))  # negative control: shapes matter
    assert cp_balance_cost_model(None, pro) is None
    assert cp_balance_cost_model("dense", pro) == "dense"  # no shape: the name reaches PlanOptions
    assert cp_balance_cost_model("ds4", None) == "ds4"  # no model config: the default (Flash) shape
