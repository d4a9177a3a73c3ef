"""DeepSeek-V4.1 config facts and start-up refusals (``verl_ds4.ds41_facts``).

Layer roles of the released Flash schedule and of the tiny test model; every refusal names the
field and the fix, and a valid config passes (negative control); the rules accept and refuse the
same configs as the reference's own validator (NeMo Automodel 0.7.0 ``DeepseekV41TextConfig``),
except where ours are stricter, and there the reference's forward fails; V4 and V4.1 loaders refuse
each other's folders; a V4 model refuses MTP on a checkpoint whose ``mtp.*`` is a DSpark drafter.
"""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
import torch

from verl_ds4 import ds4_facts
from verl_ds4 import ds41_facts as facts
from verl_ds4.testing import ds41_reference as ref

needs_reference = pytest.mark.skipif(ref.reference_missing() is not None, reason=str(ref.reference_missing()))

FLASH_TEXT = dict(
    num_hidden_layers=40, vocab_size=129280, sliding_window=128, rms_norm_eps=1e-20, rope_theta=10000.0,
    compress_rope_theta=160000.0, rope_scaling=dict(facts.TEXT_DEFAULTS["rope_scaling"]),
    compress_ratios=list(facts.FLASH_COMPRESS_RATIOS), kv_source_layer_ids=list(facts.FLASH_KV_SOURCES),
    index_source_layer_ids=list(facts.FLASH_INDEX_SOURCES), candidate_source_layer_id=facts.FLASH_CANDIDATE_SOURCE,
    candidate_block_size=8, candidate_topk_blocks=2048, engram_layer_ids=list(facts.FLASH_ENGRAM_LAYERS),
    engram_num_embeddings=[384006168, 384016682], engram_max_ngram_size=4, engram_vocab_size=16000000,
    engram_n_heads=8, engram_head_dim=256, engram_pad_token_id=2, engram_compressed_vocab_size=99092,
    num_nextn_predict_layers=3, dspark_block_size=5, dspark_target_layer_ids=[37, 38, 39], dspark_markov_rank=256,
)  # fmt: skip


def v41(text: dict) -> dict:
    return {"model_type": facts.HF_MODEL_TYPE, "text_config": text}


def refusals(text: dict, files=None) -> list[ds4_facts.Violation]:
    return facts.config_violations(v41(text), tokenizer_files=files)


def test_flash_schedule_roles_and_engram_table_sizes():
    f = facts.read_config(v41(FLASH_TEXT), tokenizer_files=["config.json", "tokenizer.json"])
    assert Counter(r.role for r in f.roles) == {"window": 2, "full": 4, "reindex": 4, "reuse": 30}
    by = {r.layer: r for r in f.roles}
    assert (by[2].role, by[3].role, by[3].kv_source, by[3].topk_source) == ("full", "reuse", 2, 2)
    assert (by[20].role, by[20].ratio, by[21].kv_source) == ("full", 1, 20)
    assert (by[24].role, by[24].kv_source, by[24].candidate_source, by[25].topk_source) == ("reindex", 20, 20, 24)
    assert f.engram_layers == (1, 14) and by[14].engram and not by[13].engram
    assert (f.dspark_stages, f.dspark_targets) == (3, (37, 38, 39))
    # The released table sizes are exactly the sums of their hash-bucket primes (computed here).
    assert facts.engram_rows_needed(FLASH_TEXT) == [384006168, 384016682]


def test_tiny_reference_config_roles():
    f = facts.read_config(v41(ref.tiny_text_config()))
    assert [r.role for r in f.roles] == ["window", "window", "full", "reindex", "reuse", "full", "reindex", "reuse"]
    assert [r.topk_source for r in f.roles] == [None, None, 2, 3, 3, 5, 6, 6]
    assert [r.candidate_source for r in f.roles] == [None] * 6 + [5, None]
    assert f.engram_layers == (1, 3) and f.dspark_stages == 3


def mutated(base: dict, **changes) -> dict:
    text = copy.deepcopy(base)
    text.update(changes)
    return text


# (name, changes to the tiny config, field named in the refusal, a phrase of the fix)
BAD = [
    ("source after its reader", dict(kv_source_layer_ids=[3, 5], index_source_layer_ids=[3, 5, 6]), "kv_source_layer_ids", "Add layer 2"),
    ("source of another ratio", dict(compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0]), "kv_source_layer_ids", "compresses by 2"),
    ("window-only source", dict(kv_source_layer_ids=[1, 2, 5], index_source_layer_ids=[1, 2, 3, 5, 6]), "kv_source_layer_ids", "window-only"),
    ("KV source not an index source", dict(index_source_layer_ids=[3, 5, 6]), "index_source_layer_ids", "Add every kv_source_layer_ids"),
    ("candidate not a Full layer", dict(candidate_source_layer_id=6), "candidate_source_layer_id", "kv_source_layer_ids"),
    ("candidate without blocks", dict(candidate_block_size=0), "candidate_block_size", "positive integer"),
    ("unsorted sources", dict(kv_source_layer_ids=[5, 2]), "kv_source_layer_ids", "sorted list"),
    ("Engram without table sizes", dict(engram_num_embeddings=[200]), "engram_num_embeddings", "one engram_num_embeddings entry"),
    ("Engram table too small", dict(engram_num_embeddings=[20, 210]), "engram_num_embeddings", "rows"),
    ("Engram unigrams only", dict(engram_max_ngram_size=1), "engram_max_ngram_size", "engram_layer_ids=[]"),
    ("DSpark stage compressed", dict(compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 0, 2, 0]), "compress_ratios", "zeros"),
    ("DSpark target beyond the backbone", dict(dspark_target_layer_ids=[6, 7, 8]), "dspark_target_layer_ids", "[0, 8)"),
    ("ratios too short", dict(compress_ratios=[0, 0, 2]), "compress_ratios", "one non-negative ratio per layer"),
]  # fmt: skip


@pytest.mark.parametrize("name,changes,key,fix", BAD, ids=[b[0] for b in BAD])
def test_each_bad_config_is_refused_with_field_and_fix(name, changes, key, fix):
    text = mutated(ref.tiny_text_config(), **changes)
    found = refusals(text)
    assert any(v.key == key and fix in v.engine_message() for v in found), [v.engine_message() for v in found]
    with pytest.raises(ValueError, match=f"{key}="):
        facts.read_config(v41(text))


def test_negative_control_valid_configs_pass():
    assert refusals(ref.tiny_text_config()) == []
    assert refusals(ref.tiny_text_config(), files=["tokenizer.json"]) == []
    assert refusals(FLASH_TEXT) == []
    # A window-only layer between a source and its reader is fine; so is a model without Engram.
    assert refusals(mutated(ref.tiny_text_config(), compress_ratios=[0, 0, 2, 0, 2, 1, 1, 1, 0, 0, 0],
                            index_source_layer_ids=[2, 5, 6])) == []  # fmt: skip
    assert refusals(mutated(ref.tiny_text_config(), engram_layer_ids=[], engram_num_embeddings=[]), files=[]) == []


def test_engram_without_its_tokenizer_tables_is_refused():
    found = refusals(ref.tiny_text_config(), files=["config.json", "model.safetensors"])
    assert [v.key for v in found] == ["tokenizer.json"]
    assert "normalisation tables" in found[0].reason and "engram_layer_ids=[]" in found[0].fix


def test_full_layer_after_the_candidate_source_is_refused():
    text = mutated(ref.tiny_text_config(), kv_source_layer_ids=[2, 5, 6], candidate_source_layer_id=5)
    found = refusals(text)
    assert [v.key for v in found] == ["candidate_source_layer_id"] and "candidate_source_layer_id=6" in found[0].fix


def test_model_types_refuse_each_others_folders(tmp_path):
    from verl_ds4.models.ds4.hf_checkpoint import HFCheckpointError, read_config
    from verl_ds4.models.ds4.model_config import hf_config_object

    assert ds4_facts.HF_MODEL_TYPE == "deepseek_v4" and facts.HF_MODEL_TYPE == "deepseek_v41"
    v4_dict = {"model_type": ds4_facts.HF_MODEL_TYPE, "num_hidden_layers": 2}
    refused = facts.check_model_type(v4_dict, "ds41")
    assert refused.key == "model_type" and "DeepSeek-V4 checkpoint" in refused.reason and "--model ds4" in refused.fix
    with pytest.raises(ValueError, match="model_type='deepseek_v4'"):
        facts.read_config(v4_dict)
    # V4 code given a V4.1 folder
    (tmp_path / "config.json").write_text(json.dumps(v41(ref.tiny_text_config())))
    with pytest.raises(HFCheckpointError, match="DeepSeek-V4.1 checkpoint.*--model ds41"):
        read_config(tmp_path)
    with pytest.raises(ValueError, match="DeepSeek-V4.1 checkpoint"):
        hf_config_object(v41(ref.tiny_text_config()))
    # negative controls: each family accepts its own
    assert facts.check_model_type(v41({}), "ds41") is None and facts.check_model_type(v4_dict, "ds4") is None
    assert hf_config_object({"model_type": "deepseek_v4", "num_hidden_layers": 2}).num_hidden_layers == 2


def test_v4_model_refuses_mtp_on_a_dspark_checkpoint():
    from verl_ds4.models.ds4.model_config import ds4_transformer_config
    from verl_ds4.testing.ds4_tiny import tiny_hf_config

    v4 = tiny_hf_config(num_nextn_predict_layers=1).to_dict()
    dspark = dict(v4, dspark_block_size=5, dspark_target_layer_ids=[1, 2, 3])
    refused = facts.check_v4_mtp(dspark, True)
    assert refused.key == "ds4.mtp" and "half-load" in refused.reason and "ds4.mtp=false" in refused.fix
    with pytest.raises(ValueError, match="num_nextn_predict_layers=1.*DSpark drafter.*allow_mtp_skip=True"):
        ds4_transformer_config(dspark)
    # negative controls: MTP off, or a checkpoint with a real MTP layer
    assert facts.check_v4_mtp(dspark, False) is None and facts.check_v4_mtp(v4, True) is None


# ---------------------------------------------------------------- the reference's own validator


def reference_accepts(text: dict) -> bool:
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig

    try:
        DeepseekV41TextConfig(**text)
    except ValueError:
        return False
    return True


@needs_reference
@pytest.mark.parametrize("name,changes", [(b[0], b[1]) for b in BAD] + [("valid", {})], ids=[b[0] for b in BAD] + ["valid"])
def test_same_verdict_as_the_reference_validator(name, changes):
    text = mutated(ref.tiny_text_config(), **changes)
    ours = not refusals(text)
    if name == "DSpark stage compressed":
        # The backbone's validator does not read the draft stages; its DSpark drafter refuses them.
        assert reference_accepts(text) and not ours
        with pytest.raises(ValueError, match="SWA-only"):
            ref.build_reference_dspark(text)
        return
    if name == "Engram table too small":
        # The config validator does not size the tables; the reference's n-gram hash refuses them.
        assert reference_accepts(text) and not ours
        with pytest.raises(ValueError, match="requires .* rows for its hash buckets"):
            ref.build_reference_model(text)
        return
    if name == "DSpark target beyond the backbone":
        assert reference_accepts(text) and not ours
        with ref.fp64_reference(), pytest.raises(ValueError, match="target layer IDs must be integers in"):
            ref.build_reference_model(text).get_dspark_target_feature_modules(text["dspark_target_layer_ids"])
        return
    assert ours == reference_accepts(text), name


@needs_reference
def test_where_ours_is_stricter_the_reference_forward_fails():
    """A Full layer after the candidate source: the reference's validator accepts the schedule, its
    forward raises at the first hierarchical layer (no candidates after the Full layer's reset)."""
    text = mutated(ref.tiny_text_config(), kv_source_layer_ids=[2, 5, 6], candidate_source_layer_id=5)
    assert reference_accepts(text) and refusals(text)
    with ref.fp64_reference():
        model = ref.build_reference_model(text)
        with pytest.raises(ValueError, match="requires candidates"):
            model(torch.randint(0, 40, (1, 8)))


# ------------------------------------------------------------------- the recipe validator (verl-ds4 recipe)

V4_FLASH = {"model_type": "deepseek_v4", "num_hidden_layers": 43, "num_nextn_predict_layers": 1, "hidden_size": 4096,
            "n_routed_experts": 256, "num_experts_per_tok": 6, "sliding_window": 128}  # fmt: skip


def recipe_errors(tmp_path, config: dict, *overrides: str) -> list:
    from verl_ds4.recipes.compose import compose_recipe
    from verl_ds4.recipes.validate import validate_recipe

    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    cfg = compose_recipe("sft", [f"model.path={folder}", *overrides])
    return validate_recipe(cfg, "sft", dry_run=True, raise_on_error=False).errors


def test_recipe_refuses_ds4_mtp_on_a_dspark_checkpoint(tmp_path):
    dspark = dict(V4_FLASH, dspark_block_size=5, dspark_target_layer_ids=[40, 41, 42])
    errors = recipe_errors(tmp_path, dspark)  # the SFT recipe has ds4.mtp=true
    # one refusal (verl_ds4/recipes/checkpoint_check.py reads the config keys and the tensor names)
    found = [e for e in errors if "DSpark drafter" in e.message]
    assert len(found) == 1 and found[0].setting == "model.mtp.enable" and "ds4.mtp=false" in found[0].fix
    # negative controls: MTP off, or a checkpoint with a real MTP layer
    assert not [e for e in recipe_errors(tmp_path, dspark, "ds4.mtp=false") if "DSpark" in e.message]
    assert not [e for e in recipe_errors(tmp_path, V4_FLASH) if "DSpark" in e.message]


def test_recipe_refuses_a_v41_folder_with_the_fix(tmp_path):
    errors = recipe_errors(tmp_path, v41(ref.tiny_text_config()))
    found = [e for e in errors if "model_type='deepseek_v41'" in e.message]
    assert len(found) == 1 and "DeepSeek-V4.1 checkpoint" in found[0].message and "--model ds41" in found[0].fix
