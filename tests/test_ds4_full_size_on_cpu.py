"""Full-size DS4 facts, checked on the ``meta`` device (no weights allocated: seconds, ~0.5 GB RSS).

DeepSeek-V4-Flash and -Pro are built at full size from the numbers in ``configs/ds4_model/*.yaml``
twice: as transformers' ``DeepseekV4ForCausalLM`` (from a ``DeepseekV4Config`` with those values)
and as this project's ``DS4Model``. The test checks that

1. the two agree per layer and per component (attention, compressor, indexer, mHC, router,
   routed experts, shared expert; embedding and head);
2. the closed form of :mod:`verl_ds4.models.ds4.sizes` (which the memory model uses) equals both,
   component by component, MTP included (transformers does not build MTP: ours is the reference);
3. the totals without MTP equal DeepSeek's published sizes (total; activated per token: no input
   embedding, top-k of the routed experts, the output head counted), which the YAML files carry.

Negative controls: Pro with the 64 heads ``pro.yaml`` used to say misses the published activated
size by ~10B; a closed form that forgot the CSA compressor's overlap width misses the meta count.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from importlib.resources import files

import pytest
import torch
import yaml

from verl_ds4 import ds4_facts
from verl_ds4.models.ds4.sizes import LAYER_COMPONENTS, DS4Sizes

MODELS = ("flash", "pro")

# (pattern on the name without the layer index, component); first match wins.
HF_COMPONENTS = [
    (r"^model\.embed_tokens\.", "embedding"),
    (r"^(lm_head|model\.norm|model\.hc_head)\.", "head"),
    (r"\.self_attn\.compressor\.indexer\.", "indexer"),
    (r"\.self_attn\.compressor\.", "compressor"),
    (r"\.(self_attn|input_layernorm)\.", "attention"),
    (r"\.(attn_hc|ffn_hc)\.", "mhc"),
    (r"\.(mlp\.gate|post_attention_layernorm)\.", "moe_router"),
    (r"\.mlp\.experts\.", "moe_routed"),
    (r"\.mlp\.shared_experts\.", "moe_shared"),
]
OURS_COMPONENTS = [
    (r"^embedding\.", "embedding"),
    (r"^(output_layer|decoder\.final_layernorm|decoder\.hc_head)\.", "head"),
    (r"\.core_attention\.indexer\.", "indexer"),
    (r"\.core_attention\.compressor\.", "compressor"),
    (r"\.(self_attention|input_layernorm)\.", "attention"),
    (r"\.(attn_hc|mlp_hc)\.", "mhc"),
    (r"\.(mlp\.router|pre_mlp_layernorm)\.", "moe_router"),
    (r"\.mlp\.experts\.", "moe_routed"),
    (r"\.mlp\.shared_experts\.", "moe_shared"),
]
LAYER_INDEX = {"hf": re.compile(r"^model\.layers\.(\d+)\."), "ours": re.compile(r"^decoder\.layers\.(\d+)\.")}


def model_block(name: str) -> dict:
    return yaml.safe_load((files("verl_ds4.configs_data") / "ds4_model" / f"{name}.yaml").read_text())


def hf_config(block: dict, **overrides):
    """transformers' ``DeepseekV4Config`` with the model file's numbers (layer kinds and YaRN as the hub's)."""
    from transformers import DeepseekV4Config

    kinds = {v: k for k, v in ds4_facts.LAYER_TYPE_RATIOS.items()}
    keys = ("vocab_size", "hidden_size", "num_attention_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank",
            "o_groups", "o_lora_rank", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
            "moe_intermediate_size", "routed_scaling_factor", "index_n_heads", "index_head_dim", "index_topk",
            "hc_mult", "num_hash_layers")
    values = {k: block[k] for k in keys}
    values.update(overrides)
    return DeepseekV4Config(
        **values,
        num_hidden_layers=block["num_layers"],
        num_nextn_predict_layers=block["mtp_layers"],
        sliding_window=block["csa_window_size"],
        layer_types=[kinds[r] for r in block["compress_ratios"]],
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
    )


def count(named_parameters, rules, side: str):
    """``{layer index or None: Counter(component -> elements)}``; MTP parameters under key ``"mtp"``."""
    out: dict = collections.defaultdict(collections.Counter)
    for name, p in named_parameters:
        if name.startswith("mtp."):
            out["mtp"]["mtp"] += p.numel()
            continue
        m = LAYER_INDEX[side].match(name)
        component = next((c for pattern, c in rules if re.search(pattern, name)), None)
        assert component is not None, f"{side} parameter {name} matches no component"
        out[int(m.group(1)) if m else None][component] += p.numel()
    return out


def _build_counts(rank: int, world: int) -> dict:
    """In a gloo child process (Megatron's parallel state initialised there, so this pytest process
    keeps no process group behind): both full-size builds on the meta device, counted."""
    from megatron.core import parallel_state
    from transformers import DeepseekV4ForCausalLM

    from verl_ds4.models.ds4.model import DS4Model
    from verl_ds4.models.ds4.model_config import ds4_transformer_config

    parallel_state.initialize_model_parallel()
    try:
        result = {}
        for name in MODELS:
            cfg = hf_config(model_block(name))
            with torch.device("meta"):
                hf = DeepseekV4ForCausalLM(cfg)
                ours = DS4Model(ds4_transformer_config(cfg, dtype=torch.bfloat16), vocab_size=cfg.vocab_size)
            assert next(ours.parameters()).is_meta and next(hf.parameters()).is_meta
            plain = lambda counts: {k: dict(v) for k, v in counts.items()}  # noqa: E731  (picklable)
            result[name] = (plain(count(hf.named_parameters(), HF_COMPONENTS, "hf")),
                            plain(count(ours.named_parameters(), OURS_COMPONENTS, "ours")))
            del hf, ours
        return result
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def counts():
    """Per-layer, per-component element counts of both full-size builds, for Flash and Pro."""
    from verl_ds4.mcore.distributed import run_distributed

    built = run_distributed(_build_counts, world_size=1, timeout=300)[0]
    return {name: tuple({k: collections.Counter(v) for k, v in side.items()} for side in pair) for name, pair in built.items()}


@pytest.mark.parametrize("name", MODELS)
def test_transformers_and_ours_agree_per_layer_and_component(counts, name):
    hf, ours = counts[name]
    block = model_block(name)
    assert len([k for k in hf if isinstance(k, int)]) == block["num_layers"]
    for key in set(hf) | set(ours):
        if key == "mtp":
            continue  # transformers does not build MTP
        assert hf[key] == ours[key], f"{name} layer {key}: transformers {dict(hf[key])} vs ours {dict(ours[key])}"


@pytest.mark.parametrize("name", MODELS)
def test_closed_form_equals_the_meta_device_counts(counts, name):
    _, ours = counts[name]
    block = model_block(name)
    sizes = DS4Sizes.from_hf_config({}, name, fallback=block)
    for i, ratio in enumerate(block["compress_ratios"]):
        expected = {k: v for k, v in sizes.layer(ratio).items() if v}
        assert dict(ours[i]) == expected, f"{name} layer {i} (ratio {ratio})"
    assert ours[None] == {"embedding": sizes.embedding(), "head": sizes.head()}
    assert ours["mtp"]["mtp"] == block["mtp_layers"] * sum(sizes.mtp_layer().values())
    assert set(LAYER_COMPONENTS) == set(sizes.layer(4))


@pytest.mark.parametrize("name", MODELS)
def test_totals_equal_the_published_sizes(counts, name):
    hf, ours = counts[name]
    block = model_block(name)
    sizes = DS4Sizes.from_hf_config({}, name, fallback=block)
    total_meta = sum(sum(c.values()) for k, c in ours.items() if k != "mtp")
    assert total_meta == sum(sum(c.values()) for c in hf.values()) == sizes.total()
    assert round(sizes.total() / 1e9, 2) == pytest.approx(block["published_total_billions"], abs=0.01)
    assert round(sizes.activated() / 1e9, 2) == pytest.approx(block["published_activated_billions"], abs=0.01)


def test_exact_figures():
    """The numbers the docs quote (and section 11 of the shared notes measured the same way)."""
    flash = DS4Sizes.from_hf_config({}, "flash", fallback=model_block("flash"))
    pro = DS4Sizes.from_hf_config({}, "pro", fallback=model_block("pro"))
    assert (flash.total(), flash.activated(), flash.total(mtp=True) - flash.total()) == (284_332_230_231, 13_270_091_351, 6_610_048_635)
    assert (pro.total(), pro.activated(), pro.total(mtp=True) - pro.total()) == (1_572_997_179_491, 48_852_379_747, 25_840_145_595)


def test_negative_control_pro_with_64_heads_misses_the_published_activated_size():
    block = dict(model_block("pro"), num_attention_heads=64)
    sizes = DS4Sizes.from_hf_config({}, "pro-64-heads", fallback=block)
    assert abs(sizes.activated() / 1e9 - block["published_activated_billions"]) > 5


def test_negative_control_a_wrong_closed_form_misses_the_meta_count(counts):
    _, ours = counts["flash"]

    class NoOverlap(DS4Sizes):
        def compressor(self, ratio):  # forgets that CSA pools 2m tokens (width 2d)
            return 0 if ratio == 0 else 2 * self.head_dim * self.hidden_size + ratio * self.head_dim + self.head_dim

    wrong = NoOverlap(**dataclasses.asdict(DS4Sizes.from_hf_config({}, "flash", fallback=model_block("flash"))))
    csa = ds4_facts.FLASH_LAYER_RATIOS.index(4)
    assert ours[csa]["compressor"] != wrong.layer(4)["compressor"]
