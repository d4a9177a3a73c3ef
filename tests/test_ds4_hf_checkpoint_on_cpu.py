"""HF DeepSeek-V4 folders in and out of the Megatron DS4 model.

* a ``save_pretrained`` folder loads and saves back bit-identically (names, dtypes, bytes);
* DeepSeek's native names: what we write is what transformers' conversion mapping reads
  (``from_pretrained`` gets the original weights back), and it round-trips too;
* bad folders (model type, missing / unexpected tensor, wrong shape) fail naming the tensor and shapes;
* ``verl_ds4.models.ds4.hf_check.hf_logits`` on a folder at CP = 2 equals transformers at fp64;
* the model's Megatron ``sharded_state_dict`` covers every tensor and a dist-checkpoint round trip
  restores the weights.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from verl_ds4.models.ds4.hf_checkpoint import HFCheckpointError, load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from verl_ds4.testing.ds4_tiny import random_hf_model, random_sequences, tiny_hf_config  # noqa: E402


def in_megatron_child(body, *args):
    """Run ``body(*args)`` in a forked gloo rank of one with Megatron's parallel state (GPTModel needs
    it); the test process itself never starts gloo, so later forks stay safe."""
    from verl_ds4.mcore.distributed import run_distributed

    def rank_main(rank, world):
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel()
        try:
            return body(*args)
        finally:
            parallel_state.destroy_model_parallel()

    return run_distributed(rank_main, 1)[0]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny DS4 written by transformers' own ``save_pretrained`` (fp32 on disk)."""
    cfg = tiny_hf_config()
    hf = random_hf_model(cfg, seed=1).float()
    folder = tmp_path_factory.mktemp("ds4") / "hf"
    hf.save_pretrained(folder)
    return folder


def _same_files(a, b):
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and ta[name].shape == tb[name].shape, name
        assert torch.equal(ta[name].view(torch.uint8) if ta[name].is_floating_point() else ta[name],
                           tb[name].view(torch.uint8) if tb[name].is_floating_point() else tb[name]), name
    return ta


def test_save_pretrained_folder_round_trips_bit_identically(hf_folder, tmp_path):
    in_megatron_child(_test_save_pretrained_folder_round_trips_bit_identically, hf_folder, tmp_path)


def _test_save_pretrained_folder_round_trips_bit_identically(hf_folder, tmp_path):
    model, info = load_hf_checkpoint(hf_folder, dtype=torch.float64, cp_size=1)
    assert info.family == "transformers" and model.config.params_dtype == torch.float64
    tensors = _same_files(hf_folder, save_hf_checkpoint(model, tmp_path / "out", info))
    assert any(".mlp.experts.3.w2.weight" in n for n in tensors)  # experts are separate tensors
    # negative control: one changed weight is seen
    with torch.no_grad():
        model.decoder.layers[0].mlp.router.weight[0, 0] += 1e-3
    save_hf_checkpoint(model, tmp_path / "changed", info)
    with pytest.raises(AssertionError):
        _same_files(hf_folder, tmp_path / "changed")


def test_native_names_are_what_transformers_reads(hf_folder, tmp_path):
    in_megatron_child(_test_native_names_are_what_transformers_reads, hf_folder, tmp_path)


def _test_native_names_are_what_transformers_reads(hf_folder, tmp_path):
    from transformers import DeepseekV4ForCausalLM

    model, _ = load_hf_checkpoint(hf_folder, dtype=torch.float32, cp_size=1)
    native = save_hf_checkpoint(model, tmp_path / "native", family="native", config=json.loads((hf_folder / "config.json").read_text()))
    names = load_file(str(native / "model.safetensors"))
    assert "layers.1.attn.wq_a.weight" in names and "layers.1.attn.indexer.compressor.wkv.weight" in names
    assert "layers.0.ffn.gate.tid2eid" in names and "layers.1.ffn.gate.bias" in names and "embed.weight" in names
    original = DeepseekV4ForCausalLM.from_pretrained(hf_folder)
    reread, loading = DeepseekV4ForCausalLM.from_pretrained(native, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    for (name, a), (_, b) in zip(sorted(original.state_dict().items()), sorted(reread.state_dict().items())):
        assert torch.equal(a, b), name
    again, info = load_hf_checkpoint(native, dtype=torch.float64, cp_size=1)
    assert info.family == "native"
    _same_files(native, save_hf_checkpoint(again, tmp_path / "native2", info))


def _broken(hf_folder, tmp_path, edit):
    folder = tmp_path / "broken"
    shutil.copytree(hf_folder, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_bad_folders_fail_naming_the_tensor(hf_folder, tmp_path):
    in_megatron_child(_test_bad_folders_fail_naming_the_tensor, hf_folder, tmp_path)


def _test_bad_folders_fail_naming_the_tensor(hf_folder, tmp_path):
    name = "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"
    missing = _broken(hf_folder, tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(HFCheckpointError, match=f"missing tensor '{name}'"):
        load_hf_checkpoint(missing, cp_size=1)
    extra = _broken(hf_folder, tmp_path / "u", lambda t: t.update({"model.layers.9.surprise": torch.zeros(2)}))
    with pytest.raises(HFCheckpointError, match=r"unexpected tensor 'model.layers.9.surprise' \(2,\)"):
        load_hf_checkpoint(extra, cp_size=1)
    shape = _broken(hf_folder, tmp_path / "s", lambda t: t.update({"head.weight": torch.zeros(5, 32)}))
    with pytest.raises(HFCheckpointError, match=r"tensor 'head.weight': expected shape \(96, 32\), found \(5, 32\)"):
        load_hf_checkpoint(shape, cp_size=1)
    other = tmp_path / "llama"
    shutil.copytree(hf_folder, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(HFCheckpointError, match="model_type is 'llama', expected 'deepseek_v4'"):
        load_hf_checkpoint(other, cp_size=1)
    load_hf_checkpoint(hf_folder, cp_size=1)  # control: the intact folder loads


def test_hf_logits_matches_transformers_at_cp2(hf_folder):
    from transformers import DeepseekV4ForCausalLM

    from verl_ds4.models.ds4 import hf_logits  # the public name
    from verl_ds4.models.ds4.hf_reference import fp64_reference, hf_model_logits

    seqs = random_sequences([23, 4, 40], 96, seed=5)
    ours = hf_logits(hf_folder, seqs, cp=2)
    with fp64_reference():  # built under it, so its rotary tables are fp64 too
        ref_model = DeepseekV4ForCausalLM.from_pretrained(hf_folder, dtype=torch.float64, experts_implementation="eager", attn_implementation="eager").double().eval()
        ref = hf_model_logits(ref_model, seqs)
    err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, ref))
    print(f"hf_logits CP=2 vs transformers: max rel error {err:.3e}")
    assert err <= 1e-10


def _dist_ckpt_rank(rank, world, folder, ckpt_dir):
    from megatron.core import dist_checkpointing, parallel_state

    from verl_ds4.substitutes.cuda_literals import cuda_literals_on_cpu
    from verl_ds4.models.ds4.model import build_ds4_model

    import multiprocessing

    # Megatron's async writer starts a multiprocessing Manager; run_distributed's ranks are daemonic.
    multiprocessing.current_process()._config["daemon"] = False
    parallel_state.initialize_model_parallel()
    model, _ = load_hf_checkpoint(folder, dtype=torch.float32, cp_size=1)
    sharded = model.sharded_state_dict()
    plain = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    uncovered = sorted(plain - set(sharded))
    with cuda_literals_on_cpu():
        dist_checkpointing.save(sharded, ckpt_dir)
        fresh = build_ds4_model(json.loads((folder / "config.json").read_text()), dtype=torch.float32, seed=99, cp_size=1)
        differs_before = any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()) if a.is_floating_point())
        fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), ckpt_dir), strict=False)
    equal_after = all(torch.equal(a, b) for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()) if not k.endswith("_extra_state"))
    parallel_state.destroy_model_parallel()
    return uncovered, differs_before, equal_after


def test_sharded_state_dict_and_dist_checkpoint_round_trip(hf_folder, tmp_path):
    from verl_ds4.mcore.distributed import run_distributed

    (tmp_path / "ckpt").mkdir()
    (uncovered, differs_before, equal_after), = run_distributed(_dist_ckpt_rank, 1, args=(hf_folder, str(tmp_path / "ckpt")))
    assert uncovered == []
    assert differs_before and equal_after


def test_verify_cli_compares_a_folder_with_transformers(hf_folder, capsys, monkeypatch, tmp_path):
    import transformers.utils.logging as hf_logging

    from verl_ds4.cli import main

    monkeypatch.setenv("VERL_DS4_LOG_DIR", str(tmp_path))
    # Negative controls: a tolerance no fp64 computation meets fails the run; with --verbose transformers'
    # loading progress bar shows (the quiet console below hides it).
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    hf_logging.enable_progress_bar()
    assert main(["--verbose", "verify", "--hf-checkpoint", str(hf_folder), "--fp64-rtol", "0"]) == 1
    assert "Loading weights" in capsys.readouterr().err
    assert main(["verify", "--hf-checkpoint", str(hf_folder), "--cp", "2"]) == 0
    captured = capsys.readouterr()
    assert "logits     max rel error" in captured.out and "PASSED" in captured.out
    assert "Loading weights" not in captured.err and "%|" not in captured.err, captured.err
    hf_logging.enable_progress_bar()


# Megatron-LM dev's DSv4 attention parameters (csa.py at the proven commits: the layer's
# projections and norms on self_attention; attn_sink, compressor and indexer on its core_attention,
# a CompressedSparseAttention). Sliding layers have no compressor, HCA no indexer.
DEV_ATTENTION_NAMES = {
    "sliding": {"linear_q_down_proj.weight", "q_layernorm.weight", "linear_q_up_proj.weight", "linear_kv_proj.weight",
                "kv_layernorm.weight", "linear_o_group_proj", "linear_proj.weight", "core_attention.attn_sink"},
}
_COMPRESSOR = {"linear_wkv.weight", "linear_wgate.weight", "ape", "norm.weight"}
DEV_ATTENTION_NAMES["hca"] = DEV_ATTENTION_NAMES["sliding"] | {f"core_attention.compressor.{n}" for n in _COMPRESSOR}
DEV_ATTENTION_NAMES["csa"] = DEV_ATTENTION_NAMES["hca"] | {f"core_attention.indexer.compressor.{n}" for n in _COMPRESSOR} | {
    "core_attention.indexer.linear_wq_b.weight", "core_attention.indexer.linear_weights_proj.weight"}


def _doc_table_names() -> set[str]:
    """Every name of the 'ours' column of docs/ds4-model.md section 5, braces expanded, prefix kept."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "ds4-model.md").read_text()
    section = text[text.index("## 5. Checkpoint names"):text.index("## 6.")]
    names = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[-1].startswith("`"):
            continue
        for tick in re.findall(r"`([^`]+)`", cells[-1]):
            m = re.fullmatch(r"(.*)\{([^}]*)\}(.*)", tick)
            for name in ([m.group(1) + part + m.group(3) for part in m.group(2).split(",")] if m else [tick]):
                names.add(name.replace("…", "").lstrip("."))
    return names


def _attention_names_by_kind(model) -> dict[str, set[str]]:
    by_kind = {}
    for layer in model.decoder.layers:
        attn = layer.self_attention
        by_kind.setdefault(attn.spec.kind, {n for n, _ in attn.named_parameters()})
    return by_kind


def test_attention_parameter_names_are_megatron_dev_names(hf_folder):
    in_megatron_child(_test_attention_parameter_names_are_megatron_dev_names, hf_folder)


def _test_attention_parameter_names_are_megatron_dev_names(hf_folder):
    model, _ = load_hf_checkpoint(hf_folder, dtype=torch.float64, cp_size=1)
    by_kind = _attention_names_by_kind(model)
    assert set(by_kind) == {"sliding", "csa", "hca"}
    for kind, names in by_kind.items():
        assert names == DEV_ATTENTION_NAMES[kind], (kind, sorted(names ^ DEV_ATTENTION_NAMES[kind]))
    # ... and each is in the docs' name table, under self_attention.
    documented = _doc_table_names()
    for name in by_kind["csa"]:
        assert f"self_attention.{name}" in documented, f"self_attention.{name} missing from docs/ds4-model.md section 5"
    # negative control: the names before the rename (ours, not dev's) are neither dev's nor documented
    for old in ("attn_sink", "compressor.linear_kv.weight", "indexer.linear_q_up.weight", "indexer.linear_weights.weight"):
        assert old not in DEV_ATTENTION_NAMES["csa"] and f"self_attention.{old}" not in documented
