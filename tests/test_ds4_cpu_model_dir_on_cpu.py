"""The CPU jobs' model folder is a real DeepSeek-V4 checkpoint, and the CPU builder starts from it.

* ``prepare_cpu_sft_assets(model="ds4")`` writes config.json (a tiny ``DeepseekV4Config`` with every
  DS4 component: layer types, YaRN, mHC, hash layer, clamp; MTP off), safetensors and the tokenizer;
  transformers' ``DeepseekV4ForCausalLM.from_pretrained`` loads it with no missing or unexpected
  tensor, and our Megatron DS4 loaded from it equals transformers at fp64 (so the config describes
  exactly the model we build). Negative control: a config that disagrees with the weights is refused.
* The CPU engine's ``deepseek_v4`` builder loads the folder's weights: a folder with weights of
  another seed gives those; without safetensors it falls back to its seeded init (no hash table).
* The attention-only proxy's config says what it is and describes the attention it has.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from verl_ds4.mcore.distributed import run_distributed
from verl_ds4.cpu.sft_data import prepare_cpu_sft_assets


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return prepare_cpu_sft_assets(tmp_path_factory.mktemp("assets"), model="ds4", n_train=8)["model"]


def test_config_describes_every_ds4_component(folder):
    cfg = json.loads((__import__("pathlib").Path(folder) / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v4" and cfg["architectures"] == ["DeepseekV4ForCausalLM"]
    assert cfg["layer_types"] == ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"]
    assert cfg["compress_rates"] == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    assert cfg["rope_parameters"]["compress"]["rope_type"] == "yarn" and cfg["rope_parameters"]["main"]["rope_type"] == "default"
    assert cfg["hc_mult"] == 4 and cfg["mlp_layer_types"][0] == "hash_moe" and cfg["swiglu_limit"] == 10.0
    assert cfg["num_nextn_predict_layers"] == 0


def test_transformers_loads_the_folder_and_equals_our_model(folder):
    from transformers import DeepseekV4ForCausalLM

    from verl_ds4.verify.hf import compare_with_transformers

    model, info = DeepseekV4ForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    tid2eid = model.model.layers[0].mlp.gate.tid2eid
    assert all(len(set(row.tolist())) == row.numel() for row in tid2eid)  # distinct experts per token
    result = compare_with_transformers(folder, cp=2)
    assert result["logits"] <= 1e-10 and result["log_probs"] <= 1e-10, result


def test_a_config_that_disagrees_with_the_weights_is_refused(folder, tmp_path):
    from verl_ds4.models.ds4.hf_checkpoint import HFCheckpointError

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hc_mult"] = 2
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception) as err:
        run_distributed(_builder_weights, world_size=1, args=(str(bad),), timeout=300)
    assert "hc" in str(err.value) and "expected shape" in str(err.value)
    assert HFCheckpointError.__name__ in str(err.value)


def _builder_weights(rank, world, folder):
    from megatron.core import parallel_state
    from transformers import AutoConfig

    import verl_ds4.cpu.ds4_builder  # noqa: F401  (registers deepseek_v4)
    from verl_ds4.cpu.builders import CPU_MODEL_BUILDERS, cpu_transformer_overrides

    parallel_state.initialize_model_parallel()
    try:
        hf_config = AutoConfig.from_pretrained(folder)
        builder = CPU_MODEL_BUILDERS["deepseek_v4"]
        tf_config = builder.transformer_config(hf_config, torch.float32, cpu_transformer_overrides({}))
        model = builder.build(tf_config, hf_config, pre_process=True, post_process=True, share_embeddings=False)
        # numpy, not tensors: tensors cross the result queue as shared memory that dies with this rank
        return {k: v.detach().numpy().copy() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    finally:
        parallel_state.destroy_model_parallel()


def test_the_cpu_builder_starts_from_the_folder_weights(folder, tmp_path):
    from verl_ds4.models.ds4.hf_checkpoint import read_hf_tensors

    loaded = run_distributed(_builder_weights, world_size=1, args=(folder,), timeout=300)[0]
    files = {k: v.numpy() for k, v in read_hf_tensors(folder).items()}
    eq = __import__("numpy").array_equal
    assert eq(loaded["embedding.word_embeddings.weight"], files["model.embed_tokens.weight"])
    assert eq(loaded["decoder.layers.0.mlp.router.tid2eid"], files["model.layers.0.mlp.gate.tid2eid"])
    # The weights really come from the file: the same config with weights of another seed loads those.
    from transformers import AutoConfig

    from verl_ds4.cpu.ds4_model_dir import write_ds4_weights

    other = tmp_path / "other"
    shutil.copytree(folder, other, ignore=shutil.ignore_patterns("*.safetensors"))
    write_ds4_weights(other, AutoConfig.from_pretrained(folder), seed=7)
    other_files = {k: v.numpy() for k, v in read_hf_tensors(other).items()}
    reloaded = run_distributed(_builder_weights, world_size=1, args=(str(other),), timeout=300)[0]
    assert eq(reloaded["embedding.word_embeddings.weight"], other_files["model.embed_tokens.weight"])
    assert not eq(reloaded["embedding.word_embeddings.weight"], loaded["embedding.word_embeddings.weight"])
    # Without safetensors: the seeded init, whose hash table is not the file's (all zeros).
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    seeded = run_distributed(_builder_weights, world_size=1, args=(str(bare),), timeout=300)[0]
    assert not eq(seeded["decoder.layers.0.mlp.router.tid2eid"], files["model.layers.0.mlp.gate.tid2eid"])
    assert not seeded["decoder.layers.0.mlp.router.tid2eid"].any()


def test_the_proxy_config_says_it_is_a_proxy():
    from verl_ds4.cpu.sft_data import model_hf_config

    cfg = model_hf_config("ds4_proxy")
    assert "not a DeepSeek-V4" in cfg.verl_ds4_note and "no mHC" in cfg.verl_ds4_note
    ratios = cfg.verl_ds4_proxy["compress_ratios"]
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention"}
    assert cfg.layer_types == [kinds.get(r, "heavily_compressed_attention") for r in ratios]
    assert cfg.rope_parameters["compress"]["factor"] == cfg.verl_ds4_proxy["yarn_factor"]
    assert cfg.hc_mult == 1 and cfg.n_routed_experts == 1 and cfg.n_shared_experts == 0
