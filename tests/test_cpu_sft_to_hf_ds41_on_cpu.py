"""The SFT -> RL hand-over for DeepSeek-V4.1: a MODEL=ds41 SFT checkpoint -> a V4.1 folder (``models/ds41/folder.py``).

The checkpoint is written the way verl's SFT trainer writes it (torch DCP files under
``global_step_N/model/dist_ckpt``, keys = the model's state dict; ``DS41MegatronModel`` and the
folder's ``DS41Model`` share their names, which the CPU builder checks tensor by tensor when it loads a
folder), from the tiny V4.1 with moved weights. The converted folder's logits equal that model's
(control: the start folder's do not); a folder or checkpoint of the other kind (V4 / V4.1) is refused
with the flag and the fix, and nothing is written.
"""

from __future__ import annotations

import json

import pytest
import torch

from verl_ds4.cpu.sft_data import prepare_cpu_sft_assets
from verl_ds4.cpu.sft_to_hf import SFTConversionError, checkpoint_kind, convert_sft_checkpoint, main

LENGTHS = (7, 30, 19)


def _logits(model, seed: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    vocab = model.output_layer.weight.shape[0]
    ids = torch.randint(3, vocab, (sum(LENGTHS),), generator=gen)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        return model(ids, cu_seqlens_padded=cu)


def _save_dcp(state: dict, step_dir) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(step_dir / "model" / "dist_ckpt"), no_dist=True)


@pytest.fixture(scope="module")
def ds41_checkpoint(tmp_path_factory):
    from verl_ds4.models.ds41.folder import load_folder

    root = tmp_path_factory.mktemp("handover41")
    model_dir = prepare_cpu_sft_assets(root / "assets", model="ds41", task="digits", n_train=8)["model"]
    model = load_folder(model_dir, dtype=torch.float32)
    start_logits = _logits(model)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ckpt = root / "checkpoints"
    _save_dcp({k: v.clone() for k, v in model.state_dict().items()}, ckpt / "global_step_4")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    return root, model_dir, ckpt, _logits(model), start_logits


def test_v41_checkpoint_becomes_a_v41_folder_with_the_checkpoints_logits(ds41_checkpoint, tmp_path):
    from transformers import GenerationConfig
    from verl.utils.tokenizer.deepseek import EOS_TOKEN

    from verl_ds4.cpu.ds41_builder import ds41_folder_of  # what the RL launcher's builder reads
    from verl_ds4.models.ds41.folder import load_folder, read_folder_config

    root, model_dir, ckpt, sft_logits, start_logits = ds41_checkpoint
    out = tmp_path / "hf"
    result = convert_sft_checkpoint(ckpt, model_dir, out, model="ds41")
    assert result["step"] == 4 and result["model_type"] == "deepseek_v41"
    assert 0 < result["tensors_changed_by_sft"] <= result["tensors"]
    assert read_folder_config(out) == json.loads((root / "assets" / "model" / "config.json").read_text())
    converted = _logits(load_folder(out, dtype=torch.float32))
    assert torch.equal(converted, sft_logits)
    # the control: the checkpoint moved the weights, so the start folder's logits are not these
    assert (converted - start_logits).abs().max() > 1e-2
    # the tokenizer (Engram's tables) and an EOS list with DS4's end-of-sentence token, as V4's hand-over
    assert (out / "tokenizer.json").read_bytes() == (root / "assets" / "model" / "tokenizer.json").read_bytes()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    eos = GenerationConfig.from_pretrained(out).eos_token_id
    assert tokenizer.convert_tokens_to_ids(EOS_TOKEN) in eos and tokenizer.eos_token_id in eos

    class _HF:  # the shape of verl's HF config object, as the CPU builder sees it
        _name_or_path = str(out)
        num_nextn_predict_layers = 0

    assert ds41_folder_of(_HF())[0] == out


def test_kind_of_checkpoint_and_requested_model_must_agree(ds41_checkpoint, tmp_path, capsys):
    root, model_dir, ckpt, _, _ = ds41_checkpoint
    v4_dir = prepare_cpu_sft_assets(tmp_path / "v4", model="ds4", task="digits", n_train=2)["model"]
    # a V4.1 checkpoint with the V4 folder (the kind taken from the folder): refused, names both and the fix
    with pytest.raises(SFTConversionError, match=r"holds a ds41 model .* asked for ds4.*--model ds41"):
        convert_sft_checkpoint(ckpt, v4_dir, tmp_path / "a")
    # --model ds4 with the V4.1 folder
    with pytest.raises(SystemExit) as exit_info:
        main(["--checkpoint", str(ckpt), "--model-dir", model_dir, "--out", str(tmp_path / "b"), "--model", "ds4"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--model=ds4 but --model-dir" in err and "pass --model ds41" in err
    # a V4 checkpoint (V4's mHC head) with the V4.1 folder
    v4_ckpt = tmp_path / "v4ckpt"
    _save_dcp({"decoder.hc_head.mapping_proj.weight": torch.zeros(2, 2), "decoder.layers.0.attn_hc.bias": torch.zeros(2)},
              v4_ckpt / "global_step_1")
    with pytest.raises(SFTConversionError, match=r"holds a ds4 model .* asked for ds41"):
        convert_sft_checkpoint(v4_ckpt / "global_step_1", model_dir, tmp_path / "c", model="ds41")
    assert not any((tmp_path / name).exists() for name in "abc")


def test_checkpoint_kind_reads_the_mhc_layout():
    assert checkpoint_kind(["decoder.hc_head.bias", "decoder.layers.0.attn_hc.bias"]) == "ds4"
    assert checkpoint_kind(["decoder.layers.0.attn_hc.bias", "output_layer.weight"]) == "ds41"
    assert checkpoint_kind(["decoder.layers.0.self_attention.linear_qkv.weight"]) is None  # proxy / dense: no verdict
