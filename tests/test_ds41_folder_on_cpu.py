"""A V4.1 folder in our names (``verl_ds4.models.ds41.folder``): a save -> load round trip gives the
same logits bit for bit; refused before any weight is read, each with the field and the fix: a folder
without the tokenizer Engram hashes with, a V4 folder, a bad source-layer schedule, weights that do
not fit (negative controls of the round trip)."""

from __future__ import annotations

import json

import pytest
import torch

from verl_ds4.models.ds41.engram import engram_token_map
from verl_ds4.models.ds41.folder import load_folder, read_folder_config, save_folder
from verl_ds4.models.ds41.model import DS41Model
from verl_ds4.testing import ds41_reference as ref

pytestmark = pytest.mark.skipif(ref.reference_missing() is not None, reason=str(ref.reference_missing()))

TEXT = ref.tiny_text_config()
CONFIG = {"model_type": "deepseek_v41", "text_config": TEXT}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    with ref.fp64_reference():
        theirs = ref.build_reference_model(TEXT)
    model = DS41Model(CONFIG, engram_token_map(ref.local_tokenizer())[0], dtype=torch.float64)
    ref.copy_reference_weights(model, theirs)
    path = save_folder(model, tmp_path_factory.mktemp("ds41") / "tiny", CONFIG, ref.local_tokenizer())
    return path, model


def test_round_trip_is_exact(folder):
    path, model = folder
    loaded = load_folder(path, dtype=torch.float64)
    ids = torch.randint(0, TEXT["vocab_size"], (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in path.iterdir()}


def copy_without(path, tmp_path, *drop: str):
    target = tmp_path / "copy"
    target.mkdir()
    for p in path.iterdir():
        if p.name not in drop:
            (target / p.name).write_bytes(p.read_bytes())
    return target


def test_folder_without_the_tokenizer_is_refused(folder, tmp_path):
    path, _ = folder
    bare = copy_without(path, tmp_path, "tokenizer.json")
    with pytest.raises(ValueError, match=r"tokenizer.json=None: Engram layers \[1, 3\] hash n-grams.*Copy the checkpoint's tokenizer.json"):
        load_folder(bare)


def test_v4_folder_and_bad_schedule_are_refused(tmp_path):
    v4 = tmp_path / "v4"
    v4.mkdir()
    (v4 / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="model_type='deepseek_v4'.*--model ds4"):
        read_folder_config(v4)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "text_config": dict(TEXT, candidate_source_layer_id=6)}))
    (bad / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="candidate_source_layer_id=6: layer 6 is not a Full layer"):
        read_folder_config(bad)


def test_weights_that_do_not_fit_are_refused(folder, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = folder
    broken = copy_without(path, tmp_path)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["decoder.layers.2.self_attention.core_attention.compressor.linear_wgate.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="missing .*compressor.linear_wgate.weight"):
        load_folder(broken)
