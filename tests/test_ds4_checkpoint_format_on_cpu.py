"""Checkpoint formats understood at start-up (issue 23 item 6).

* :mod:`verl_ds4.models.ds4.checkpoint_format` says what a local folder is from ``config.json`` and
  the tensor names (index or safetensors headers): bf16, the hub's FP8 + FP4 format, MTP or a
  DSpark drafter; it refuses, for the CPU path, a quantisation it does not read;
* the recipe validator notes the format and refuses MTP on a DSpark drafter checkpoint;
* the CPU loader reads a tiny checkpoint in the hub's on-disk format (DeepSeek's names, FP8 +
  UE8M0 block scales, FP4 experts + E8M0 scales): equal at fp64 to its dequantised twin, and its
  dequantisation equals transformers' own functions.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from verl_ds4.models.ds4.checkpoint_format import (
    CheckpointFormatError,
    check_cpu_readable,
    checkpoint_format_from,
    read_checkpoint_format,
)

HUB_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
             "activation_scheme": "dynamic"}
FLASH = {"model_type": "deepseek_v4", "num_hidden_layers": 43, "num_nextn_predict_layers": 1, "hidden_size": 4096,
         "n_routed_experts": 256, "num_experts_per_tok": 6, "sliding_window": 128, "torch_dtype": "bfloat16"}
MTP_NAMES = ["embed.weight", "layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale", "mtp.0.enorm.weight",
             "mtp.0.hnorm.weight", "mtp.0.e_proj.weight", "mtp.0.h_proj.weight"]
DSPARK_NAMES = ["embed.weight", "layers.0.attn.wq_a.weight"] + [
    f"mtp.{k}.{n}" for k in range(3) for n in ("attn.wq_a.weight", "ffn.gate.weight", "markov_head.weight")]


def write_folder(path: Path, config: dict, names: list[str] | None = None, header_only: bool = False) -> Path:
    """A model folder with ``config.json`` and, for ``names``, an index (or one safetensors file holding
    just a header with those names when ``header_only``)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if names is not None and not header_only:
        index = {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    elif names is not None:
        header = json.dumps({n: {"dtype": "BF16", "shape": [0], "data_offsets": [0, 0]} for n in names}).encode()
        (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return path


# ---------------------------------------------------------------- 1. the format, from config and names


def test_hub_fp8_fp4_format_is_described(tmp_path):
    fmt = read_checkpoint_format(write_folder(tmp_path / "flash", {**FLASH, "quantization_config": HUB_QUANT,
                                                                   "expert_dtype": "fp4"}, MTP_NAMES))
    assert fmt.quantized and fmt.quant_method == "fp8" and fmt.block_size == [128, 128] and fmt.expert_dtype == "fp4"
    assert fmt.drafter == "mtp" and fmt.mtp_layers == 1 and fmt.names_read.endswith("model.safetensors.index.json")
    line = fmt.describe()
    assert "FP8 e4m3 weights, 128x128 block scales (ue8m0)" in line and "routed experts FP4 e2m1" in line
    assert "MTP (1 layer(s))" in line
    check_cpu_readable(fmt)  # the hub's format is read
    # transformers >= 5.25 folds expert_dtype into quantization_config: same answer
    folded = checkpoint_format_from({**FLASH, "quantization_config": {**HUB_QUANT, "expert_dtype": "fp4"}})
    assert folded.expert_dtype == "fp4"
    # control: a Base checkpoint (FP8 throughout) does not claim FP4 experts
    base = checkpoint_format_from({**FLASH, "quantization_config": HUB_QUANT})
    assert base.expert_dtype is None and "FP4" not in base.describe()


def test_bf16_folder_is_described():
    fmt = checkpoint_format_from({**FLASH, "num_nextn_predict_layers": 0})
    assert not fmt.quantized and fmt.drafter == "none"
    assert fmt.describe() == "bfloat16 weights (no quantization_config); no MTP"
    check_cpu_readable(fmt)


@pytest.mark.parametrize("how", ["config_keys", "index_markov_head", "header_markov_head", "no_enorm"])
def test_dspark_drafter_is_detected(tmp_path, how):
    config, names, header = dict(FLASH), None, False
    if how == "config_keys":
        config.update(dspark_block_size=4, dspark_target_layer_ids=[10, 20, 30])
    elif how == "no_enorm":
        names = [n for n in DSPARK_NAMES if "markov" not in n]
    else:
        names, header = DSPARK_NAMES, how.startswith("header")
    fmt = read_checkpoint_format(write_folder(tmp_path / how, config, names, header_only=header))
    assert fmt.mtp_layers == 1 and fmt.drafter == "dspark", fmt
    assert "a DSpark drafter, not MTP" in fmt.describe()
    # negative control: the same folder kind with MTP's tensors (enorm, no markov_head) is MTP
    control = read_checkpoint_format(write_folder(tmp_path / f"{how}_mtp", FLASH, MTP_NAMES, header_only=header))
    assert control.drafter == "mtp"


@pytest.mark.parametrize("edit, found", [
    ({"quant_method": "awq"}, "quant_method='awq' (read: fp8)"),
    ({"fmt": "e5m2"}, "fmt='e5m2' (read: e4m3)"),
    ({"scale_fmt": "float"}, "scale_fmt='float' (read: ue8m0)"),
    ({"weight_block_size": [128]}, "weight_block_size=[128] (read: two positive integers"),
    ({"weight_block_size": [0, 128]}, "weight_block_size=[0, 128]"),
    ({"weight_block_size": None}, "weight_block_size=None"),
    ({"activation_scheme": "static"}, "activation_scheme='static' (read: dynamic)"),
    ({"expert_dtype": "nvfp4"}, "expert_dtype='nvfp4' (read: fp4, fp8)"),
])
def test_unread_quantisation_is_refused_naming_found_and_read(edit, found):
    fmt = checkpoint_format_from({**FLASH, "quantization_config": {**HUB_QUANT, **edit}}, source="x/config.json")
    with pytest.raises(CheckpointFormatError) as info:
        check_cpu_readable(fmt)
    message = str(info.value)
    assert found in message and "x/config.json" in message and "quant_method fp8, fmt e4m3, scale_fmt ue8m0" in message
    # negative control: the hub's values pass
    check_cpu_readable(checkpoint_format_from({**FLASH, "quantization_config": HUB_QUANT}))


def test_unreadable_index_or_config_is_refused(tmp_path):
    folder = write_folder(tmp_path / "bad", FLASH)
    (folder / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointFormatError, match="expected JSON with a 'weight_map' object"):
        read_checkpoint_format(folder)
    with pytest.raises(CheckpointFormatError, match="Cannot read .*config.json"):
        read_checkpoint_format(tmp_path / "nowhere")


# ---------------------------------------------------------------- 2. the recipe validator


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """GSM8K SFT / RL parquet files made by our preparation code (as tests/test_recipes_on_cpu.py does)."""
    from verl_ds4.recipes.gsm8k import prepare

    root = tmp_path_factory.mktemp("ds4_ckpt_data")
    raw = root / "raw"
    raw.mkdir()
    for split in ("train", "test"):
        (raw / f"{split}.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "1+1=<<1+1=2>>2\n#### 2"}) + "\n")
    prepare(str(raw), str(root / "sft"), str(root / "rl"), ["train", "test"])
    return root


def _validate(kind: str, model: Path, data: Path, overrides=(), **kw):
    from verl_ds4.recipes.compose import compose_recipe
    from verl_ds4.recipes.validate import validate_recipe

    split = data / ("sft" if kind == "sft" else "rl")
    key = "model.path" if kind == "sft" else "actor_rollout_ref.model.path"
    cfg = compose_recipe(kind, [f"{key}={model}", f"data.train_files={split / 'train.parquet'}",
                                f"data.val_files={split / 'test.parquet'}", *overrides])
    return validate_recipe(cfg, "sft" if kind == "sft" else "ppo", **kw)


def test_validator_notes_the_hub_format_and_bridge_dequantisation(tmp_path, data):
    hub = write_folder(tmp_path / "flash", {**FLASH, "quantization_config": HUB_QUANT, "expert_dtype": "fp4"}, MTP_NAMES)
    report = _validate("sft", hub, data)
    assert report.errors == [] and report.warnings == []
    note = [n for n in report.notes if n.startswith("model.path holds")]
    assert len(note) == 1 and "FP8 e4m3 weights, 128x128 block scales (ue8m0)" in note[0]
    assert "routed experts FP4 e2m1" in note[0] and "Megatron-Bridge dequantises it on import" in note[0]
    # control: a bf16 folder is described as such, without the dequantisation wording
    bf16 = write_folder(tmp_path / "bf16", FLASH, MTP_NAMES)
    note = [n for n in _validate("sft", bf16, data).notes if n.startswith("model.path holds")]
    assert note == ["model.path holds bfloat16 weights (no quantization_config); MTP (1 layer(s))."]
    # a quantisation DS4 does not ship is a warning naming it
    awq = write_folder(tmp_path / "awq", {**FLASH, "quantization_config": {"quant_method": "awq"}})
    warnings = _validate("sft", awq, data).warnings
    assert [w.setting for w in warnings] == ["model.path"] and "quant_method='awq'" in warnings[0].message


def test_validator_refuses_mtp_on_a_dspark_drafter(tmp_path, data):
    from verl_ds4.recipes.validate import RecipeValidationError

    dspark = write_folder(tmp_path / "flash0731", {**FLASH, "quantization_config": HUB_QUANT, "expert_dtype": "fp4"},
                          DSPARK_NAMES)
    with pytest.raises(RecipeValidationError) as info:
        _validate("sft", dspark, data)  # the SFT recipe has ds4.mtp=true
    message = str(info.value)
    assert "model.mtp.enable: is True, but" in message and "holds a DSpark drafter (tensor mtp.N.markov_head" in message
    assert "set ds4.mtp=false" in message
    # the fix works, and the note says what the folder is
    report = _validate("sft", dspark, data, ["ds4.mtp=false"])
    assert report.errors == [] and any("a DSpark drafter, not MTP" in n for n in report.notes)
    # PPO: the actor's model block is named; off by default there
    with pytest.raises(RecipeValidationError, match="actor_rollout_ref.model.mtp.enable: is True, but"):
        _validate("ppo", dspark, data, ["ds4.mtp=true"])
    assert _validate("ppo", dspark, data).errors == []
    # negative control: an MTP checkpoint with MTP on passes
    mtp = write_folder(tmp_path / "flash", {**FLASH, "quantization_config": HUB_QUANT, "expert_dtype": "fp4"}, MTP_NAMES)
    assert _validate("sft", mtp, data).errors == []
