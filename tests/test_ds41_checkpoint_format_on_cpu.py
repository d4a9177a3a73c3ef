"""DeepSeek-V4.1 folders in DeepSeek's released on-disk format (``verl_ds4.models.ds41.released``).

The released names come from NeMo Automodel 0.7.0's own adapter (``to_hf`` of its model: the reference's
reading of DeepSeek's format, called, not copied); FP8 32 x 32 / FP4 / Engram row scales are written by
this repo's test quantisers and decoded by NeMo's ``dequantize_checkpoint_weight`` as the reference.
Checked: the released names (float) load bit for bit as the reference's weights; the FP8 / FP4 folder
decodes bit for bit as NeMo decodes it and loads into the model; NeMo's in-memory names load too; the
drafter's ``mtp.*`` and the vision tower are counted, not silently dropped. Negative controls: a scale
grid of another block size is refused, one flipped scale exponent changes exactly its block, an unknown
tensor name and a weight without its scale are refused, naming them.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from verl_ds4.models.ds41 import released
from verl_ds4.models.ds41.engram import engram_token_map
from verl_ds4.models.ds41.folder import load_folder
from verl_ds4.models.ds41.model import DS41Model
from verl_ds4.testing import ds41_reference as ref
from verl_ds4.testing.ds4_hub_format import quantize_fp4, quantize_fp8_block

pytestmark = pytest.mark.skipif(ref.reference_missing() is not None, reason=str(ref.reference_missing()))

TEXT = ref.tiny_text_config(moe_intermediate_size=32)  # FP4 groups 32 inputs: every expert matrix a multiple of 32 wide
CONFIG = {"model_type": "deepseek_v41", "text_config": TEXT}
FP8_KEY = r"layers\.\d+\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|engram\.wkv)\.weight"


@pytest.fixture(scope="module")
def setup():
    with ref.fp64_reference():
        theirs = ref.build_reference_model(TEXT)
    ours = DS41Model(CONFIG, engram_token_map(ref.local_tokenizer())[0], dtype=torch.float64)
    expected = {k: v.detach().clone() for k, v in ref.reference_tensors(ours, theirs).items()}
    named = theirs.state_dict_adapter.to_hf({k: v.detach() for k, v in theirs.state_dict().items()})
    return theirs, ours, expected, {k: v.detach().clone().contiguous() for k, v in named.items()}


def _folder(path, tensors, tokenizer=True):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    save_file(tensors, str(path / "model.safetensors"))
    if tokenizer:
        ref.local_tokenizer().save_pretrained(str(path))
    return path


def _quantise(named: dict) -> dict:
    """DeepSeek's format: dense FP8 32 x 32, routed experts FP4 per row and 32 inputs, Engram FP8 per row."""
    import re

    out = {}
    for key, value in named.items():
        if re.fullmatch(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight", key):
            q, scale, _ = quantize_fp4(value, 32)
        elif re.fullmatch(r"layers\.\d+\.engram\.embed\.weight", key):
            q, scale, _ = quantize_fp8_block(value, (1, 32))
        elif re.fullmatch(FP8_KEY, key):
            q, scale, _ = quantize_fp8_block(value, released.FP8_BLOCK)
        else:
            out[key] = value
            continue
        out[key], out[key[: -len(".weight")] + ".scale"] = q, scale
    return out


def test_released_names_load_bit_for_bit(setup, tmp_path):
    theirs, ours, expected, named = setup
    assert released.name_style(named) == "released" and any(k.startswith("layers.0.hc_attn_") for k in named)
    folder = _folder(tmp_path / "released", named)
    model = load_folder(folder, dtype=torch.float64)
    state = model.state_dict()
    for name, value in expected.items():
        assert torch.equal(state[name], value.to(state[name].dtype)), name
    ids = torch.randint(0, TEXT["vocab_size"], (24,), generator=torch.Generator().manual_seed(0))
    ref.copy_reference_weights(ours, theirs)
    with torch.no_grad():
        assert torch.equal(model(ids), ours(ids))


def test_nemo_names_load_too(setup, tmp_path):
    theirs, _, expected, _ = setup
    folder = _folder(tmp_path / "nemo", {k: v.detach().clone().contiguous() for k, v in theirs.state_dict().items()})
    state = load_folder(folder, dtype=torch.float64).state_dict()
    assert all(torch.equal(state[k], v) for k, v in expected.items())


def test_fp8_fp4_folder_decodes_as_nemo_does(setup, tmp_path, capsys):
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import dequantize_checkpoint_weight

    _, _, _, named = setup
    quantised = _quantise(named)
    kinds = {str(v.dtype) for k, v in quantised.items() if k.endswith(".scale")}
    assert {k for k, v in quantised.items() if v.dtype == torch.int8} and "torch.float8_e8m0fnu" in kinds
    ours = released.dequantize_released(quantised)
    checked = 0
    for key, value in quantised.items():
        if key.endswith(".weight") and (key[:-7] + ".scale") in quantised:
            theirs = dequantize_checkpoint_weight(value, quantised[key[:-7] + ".scale"], dtype=torch.float64,
                                                  rowwise=".engram.embed." in key)
            assert torch.equal(ours[key], theirs), key
            checked += 1
    assert checked > 20

    # The folder, with a drafter stage and a vision tensor beside: loaded, the extras counted.
    extra = {"mtp.0.attn_norm.weight": torch.ones(TEXT["hidden_size"]), "vision.patch_embed.weight": torch.ones(2, 2)}
    folder = _folder(tmp_path / "fp8", {**quantised, **extra})
    model = load_folder(folder, dtype=torch.float64)
    assert "not loaded (the text model does not build them): 1 mtp (DSpark drafter, not built), 1 vision tower, 8 routers' image-token bias (bias_vl)" in capsys.readouterr().err
    state = model.state_dict()
    mapped, _ = released.released_to_ours(ours)
    assert all(torch.equal(state[k], v.to(state[k].dtype)) for k, v in mapped.items())


def test_bad_scales_and_names_are_refused(setup):
    _, _, _, named = setup
    quantised = _quantise(named)
    key = "layers.2.attn.wq_a.weight"
    scale_key = "layers.2.attn.wq_a.scale"
    # Negative control: scales of V4's 128 x 128 blocks (or any other grid) do not fit DeepSeek-V4.1's 32 x 32.
    _, wrong_grid, _ = quantize_fp8_block(named[key], (16, 16))
    with pytest.raises(Exception, match=r"has scales .* needs .*ceil\(out/32\), ceil\(in/32\)"):
        released.dequantize_released({key: quantised[key], scale_key: wrong_grid})
    # Negative control: one scale byte one higher doubles exactly its 32 x 32 block.
    flipped = quantised[scale_key].clone().view(torch.uint8)
    flipped[0, 0] += 1
    good = released.dequantize_released({key: quantised[key], scale_key: quantised[scale_key]})[key]
    bad = released.dequantize_released({key: quantised[key], scale_key: flipped.view(torch.float8_e8m0fnu)})[key]
    assert torch.equal(bad[:32, :32], 2 * good[:32, :32]) and torch.equal(bad[32:], good[32:])
    assert not torch.equal(bad, good)
    with pytest.raises(ValueError, match=r"quantised weights without a .scale tensor: \['layers.2.attn.wq_a.weight'\]"):
        released.dequantize_released({key: quantised[key]})
    with pytest.raises(ValueError, match=r"does not name: \['layers.0.attn.wq_x.weight'\]"):
        released.released_to_ours({"layers.0.attn.wq_x.weight": torch.zeros(1)})
