"""Checkpoint formats understood at start-up (issue 23 item 6).

* :mod:`verl_ds4.models.ds4.checkpoint_format` says what a local folder is from ``config.json`` and
  the tensor names (index or safetensors headers): bf16, the hub's FP8 + FP4 format, MTP or a
  DSpark drafter; it refuses, for the CPU path, a quantisation it does not read;
* the recipe validator notes the format and refuses MTP on a DSpark drafter checkpoint;
* the CPU loader reads a tiny checkpoint in the hub's on-disk format (DeepSeek's names, FP8 +
  UE8M0 block scales, FP4 experts + E8M0 scales): equal at fp64 to its dequantised twin, and its
  dequantisation equals transformers' own functions, and transformers' ``from_pretrained`` reads the
  same folder as the twin.
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
    # MTP declared but no mtp.* tensor (e.g. a save_pretrained folder) is said; unknown without names
    bare = checkpoint_format_from(FLASH, names=["embed.weight"])
    assert bare.drafter == "mtp" and "MTP (1 layer(s)) declared, but the checkpoint has no mtp.* tensors" in bare.describe()
    assert "declared, but" not in checkpoint_format_from(FLASH).describe()


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


# ---------------------------------------------------------------- 3. the CPU loader reads the hub's format

TINY_BLOCK = (8, 16)  # the hub's is (128, 128); the tiny model's matrices are 16..32 wide (rows x columns differ on purpose)


def _write_hub_rank(rank, world, root):
    import torch
    from megatron.core import parallel_state

    from verl_ds4.models.ds4.model import build_ds4_model
    from verl_ds4.testing.ds4_hub_format import randomize_ds4_, write_hub_folders
    from verl_ds4.testing.ds4_tiny import tiny_hf_config

    parallel_state.initialize_model_parallel()
    try:
        config = json.loads(tiny_hf_config(num_nextn_predict_layers=1, moe_intermediate_size=32).to_json_string())
        model = build_ds4_model(config, dtype=torch.float64, cp_size=1)
        randomize_ds4_(model, seed=11)
        hub, twin = write_hub_folders(model, config, root, block_size=TINY_BLOCK)
        return str(hub), str(twin)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def hub_folders(tmp_path_factory):
    """A random tiny DS4 (with MTP) in the hub's on-disk format, and its dequantised twin."""
    from verl_ds4.mcore.distributed import run_distributed

    (hub, twin), = run_distributed(_write_hub_rank, 1, args=(str(tmp_path_factory.mktemp("hub")),))
    return Path(hub), Path(twin)


def test_hub_folder_is_in_the_hub_format(hub_folders):
    import torch

    from verl_ds4.models.ds4.hf_checkpoint import read_hf_tensors

    hub, _ = hub_folders
    raw = read_hf_tensors(hub, dequantize=False)
    assert raw["layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn and raw["layers.1.attn.wq_a.scale"].shape == (2, 2)
    assert raw["layers.1.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    fp4 = raw["mtp.0.ffn.experts.2.w2.weight"]  # MTP's routed experts too
    assert fp4.dtype == torch.int8 and fp4.shape == (32, 16) and raw["mtp.0.ffn.experts.2.w2.scale"].shape == (32, 1)
    assert raw["embed.weight"].dtype == torch.bfloat16 and raw["layers.1.hc_attn_fn"].dtype == torch.float32
    assert raw["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    fmt = read_checkpoint_format(hub)
    assert fmt.quantized and fmt.expert_dtype == "fp4" and fmt.drafter == "mtp"


def test_quantised_folder_loads_equal_to_its_dequantised_twin_at_fp64(hub_folders):
    import torch

    from verl_ds4.models.ds4 import hf_logits
    from verl_ds4.testing.ds4_tiny import random_sequences

    hub, twin = hub_folders
    seqs = random_sequences([19, 40], 96, seed=4)
    ours, theirs = hf_logits(hub, seqs), hf_logits(twin, seqs)
    diff = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
    print(f"fp64 logits, hub-format folder vs dequantised twin: max abs diff {diff:.3e}")
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert max(a.abs().max().item() for a in ours) > 0.1  # not a degenerate (all-zero) model


def _native_to_twin_names():
    from verl_ds4.models.ds4.hf_names import name_groups
    from verl_ds4.models.ds4.model_config import ds4_transformer_config
    from verl_ds4.testing.ds4_tiny import tiny_hf_config

    config = ds4_transformer_config(tiny_hf_config(num_nextn_predict_layers=1, moe_intermediate_size=32), cp_size=1)
    return {n: t for gn, gt in zip(name_groups(config, "native"), name_groups(config, "transformers"))
            for n, t in zip(gn.files, gt.files)}


def test_dequantised_tensors_equal_the_twin(hub_folders, monkeypatch):
    """Tensor by tensor (no model): what the loader reads from the hub folder is the twin's value, bit for bit."""
    import torch
    from safetensors.torch import load_file

    from verl_ds4.models.ds4 import hf_dequant
    from verl_ds4.models.ds4.hf_checkpoint import read_hf_tensors

    hub, twin = hub_folders
    theirs, names = load_file(str(twin / "model.safetensors")), _native_to_twin_names()

    def mismatches():
        ours = read_hf_tensors(hub)
        assert not any(n.endswith(".scale") for n in ours) and set(ours) == set(names)
        return [n for n, t in ours.items() if not torch.equal(t.to(torch.float64), theirs[names[n]].to(torch.float64))]

    assert mismatches() == []
    monkeypatch.setattr(hf_dequant, "E8M0_BIAS", 128)  # negative control: a wrong exponent bias is seen
    wrong = mismatches()
    assert "layers.1.attn.wq_a.weight" in wrong and "mtp.0.ffn.experts.0.w1.weight" in wrong and "embed.weight" not in wrong


def _transformers_dequant(weight, scale):
    """transformers 5.10.4's own dequantisation (FP8 block and packed FP4, block from the scale grid)."""
    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(hf_quantizer=None)._dequantize_one(weight, scale, output_dtype=torch.float64)


def _transformers_mxfp4(packed, scale):
    """transformers' MXFP4 (GPT-OSS) unpacking: blocks [E, out, groups, 16] bytes, exponents [E, out, groups]
    with bias 127; it returns [E, in, out]."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rows, half = packed.shape
    blocks = packed.view(torch.uint8).reshape(1, rows, half // 16, 16)
    exps = scale.view(torch.uint8).reshape(1, rows, half // 16)
    return convert_moe_packed_tensors(blocks, exps, dtype=torch.float64)[0].T


def _max_diff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def test_dequantisation_equals_transformers(hub_folders):
    """Ours vs transformers' functions on every quantised tensor of the tiny folder and on hub-size 128 x 128
    blocks; negative controls: a wrong nibble order and a wrong exponent bias are seen."""
    import torch

    from verl_ds4.models.ds4.hf_checkpoint import read_hf_tensors
    from verl_ds4.models.ds4.hf_dequant import dequantize_fp4, dequantize_fp8_block
    from verl_ds4.testing.ds4_hub_format import quantize_fp4, quantize_fp8_block

    hub, _ = hub_folders
    raw = read_hf_tensors(hub, dequantize=False)
    fp8 = [n for n, t in raw.items() if t.dtype == torch.float8_e4m3fn]
    fp4 = [n for n, t in raw.items() if t.dtype == torch.int8]
    assert len(fp8) >= 20 and len(fp4) >= 30
    worst = {"fp8": 0.0, "fp4": 0.0, "fp4_mxfp4": 0.0}
    for name in fp8:
        ours = dequantize_fp8_block(raw[name], raw[name[:-7] + ".scale"], TINY_BLOCK)
        worst["fp8"] = max(worst["fp8"], _max_diff(ours, _transformers_dequant(raw[name], raw[name[:-7] + ".scale"])))
    for name in fp4:
        packed, scale = raw[name], raw[name[:-7] + ".scale"]
        ours = dequantize_fp4(packed, scale)
        worst["fp4"] = max(worst["fp4"], _max_diff(ours, _transformers_dequant(packed, scale)))
        worst["fp4_mxfp4"] = max(worst["fp4_mxfp4"], _max_diff(ours, _transformers_mxfp4(packed, scale)))
    # hub sizes: 128 x 128 FP8 blocks on a [256, 384] weight, FP4 on [64, 256]
    gen = torch.Generator().manual_seed(2)
    w8, s8, _ = quantize_fp8_block(torch.randn(256, 384, generator=gen, dtype=torch.float64) * 3e-2, (128, 128))
    w4, s4, _ = quantize_fp4(torch.randn(64, 256, generator=gen, dtype=torch.float64) * 5e-2)
    assert s8.shape == (2, 3) and s4.shape == (64, 8)
    worst["fp8_128"] = _max_diff(dequantize_fp8_block(w8, s8, (128, 128)), _transformers_dequant(w8, s8))
    worst["fp4_hub"] = _max_diff(dequantize_fp4(w4, s4), _transformers_mxfp4(w4, s4))
    print("max abs diff, ours vs transformers:", {k: f"{v:.1e}" for k, v in worst.items()})
    assert all(v == 0.0 for v in worst.values()), worst
    # negative controls: swapped nibbles and a scale exponent off by one are seen; a block with rows and
    # columns swapped does not match the scale grid and is refused
    swapped = ((w4.view(torch.uint8) >> 4) | (w4.view(torch.uint8) << 4)).view(torch.int8)
    assert _max_diff(dequantize_fp4(swapped, s4), _transformers_mxfp4(w4, s4)) > 1e-3
    off = (s8.view(torch.uint8) + 1).view(torch.float8_e8m0fnu)
    assert _max_diff(dequantize_fp8_block(w8, off, (128, 128)), _transformers_dequant(w8, s8)) > 1e-3
    with pytest.raises(CheckpointFormatError, match=r"has scales \(2, 2\); weight_block_size \[16, 8\] needs \(1, 4\)"):
        dequantize_fp8_block(raw["layers.1.attn.wq_a.weight"], raw["layers.1.attn.wq_a.scale"], TINY_BLOCK[::-1])


def test_partial_blocks_use_the_ceil_grid():
    """The last block row / column may be partial (scales [ceil(out/128), ceil(in/128)]): element (i, j) takes
    scale (i // 128, j // 128), checked element-wise against an explicit index lookup."""
    import torch

    from verl_ds4.models.ds4.hf_dequant import dequantize_fp8_block
    from verl_ds4.testing.ds4_hub_format import quantize_fp8_block

    w, s, exact = quantize_fp8_block(torch.randn(200, 300, dtype=torch.float64, generator=torch.Generator().manual_seed(1)), (128, 128))
    assert s.shape == (2, 3)
    i, j = torch.meshgrid(torch.arange(200), torch.arange(300), indexing="ij")
    lookup = w.double() * s.float().double()[i // 128, j // 128]
    ours = dequantize_fp8_block(w, s, (128, 128))
    assert torch.equal(ours, lookup) and torch.equal(ours, exact)


def _variant(hub: Path, dest: Path, config_edit=None, tensors_edit=None, index_edit=None) -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(hub, dest)
    config = json.loads((dest / "config.json").read_text())
    if config_edit:
        config_edit(config)
        (dest / "config.json").write_text(json.dumps(config))
    if tensors_edit:
        index = json.loads((dest / "model.safetensors.index.json").read_text())
        for file in sorted(set(index["weight_map"].values())):
            tensors = load_file(str(dest / file))
            tensors_edit(tensors)
            save_file(tensors, str(dest / file))
            index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != file} | {n: file for n in tensors}
        (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    if index_edit:
        index = json.loads((dest / "model.safetensors.index.json").read_text())
        index_edit(index["weight_map"])
        (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    return dest


REFUSALS = [
    ("quant_method", dict(config_edit=lambda c: c["quantization_config"].update(quant_method="mxfp8")),
     r"does not read this quantised checkpoint: quant_method='mxfp8' \(read: fp8\)"),
    ("block_size_malformed", dict(config_edit=lambda c: c["quantization_config"].update(weight_block_size=[128])),
     r"weight_block_size=\[128\] \(read: two positive integers"),
    ("block_size_not_the_data", dict(config_edit=lambda c: c["quantization_config"].update(weight_block_size=[16, 16])),
     r"tensor '.*' \(\d+, \d+\) has scales \(\d+, \d+\); weight_block_size \[16, 16\] needs"),
    ("no_quantization_config", dict(config_edit=lambda c: (c.pop("quantization_config"), c.pop("expert_dtype"))),
     r"declares no quantization_config, but the folder holds quantised tensors"),
    ("missing_scale", dict(tensors_edit=lambda t: t.pop("layers.2.attn.wo_b.scale", None)),
     r"tensor 'layers.2.attn.wo_b.weight' is torch.float8_e4m3fn but 'layers.2.attn.wo_b.scale' is missing"),
    ("fp4_without_expert_dtype", dict(config_edit=lambda c: c.pop("expert_dtype")),
     r"is packed FP4 \(torch.int8\) but .* says expert_dtype=None"),
    ("dspark_keys_as_mtp", dict(config_edit=lambda c: c.update(dspark_block_size=4, dspark_target_layer_ids=[1, 2])),
     r"holds a DSpark drafter \(config keys \['dspark_block_size', 'dspark_target_layer_ids'\]\), not MTP layers.*allow_mtp_skip=True"),
    ("dspark_markov_head_as_mtp", dict(index_edit=lambda m: m.update({"mtp.0.markov_head.weight": m["embed.weight"]})),
     r"holds a DSpark drafter \(tensor mtp.N.markov_head.weight\), not MTP layers"),
]


@pytest.mark.parametrize("name, edits, message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_cpu_loader_refusals_name_what_was_found(hub_folders, tmp_path, name, edits, message):
    """Each refusal comes before any model is built (no Megatron state needed) and names what it found."""
    from verl_ds4.models.ds4.hf_checkpoint import HFCheckpointError, load_hf_checkpoint, read_hf_tensors

    hub, _ = hub_folders
    with pytest.raises(HFCheckpointError, match=message):
        load_hf_checkpoint(_variant(hub, tmp_path / name, **edits), cp_size=1)
    read_hf_tensors(hub)  # negative control: the intact folder reads


def _dspark_skip_rank(rank, world, folder, out):
    import torch
    from megatron.core import parallel_state

    from verl_ds4.models.ds4.hf_checkpoint import load_hf_checkpoint, save_hf_checkpoint

    parallel_state.initialize_model_parallel()
    try:
        model, info = load_hf_checkpoint(folder, dtype=torch.float64, allow_mtp_skip=True, cp_size=1)
        save_hf_checkpoint(model, out, info)
        return model.mtp_block is None, len(info.skipped), sorted({str(d) for d in info.dtypes.values()})
    finally:
        parallel_state.destroy_model_parallel()


def test_dspark_with_allow_mtp_skip_loads_without_the_drafter_and_saves_dequantised(hub_folders, tmp_path):
    import torch
    from safetensors.torch import load_file

    from verl_ds4.mcore.distributed import run_distributed

    hub, twin = hub_folders
    dspark = _variant(hub, tmp_path / "dspark", config_edit=lambda c: c.update(dspark_block_size=4, dspark_target_layer_ids=[1]))
    (no_mtp, skipped, dtypes), = run_distributed(_dspark_skip_rank, 1, args=(str(dspark), str(tmp_path / "out")))
    assert no_mtp and skipped > 40  # every mtp.* tensor (scales too) skipped, none loaded as MTP
    assert "torch.float8_e4m3fn" not in dtypes and "torch.int8" not in dtypes
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in saved and "expert_dtype" not in saved  # the files written are dequantised
    written, theirs, names = load_file(str(tmp_path / "out" / "model.safetensors")), load_file(str(twin / "model.safetensors")), _native_to_twin_names()
    assert written["layers.1.attn.wq_a.weight"].dtype == torch.bfloat16
    assert all(torch.equal(t.double(), theirs[names[n]].double()) for n, t in written.items())


def _transformers_state(folder):
    import torch
    from transformers import DeepseekV4ForCausalLM

    model, info = DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.state_dict()


def test_transformers_reads_the_hub_folder_as_the_twin(hub_folders, tmp_path):
    """The writer's folder is the hub's format as transformers reads it: ``from_pretrained`` (its FP8 quantizer,
    which dequantises on CPU, and its ``.scale`` rename) gives exactly the twin's weights (MTP aside: transformers
    builds none). Negative control: one scale byte off by one is seen."""
    import torch

    hub, twin = hub_folders
    ours, theirs = _transformers_state(hub), _transformers_state(twin)
    assert sorted(ours) == sorted(theirs)
    assert [k for k in theirs if not torch.equal(ours[k].double(), theirs[k].double())] == []
    bumped = _variant(hub, tmp_path / "bumped", tensors_edit=lambda t: t.update(
        {"layers.2.attn.wkv.scale": (t["layers.2.attn.wkv.scale"].view(torch.uint8) + 1).view(torch.float8_e8m0fnu)}
        if "layers.2.attn.wkv.scale" in t else {}))
    changed = _transformers_state(bumped)
    assert [k for k in theirs if not torch.equal(changed[k].double(), theirs[k].double())] == ["model.layers.2.self_attn.kv_proj.weight"]
