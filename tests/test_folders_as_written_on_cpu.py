"""Model folders as transformers 5 and NeMo Automodel write them, read by the V4 and V4.1 readers.

The config files are written by the references' own ``save_pretrained``: NeMo Automodel 0.7.0's
``DeepseekV41Config`` (a nested ``text_config`` with ``model_type: deepseek_v41_text`` and YaRN as
``rope_parameters``, no ``rope_scaling``), transformers 5's ``DeepseekV4Config`` (``rope_parameters`` nested by
rope kind) and NeMo Automodel's ``DeepseekV4Config`` (flat, legacy ``compress_ratios``, ``rope_parameters``).

* V4.1: the CPU builder verl's engine runs reads NeMo's folder (YaRN factor 8, not the released 16) and its
  logits equal NeMo's reading of the same folder at fp64; negative control: NeMo reading a copy whose factor
  is 16 (written by NeMo's save_pretrained) is 1e-3 away, so the comparison sees the factor. A real override
  (a top-level ``hidden_size`` on verl's config object) is still refused.
* V4: transformers' and NeMo's folders (YaRN factor 8) both equal transformers at fp64; negative control: our
  model on the factor-16 folder differs from the factor-8 one.
* Bad input: each folder the readers cannot read is refused with the field and the fix, and
  ``verl-ds4 verify --hf-checkpoint`` exits 2 with that message (exact messages below).
"""

from __future__ import annotations

import argparse
import json
import shutil
import types
from pathlib import Path

import pytest
import torch

from verl_ds4.testing import ds41_reference as ref

needs_reference = pytest.mark.skipif(ref.reference_missing() is not None, reason=str(ref.reference_missing()))
YARN8 = {"rope_type": "yarn", "factor": 8, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 16}


def verify(argv: list[str]) -> int:
    from verl_ds4.verify import cli as verify_cli

    parser = argparse.ArgumentParser()
    verify_cli.add_arguments(parser)
    return verify_cli.run(parser.parse_args(argv))


# ----------------------------------------------------------------------------------------------- V4.1


def _nemo_config(text: dict):
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config

    return DeepseekV41Config(text_config=dict(text), vision_config={"num_hidden_layers": 0}, dtype="float64")


def _nemo_v41_folder(path: Path, text: dict) -> Path:
    """config.json by NeMo's save_pretrained, the reference's random weights in DeepSeek's names (NeMo's adapter)."""
    from safetensors.torch import save_file

    _nemo_config(text).save_pretrained(str(path))
    with ref.fp64_reference():
        theirs = ref.build_reference_model(text)
    named = theirs.state_dict_adapter.to_hf({k: v.detach() for k, v in theirs.state_dict().items()})
    save_file({k: v.contiguous() for k, v in named.items()}, str(path / "model.safetensors"))
    ref.local_tokenizer().save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    if ref.reference_missing():
        pytest.skip(ref.reference_missing())
    root = tmp_path_factory.mktemp("v41")
    text = ref.tiny_text_config(rope_scaling=dict(YARN8))
    folder = _nemo_v41_folder(root / "nemo", text)
    # The control: the same folder with the released factor 16, its config written by NeMo's save_pretrained.
    control = root / "factor16"
    shutil.copytree(folder, control)
    _nemo_config({**text, "rope_scaling": {**YARN8, "factor": 16}}).save_pretrained(str(control))
    return folder, control


def _rewrite_text(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config["text_config"])
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


@needs_reference
def test_nemo_writes_the_format_in_question(v41):
    folder, control = v41
    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"]
    assert config["model_type"] == "deepseek_v41" and text["model_type"] == "deepseek_v41_text"
    assert "rope_scaling" not in text and text["rope_parameters"]["factor"] == 8
    assert json.loads((control / "config.json").read_text())["text_config"]["rope_parameters"]["factor"] == 16


@needs_reference
def test_v41_builder_reads_nemo_folder_as_nemo_does(v41, tmp_path, capsys):
    from verl_ds4.verify.ds41_hf import compare_folder_with_nemo

    folder, control = v41
    report = tmp_path / "verify.json"
    assert verify(["--model", "ds41", "--hf-checkpoint", str(folder), "--cp", "2", "--json", str(report)]) == 0, capsys.readouterr()
    got = json.loads(report.read_text())
    assert got["passed"] and got["logits"] < 1e-10 and got["log_probs"] < 1e-10, got
    # Negative control: NeMo reading the factor-16 copy (the released default) is far from ours on factor 8.
    off = compare_folder_with_nemo(folder, cp=1, reference_folder=control)
    assert off["logits"] > 1e-3, off
    print(f"NeMo-written V4.1 folder: logits {got['logits']:.2e}; YaRN factor 16 vs 8: {off['logits']:.2e}")


@needs_reference
def test_v41_builder_accepts_nested_config_and_still_refuses_a_real_override(v41):
    from transformers import AutoConfig

    from verl_ds4.cpu.ds41_builder import ds41_folder_of

    folder, _ = v41
    hf_config = AutoConfig.from_pretrained(str(folder))
    hf_config.num_nextn_predict_layers = 0  # verl with model.mtp.enable=false
    assert ds41_folder_of(hf_config)[0] == folder
    hf_config.hidden_size = 48  # model.override_config.hidden_size=48
    with pytest.raises(ValueError) as err:
        ds41_folder_of(hf_config)
    assert str(err.value) == (
        f"model.override_config changes hidden_size=48 (config.json: 32), but the DeepSeek-V4.1 builder builds from "
        f"{folder / 'config.json'} and would ignore it: remove the override, or write the value into the folder's "
        "config.json.")


FLASH = "{'rope_type': 'yarn', 'factor': 16, 'beta_fast': 32, 'beta_slow': 1, 'original_max_position_embeddings': 65536}"
V41_BAD = {
    "both": (lambda t: t.update(rope_scaling={**YARN8, "factor": 4}),
             "rope_scaling={'rope_type': 'yarn', 'factor': 4, 'beta_fast': 32, 'beta_slow': 1, "
             "'original_max_position_embeddings': 16}: config.json also has rope_parameters {'beta_fast': 32, "
             "'beta_slow': 1, 'factor': 8, 'original_max_position_embeddings': 16, 'rope_theta': 10000.0, 'rope_type': "
             "'yarn'}, and the two disagree on factor (transformers 5 and NeMo Automodel read rope_parameters, older "
             "readers rope_scaling). Keep one of them (rope_parameters, as transformers 5 writes it) or give both the "
             "same values."),
    "neither": (lambda t: t.pop("rope_parameters"),
                "rope_scaling=None: config.json gives the compressed layers no RoPE settings (neither rope_scaling nor "
                "rope_parameters), and a built-in default would stand in for the checkpoint's. Write the checkpoint's "
                f"YaRN settings into config.json, e.g. the released ones: rope_parameters: {FLASH}."),
    "linear": (lambda t: t["rope_parameters"].update(rope_type="linear"),
               "rope_parameters={'beta_fast': 32, 'beta_slow': 1, 'factor': 8, 'original_max_position_embeddings': 16, "
               "'rope_theta': 10000.0, 'rope_type': 'linear'}: rope_type 'linear': the compressed layers implement YaRN "
               f"only. Give rope_type 'yarn' with the checkpoint's values, e.g. rope_parameters: {FLASH}."),
    "no_factor": (lambda t: t["rope_parameters"].pop("factor"),
                  "rope_parameters={'beta_fast': 32, 'beta_slow': 1, 'original_max_position_embeddings': 16, "
                  "'rope_theta': 10000.0, 'rope_type': 'yarn'}: YaRN needs factor as a positive number, and a built-in "
                  f"default would stand in for a missing one. Give the checkpoint's values, e.g. rope_parameters: {FLASH}."),
    "theta": (lambda t: t.update(rope_theta=20000.0),
              "rope_theta=20000.0: rope_parameters gives rope_theta 10000.0 (transformers 5 reads that one, NeMo "
              "Automodel rope_theta). Give both the same value, the checkpoint's."),
    "no_compress_theta": (lambda t: t.pop("compress_rope_theta"),
                          "compress_rope_theta=None: config.json leaves it out, and a built-in default would stand in "
                          "for the checkpoint's value. Write the checkpoint's compress_rope_theta into config.json (the "
                          "released Flash: 160000.0)."),
}


@needs_reference
@pytest.mark.parametrize("case", sorted(V41_BAD))
def test_v41_folders_the_reader_cannot_read_are_refused(v41, tmp_path, capsys, case):
    from verl_ds4.models.ds41.folder import read_folder_config

    edit, message = V41_BAD[case]
    bad = _rewrite_text(v41[0], tmp_path / case, edit)
    with pytest.raises(ValueError) as err:
        read_folder_config(bad)
    assert str(err.value) == f"DeepSeek-V4.1 config refused (1 problem(s)):\n  - {message}"
    assert verify(["--model", "ds41", "--hf-checkpoint", str(bad)]) == 2
    assert capsys.readouterr().err.strip() == f"verify --model ds41 --hf-checkpoint: {err.value}"


def test_v41_rope_rules_on_configs_without_a_folder():
    """In-memory configs (no folder): rope_parameters is read; a missing one falls back to TEXT_DEFAULTS (tests'
    configs), but a disagreement is refused there too. Negative control: rope_scaling alone is read as before."""
    from verl_ds4 import ds41_facts

    text = ref.tiny_text_config()
    params = {k: v for k, v in text.items() if k != "rope_scaling"} | {"rope_parameters": dict(YARN8)}
    assert ds41_facts.text_value(params, "rope_scaling") == YARN8
    assert ds41_facts.text_value(text, "rope_scaling") == text["rope_scaling"] != YARN8
    assert ds41_facts.config_violations({"model_type": "deepseek_v41", "text_config": params}) == []
    both = {**params, "rope_scaling": {**YARN8, "factor": 4}}
    assert [v.key for v in ds41_facts.config_violations({"model_type": "deepseek_v41", "text_config": both})] == ["rope_scaling"]


@pytest.mark.parametrize("where", ["rope_theta", "rope_parameters.rope_theta"])
def test_v41_a_rope_theta_that_is_not_a_number_is_a_violation(where):
    """A non-numeric rope_theta (top level or in rope_parameters) is refused naming the field, not a bare
    ValueError from comparing the two. Negative control: numbers that agree pass, numbers that differ are the
    disagreement refusal."""
    from verl_ds4 import ds41_facts

    text = {k: v for k, v in ref.tiny_text_config().items() if k != "rope_scaling"}
    good = {**text, "rope_theta": 10000.0, "rope_parameters": {**YARN8, "rope_theta": 10000}}
    bad = {**good, "rope_parameters": dict(good["rope_parameters"])}
    if where == "rope_theta":
        bad["rope_theta"] = "ten thousand"
    else:
        bad["rope_parameters"]["rope_theta"] = "ten thousand"
    problems = ds41_facts.config_violations({"model_type": "deepseek_v41", "text_config": bad})
    assert [str(v) for v in problems] == [
        f"{where}='ten thousand': expected a number (RoPE's base frequency; the released Flash has 10000.0). Write "
        f"the checkpoint's {where} into config.json as a number."]
    assert ds41_facts.config_violations({"model_type": "deepseek_v41", "text_config": good}) == []
    differ = {**good, "rope_theta": 20000.0}
    assert [v.key for v in ds41_facts.config_violations({"model_type": "deepseek_v41", "text_config": differ})] == [
        "rope_theta"]


# ------------------------------------------------------------------------------------------------- V4


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """transformers' save_pretrained (YaRN factor 8 and 16) and NeMo's DeepseekV4Config (factor 8) on the same weights."""
    from verl_ds4.cpu.ds4_model_dir import ds4_tiny_hf_config, write_ds4_weights

    root = tmp_path_factory.mktemp("v4")
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1}
    hf = ds4_tiny_hf_config(64, rope_parameters=dict(yarn))
    hf.save_pretrained(str(root / "tf"))
    write_ds4_weights(root / "tf", hf)
    control = root / "tf16"
    shutil.copytree(root / "tf", control)
    ds4_tiny_hf_config(64, rope_parameters={**yarn, "factor": 16.0}).save_pretrained(str(control))
    folders = {"tf": root / "tf", "tf16": control}
    if ref.reference_missing() is None:
        folders["nemo"] = _nemo_v4_folder(hf, root / "tf", root / "nemo", yarn)
    return folders


def _nemo_v4_folder(hf, weights: Path, path: Path, yarn: dict) -> Path:
    """The same model's config.json by NeMo Automodel's DeepseekV4Config.save_pretrained (its legacy keys)."""
    from nemo_automodel.components.models.deepseek_v4.config import DeepseekV4Config

    from verl_ds4 import ds4_facts

    d = hf.to_dict()
    same = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "q_lora_rank", "o_lora_rank", "o_groups", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
            "routed_scaling_factor", "norm_topk_prob", "scoring_func", "swiglu_limit", "max_position_embeddings",
            "rope_theta", "compress_rope_theta", "sliding_window", "hc_eps", "hc_mult", "hc_sinkhorn_iters",
            "index_head_dim", "index_n_heads", "index_topk", "num_nextn_predict_layers", "rms_norm_eps",
            "moe_intermediate_size", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "architectures")
    config = DeepseekV4Config(**{k: d[k] for k in same}, qk_rope_head_dim=hf.qk_rope_head_dim, rope_scaling={**yarn, "type": "yarn"},
                              compress_ratios=list(ds4_facts.layer_compress_ratios(d)),
                              num_hash_layers=d["mlp_layer_types"].count("hash_moe"))
    path.mkdir()
    config.save_pretrained(str(path))
    shutil.copy(weights / "model.safetensors", path / "model.safetensors")
    return path


def test_v4_reads_transformers_and_nemo_folders_as_transformers_does(v4):
    from verl_ds4.verify.hf import compare_with_transformers
    from verl_ds4.models.ds4 import hf_logits

    tf = json.loads((v4["tf"] / "config.json").read_text())
    assert "rope_scaling" not in tf and tf["rope_parameters"]["compress"]["factor"] == 8.0
    names = ["tf"]
    if "nemo" in v4:
        nemo = json.loads((v4["nemo"] / "config.json").read_text())
        assert "layer_types" not in nemo and nemo["compress_ratios"] == [0, 4, 128, 4] and nemo["rope_parameters"]["factor"] == 8.0
        names.append("nemo")
    lengths = [35, 5, 22, 11]
    for name in names:
        got = compare_with_transformers(v4[name], cp=1, lengths=lengths)
        assert got["logits"] < 1e-10 and got["log_probs"] < 1e-10, (name, got)
        print(f"V4 folder by {name}: logits {got['logits']:.2e}, log-probs {got['log_probs']:.2e}")
    # Negative control: the factor is read (factor 16 gives other logits).
    seqs = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    a, b = hf_logits(v4["tf"], seqs), hf_logits(v4["tf16"], seqs)
    moved = max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b))
    assert moved > 1e-3, moved
    print(f"V4 YaRN factor 16 vs 8 (ours): {moved:.2e}")


V4_BAD = {
    "nested": (lambda c: {"model_type": "deepseek_v4", "text_config": {k: v for k, v in c.items() if k != "model_type"}},
               "text_config: a DeepSeek-V4 config.json is flat (transformers' and NeMo Automodel's DeepseekV4Config write "
               "every key at the top level), and this nested one would be read as the default V4 with its sizes. Move the "
               "text_config keys to the top level, or point at a DeepSeek-V4.1 folder with --model ds41."),
    "neither": (lambda c: {k: v for k, v in c.items() if k != "rope_parameters"},
                "rope_scaling=None: config.json gives the compressed layers no RoPE settings (neither rope_scaling nor "
                "rope_parameters), and a built-in default would stand in for the checkpoint's. Write the checkpoint's "
                f"YaRN settings into config.json, e.g. the released ones: rope_parameters: {FLASH}."),
    # Nested by rope kind with the main layers' entry only: not read as the compressed layers' one.
    "main_only": (lambda c: {**c, "rope_parameters": {"main": c["rope_parameters"]["main"]}},
                  "rope_scaling=None: config.json gives the compressed layers no RoPE settings (neither rope_scaling "
                  "nor rope_parameters), and a built-in default would stand in for the checkpoint's. Write the "
                  f"checkpoint's YaRN settings into config.json, e.g. the released ones: rope_parameters: {FLASH}."),
    "both": (lambda c: {**c, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}},
             "rope_scaling={'type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 256}: config.json also has "
             "rope_parameters {'attention_factor': 1.0, 'beta_fast': 32, 'beta_slow': 1, 'factor': 8.0, "
             "'original_max_position_embeddings': 256, 'partial_rotary_factor': 0.5, 'rope_theta': 160000.0, "
             "'rope_type': 'yarn'}, and the two disagree on factor (transformers 5 and NeMo Automodel read "
             "rope_parameters, older readers rope_scaling). Keep one of them (rope_parameters, as transformers 5 writes "
             "it) or give both the same values."),
}


@pytest.mark.parametrize("case", sorted(V4_BAD))
def test_v4_folders_the_reader_cannot_read_are_refused(v4, tmp_path, capsys, case):
    from verl_ds4.models.ds4.hf_checkpoint import read_config

    edit, message = V4_BAD[case]
    bad = tmp_path / case
    shutil.copytree(v4["tf"], bad)
    (bad / "config.json").write_text(json.dumps(edit(json.loads((bad / "config.json").read_text()))))
    with pytest.raises(ValueError) as err:
        read_config(bad)
    assert str(err.value) == f"{bad / 'config.json'}: {message}"
    assert verify(["--hf-checkpoint", str(bad)]) == 2
    assert capsys.readouterr().err.strip() == f"verify --hf-checkpoint: {err.value}"


def test_v4_rope_parameters_nested_by_kind_are_read_at_compress():
    """``rope_parameters`` nested by rope kind gives the compressed layers its ``compress`` entry only; with
    ``main`` alone they have none, and the "neither given" refusal fires (it never did: ``main`` was taken)."""
    from verl_ds4 import ds4_facts

    main = {"rope_type": "default", "rope_theta": 10000.0}
    compress = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256}
    assert ds4_facts.yarn_settings({"rope_parameters": {"main": main}}) is None
    problems = ds4_facts.check_rope({"rope_parameters": {"main": main}}, compressed=True, yarn_only=False,
                                    released=ds4_facts.FLASH_YARN)
    assert [(v.key, v.value) for v in problems] == [("rope_scaling", None)], problems
    assert "gives the compressed layers no RoPE settings" in str(problems[0])
    # rope_scaling still stands in for a missing compress entry, as for a missing rope_parameters.
    assert ds4_facts.yarn_settings({"rope_parameters": {"main": main}, "rope_scaling": compress}) == compress
    # Negative controls: with compress given, or flat, that entry is read and nothing is refused.
    assert ds4_facts.yarn_settings({"rope_parameters": {"main": main, "compress": compress}}) == compress
    assert ds4_facts.yarn_settings({"rope_parameters": compress}) == compress
    assert not ds4_facts.check_rope({"rope_parameters": {"main": main, "compress": compress}}, compressed=True,
                                    yarn_only=False, released=ds4_facts.FLASH_YARN)


def test_v4_builder_refuses_what_the_folder_reader_refuses(v4, tmp_path):
    """The CPU engine's deepseek_v4 builder reads the folder's config.json too (verl's AutoConfig object alone
    would take the default sizes / no YaRN). Negative control: the good folder's config passes."""
    from verl_ds4.cpu import ds4_builder

    bad = tmp_path / "neither"
    shutil.copytree(v4["tf"], bad)
    config = json.loads((bad / "config.json").read_text())
    config.pop("rope_parameters")
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"rope_scaling=None: config.json gives the compressed layers no RoPE settings"):
        ds4_builder._ds4_transformer_config(types.SimpleNamespace(_name_or_path=str(bad)), torch.float32, {})
    from verl_ds4.models.ds4.hf_checkpoint import read_config

    assert read_config(v4["tf"])["model_type"] == "deepseek_v4"


def _drop_tensor(src: Path, dst: Path, name: str) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@needs_reference
def test_a_refusal_on_verify_ranks_exits_2_with_its_message(v41, v4, tmp_path, capsys):
    """A folder whose config passes but whose tensors do not fit is refused while the model is built on verify's
    gloo ranks: the message comes back to the caller and verify exits 2 (it was a rank traceback and exit 1)."""
    bad41 = _drop_tensor(v41[0], tmp_path / "v41", "layers.3.attn.wq_b.weight")
    assert verify(["--model", "ds41", "--hf-checkpoint", str(bad41)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"verify --model ds41 --hf-checkpoint: {bad41} does not fit its config.json: missing "
                          "['decoder.layers.3.self_attention.linear_q_up_proj.weight'], unexpected [], wrong shape []."), err
    bad4 = _drop_tensor(v4["tf"], tmp_path / "v4", "model.layers.2.self_attn.q_b_proj.weight")
    assert verify(["--hf-checkpoint", str(bad4)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"verify --hf-checkpoint: The DS4 checkpoint in {bad4} does not match its config (transformers names): "
                   "missing tensor 'model.layers.2.self_attn.q_b_proj.weight'."), err
