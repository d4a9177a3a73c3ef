"""Full-size DeepSeek-V4.1-Flash, checked on the ``meta`` device (no weights allocated: ~5 s).

NeMo Automodel 0.7.0's ``DeepseekV41ForCausalLM`` (the V4.1 reference) and its DSpark drafter are
built at Flash size from ``configs/ds4_model/v41_flash.yaml`` on the ``meta`` device, in a gloo child
process, and every parameter is counted per layer and per component. The test checks that

1. the closed form of :mod:`verl_ds4.models.ds41.sizes` (which the memory model uses) equals the
   meta counts component by component: attention, compressor (Full layers only), indexer (index
   sources; key projection on Full layers), mHC, Engram projections and Engram tables, router,
   routed and shared experts, embedding, head, and every DSpark stage;
2. the totals: 748.49B with the Engram tables (551.88B backbone, "~552B" in the shared notes, and
   196.61B of tables whose rows are ``engram_num_embeddings`` x 256), the drafter 14.23B.

Engram's hasher needs a tokenizer whose normalised vocabulary has ``engram_compressed_vocab_size``
entries; the released tokenizer is not here, so the build uses the reference harness's local
tokenizer with that count set to its 21 entries (the hasher's tables are buffers, not parameters:
no count changes). Negative controls: a closed form that gives every compressed layer V4's own
compressor, or Engram rows of width ``h``, misses the meta counts.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from importlib.resources import files

import pytest
import torch
import yaml

from verl_ds4.models.ds41.reference import reference_missing
from verl_ds4.models.ds41.sizes import LAYER_COMPONENTS, DS41Sizes

pytestmark = pytest.mark.skipif(reference_missing() is not None, reason=str(reference_missing()))

# (pattern, component); first match wins. Layer / stage index stripped by LAYER.
RULES = [
    (r"^model\.embed_tokens\.", "embedding"),
    (r"^(lm_head|model\.norm)\.", "head"),  # the drafter's lm_head too: a copy of the target's
    (r"^embed_tokens\.", "embedding"),  # the drafter's copy of the target's
    (r"\.attn\.compressor\.", "compressor"),
    (r"\.attn\.indexer\.", "indexer"),
    (r"\.(attn|attn_norm)\.", "attention"),
    (r"\.(attn_hc|ffn_hc)\.", "mhc"),
    (r"\.engram\.embed\.", "engram_table"),
    (r"\.engram\.", "engram"),
    (r"\.(ffn\.gate|ffn_norm)\.", "moe_router"),
    (r"\.ffn\.experts\.", "moe_routed"),
    (r"\.ffn\.shared_experts\.", "moe_shared"),
    (r"\.(main_proj|main_norm|norm|markov_head|confidence_head)\.", "dspark_extra"),
]
LAYER = re.compile(r"^(model\.layers|mtp)\.(\d+)\.")


def model_block() -> dict:
    return yaml.safe_load((files("verl_ds4.configs_data") / "ds4_model" / "v41_flash.yaml").read_text())


def text_config(block: dict) -> dict:
    from verl_ds4.models.ds41.reference import LOCAL_COMPRESSED_VOCAB

    keys = {k: v for k, v in block.items() if k not in ("name", "hf_model_type")}
    return {**keys, "engram_compressed_vocab_size": LOCAL_COMPRESSED_VOCAB, "dtype": "bfloat16"}


def count(named_parameters, prefix: str) -> dict:
    """``{(prefix, layer) or component-level key: Counter(component -> elements)}``."""
    out: dict = collections.defaultdict(collections.Counter)
    for name, p in named_parameters:
        component = next((c for pattern, c in RULES if re.search(pattern, name)), None)
        assert component is not None, f"{name} matches no component"
        m = LAYER.match(name)
        out[(prefix, int(m.group(2))) if m else (prefix, None)][component] += p.numel()
    return {k: dict(v) for k, v in out.items()}


def _build_counts(rank: int, world: int) -> dict:
    """In a gloo child: NeMo's full-size V4.1 Flash and its drafter on the meta device, counted."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    from verl_ds4.models.ds41 import reference as R

    text = text_config(model_block())
    config = DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0})
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(config, backend=R.reference_backend(), tokenizer=R.local_tokenizer())
        draft = config.build_dspark_draft(R.DSparkOptions(text))
    assert next(model.parameters()).is_meta and next(draft.parameters()).is_meta
    return {**count(model.named_parameters(), "model"), **count(draft.named_parameters(), "draft")}


@pytest.fixture(scope="module")
def counts():
    from verl_ds4.mcore.distributed import run_distributed

    built = run_distributed(_build_counts, world_size=1, timeout=300)[0]
    return {k: collections.Counter(v) for k, v in built.items()}


@pytest.fixture(scope="module")
def sizes() -> DS41Sizes:
    return DS41Sizes.from_hf_config({}, "v41_flash.yaml", fallback=model_block())


def test_closed_form_equals_the_meta_counts_per_layer_and_component(counts, sizes):
    assert sizes.num_layers == 40 and len([k for k in counts if k[0] == "model" and k[1] is not None]) == 40
    for i in range(sizes.num_layers):
        expected = {k: v for k, v in sizes.layer_params(i).items() if v}
        assert dict(counts[("model", i)]) == expected, f"layer {i} ({sizes.roles[i]}, ratio {sizes.compress_ratios[i]})"
    assert dict(counts[("model", None)]) == {"embedding": sizes.embedding(), "head": sizes.head()}
    assert set(LAYER_COMPONENTS) == set(sizes.layer_params(14))


def test_dspark_stages_equal_the_meta_counts(counts, sizes):
    assert sizes.dspark_stages == 3
    for stage in range(3):
        assert dict(counts[("draft", stage)]) == {k: v for k, v in sizes.dspark_stage(stage).items() if v}, stage
    # The drafter holds copies of the target's embedding and output layer (frozen; not its own parameters).
    assert dict(counts[("draft", None)]) == {"embedding": sizes.embedding(), "head": sizes.head() - sizes.hidden_size}


def test_totals(counts, sizes):
    meta_total = sum(sum(c.values()) for k, c in counts.items() if k[0] == "model")
    meta_tables = sum(c.get("engram_table", 0) for k, c in counts.items() if k[0] == "model")
    assert meta_total == sizes.total() == 748_494_654_064
    assert meta_tables == sizes.engram_tables() == (384_006_168 + 384_016_682) * 256
    assert sizes.total() - sizes.engram_tables() == 551_880_804_464  # the "~552B backbone"
    assert sizes.dspark_total() == 14_225_361_762 == sizes.total(mtp=True) - sizes.total()
    # Engram and Full-layer parts sit where the schedule says.
    assert [i for i in range(40) if sizes.layer_params(i)["engram"]] == [1, 14]
    assert [i for i in range(40) if sizes.layer_params(i)["compressor"]] == [2, 8, 14, 20]


def test_negative_control_v4_habits_miss_the_meta_counts(counts, sizes):
    class EveryLayerCompresses(DS41Sizes):  # V4: every compressed layer owns its compressor
        def v41_compressor(self, layer):
            r = self.compress_ratios[layer]
            return 0 if r == 0 else self.head_dim * self.hidden_size * (2 if r > 1 else 1) + self.head_dim

    class WideTables(DS41Sizes):  # table rows of width h instead of engram_head_dim
        def engram(self, layer):
            proj, table = super().engram(layer)
            return proj, table // self.engram_head_dim * self.hidden_size

    for wrong_cls, layer, component in ((EveryLayerCompresses, 3, "compressor"), (WideTables, 1, "engram_table")):
        wrong = wrong_cls(**{f.name: getattr(sizes, f.name) for f in dataclasses.fields(sizes)})
        assert counts[("model", layer)].get(component, 0) != wrong.layer_params(layer)[component], wrong_cls.__name__
        assert wrong.total() != sum(sum(c.values()) for k, c in counts.items() if k[0] == "model")
