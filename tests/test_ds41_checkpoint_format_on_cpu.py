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
from verl_ds4.models.ds41.folder import load_folder, save_folder
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


# --- Writing, the released folder end to end, the drafter, refusals, verify (verl_ds4.testing.ds41_hub_format) ---

import re  # noqa: E402
import shutil  # noqa: E402
import types  # noqa: E402

from verl_ds4.testing.ds41_hub_format import quantise_released, write_ds41_hub_folder  # noqa: E402


@pytest.fixture(scope="module")
def hub(setup, tmp_path_factory):
    """The tiny V4.1 (with its DSpark drafter) in DeepSeek's released format, and what a reader must return."""
    from verl_ds4.models.ds41.dspark import DS41DSpark

    theirs, ours, _, _ = setup
    ref.copy_reference_weights(ours, theirs)
    with ref.fp64_reference():
        their_drafter = ref.build_reference_dspark(TEXT)
    drafter = DS41DSpark(CONFIG, dtype=torch.float64)
    ref.load_tensors(drafter, ref.dspark_reference_tensors(drafter, their_drafter))
    folder, exact = write_ds41_hub_folder(ours.state_dict(), CONFIG, tmp_path_factory.mktemp("hub") / "v41",
                                          ref.local_tokenizer(), drafter_state=drafter.state_dict())
    return types.SimpleNamespace(folder=folder, exact=exact, ours=ours, drafter=drafter, their_drafter=their_drafter)


def test_writer_names_are_nemos(setup):
    """Our writer's names and values are NeMo's adapter's (``to_hf``) bit for bit, the drafter's too
    (NeMo's DSpark adapter); reading them back gives our tensors. Negative control: gate and up swapped."""
    theirs, ours, _, named = setup
    ref.copy_reference_weights(ours, theirs)
    mine = released.ours_to_released(ours.state_dict())
    assert set(named) - set(mine) == {k for k in named if k.endswith(".ffn.gate.bias_vl")}  # vision tokens only
    assert set(mine) <= set(named)
    assert all(mine[k].dtype == named[k].dtype and torch.equal(mine[k], named[k]) for k in mine)
    back, _ = released.released_to_ours(mine)
    state = ours.state_dict()
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in back)
    swapped = dict(state)
    key = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    swapped[key] = torch.cat(state[key].chunk(2)[::-1])
    assert not torch.equal(released.ours_to_released(swapped)["layers.0.ffn.experts.0.w1.weight"], named["layers.0.ffn.experts.0.w1.weight"])
    with pytest.raises(ValueError, match=r"no DeepSeek-V4.1 released name: \['decoder.layers.0.mlp.foo'\]"):
        released.ours_to_released({"decoder.layers.0.mlp.foo": torch.zeros(1)})


def test_drafter_names_are_nemos(hub):
    """The DSpark drafter: ours -> released equals NeMo's DSpark adapter on the same weights; a folder's
    ``mtp.*`` loads into ``DS41DSpark`` (``folder.load_drafter``) bit for bit, FP8 / FP4 decoded."""
    from verl_ds4.models.ds41.folder import load_drafter

    their_named = hub.their_drafter.state_dict_adapter.to_hf({k: v.detach() for k, v in hub.their_drafter.state_dict().items()})
    mine = released.ours_to_released(hub.drafter.state_dict())
    assert mine.keys() == {k for k in their_named if k.startswith("mtp.") and not k.endswith(".bias_vl")}
    assert all(torch.equal(mine[k], their_named[k]) for k in mine)
    state = load_drafter(hub.folder, dtype=torch.float64).state_dict()
    drafted = {k: v for k, v in hub.exact.items() if k.startswith("mtp.")}
    assert drafted.keys() == state.keys() and all(torch.equal(state[k], v) for k, v in drafted.items())
    assert sum(k.startswith("mtp.") and k.endswith(".scale") for k in _stored_names(hub.folder)) >= 10  # it was quantised


def _stored_names(folder) -> list[str]:
    return list(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])


def test_released_folder_loads_exactly(hub, capsys):
    """Shards + index, FP8 32 x 32 with E8M0 scales, FP4 experts, Engram row scales: the model loads the
    exact decoded values; the drafter's ``mtp.*`` and the routers' image-token bias are counted on stderr."""
    from safetensors import safe_open

    config = json.loads((hub.folder / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [32, 32]
    kinds = {}
    for file in hub.folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            kinds.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    assert kinds["layers.2.attn.wq_a.weight"] == "F8_E4M3" and kinds["layers.2.attn.wq_a.scale"] == "F8_E8M0"
    assert kinds["layers.0.ffn.experts.0.w1.weight"] == "I8" and kinds["layers.1.engram.embed.weight"] == "F8_E4M3"
    assert len(list(hub.folder.glob("*.safetensors"))) == 2
    state = load_folder(hub.folder, dtype=torch.float64).state_dict()
    err = capsys.readouterr().err
    drafter = sum(k.startswith("mtp.") and not k.endswith(".scale") for k in _stored_names(hub.folder))
    assert drafter > 99 and f"released names; not loaded (the text model does not build them): {drafter} mtp (DSpark drafter, not built), 8 routers' image-token bias" in err
    model_exact = {k: v for k, v in hub.exact.items() if not k.startswith("mtp.")}
    assert model_exact.keys() == state.keys() and all(torch.equal(state[k], v) for k, v in model_exact.items())
    # the quantised values differ from the float weights: the folder really is FP8 / FP4
    assert not torch.equal(state["decoder.layers.2.self_attention.linear_q_down_proj.weight"],
                           hub.ours.state_dict()["decoder.layers.2.self_attention.linear_q_down_proj.weight"])


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite(folder, change):
    """Apply ``change(tensors) -> tensors`` to the folder's tensors (one file, index dropped)."""
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
        file.unlink()
    (folder / "model.safetensors.index.json").unlink()
    save_file(change(tensors), str(folder / "model.safetensors"))
    return folder


def test_rules_are_checked_before_a_weight_is_read(hub, tmp_path, monkeypatch):
    """A missing tensor, an unknown name, a scale grid of another block size, a shard the index does not
    match and a V4 block size in config.json are refused from the headers alone: reading a weight fails
    the test. The good folder does reach the read (the guard is live)."""
    import safetensors.torch

    def no_read(*_a, **_k):
        raise AssertionError("a weight was read")

    cases, expected = _bad_folders(hub, tmp_path)
    monkeypatch.setattr(safetensors.torch, "load_file", no_read)
    for case, pattern in expected.items():
        with pytest.raises(ValueError, match=pattern):
            load_folder(cases[case], dtype=torch.float64)
    with pytest.raises(AssertionError, match="a weight was read"):
        load_folder(hub.folder, dtype=torch.float64)


def _bad_folders(hub, tmp_path):
    """Copies of the hub folder with one defect each, and the message each must raise."""
    cases = {}
    cases["missing"] = _rewrite(_copy(hub.folder, tmp_path / "missing"),
                                lambda t: {k: v for k, v in t.items() if not k.startswith("layers.3.attn.wq_b.")})
    cases["name"] = _rewrite(_copy(hub.folder, tmp_path / "name"),
                             lambda t: {("layers.3.attn.q_nrm.weight" if k == "layers.3.attn.q_norm.weight" else k): v for k, v in t.items()})

    def grid16(t):  # layers.2.attn.wq_a written with V4-style square blocks of 16 instead of V4.1's 32
        value = hub.exact["decoder.layers.2.self_attention.linear_q_down_proj.weight"]
        stored, _ = quantise_released({"layers.2.attn.wq_a.weight": value}, block=(16, 16))
        return {**t, **stored}

    cases["grid"] = _rewrite(_copy(hub.folder, tmp_path / "grid"), grid16)
    index = _copy(hub.folder, tmp_path / "index")
    data = json.loads((index / "model.safetensors.index.json").read_text())
    data["weight_map"]["layers.9.attn.wq_a.weight"] = "model-00003-of-00003.safetensors"
    (index / "model.safetensors.index.json").write_text(json.dumps(data))
    cases["index"] = index
    v4grid = _copy(hub.folder, tmp_path / "v4grid")
    config = json.loads((v4grid / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128, 128]
    (v4grid / "config.json").write_text(json.dumps(config))
    cases["v4grid"] = v4grid
    expected = {
        "missing": r"missing \['decoder.layers.3.self_attention.linear_q_up_proj.weight'\]",
        "name": r"does not name: \['layers.3.attn.q_nrm.weight'\]",
        "grid": r"'layers.2.attn.wq_a.weight' \(\d+, 32\) has scales \(\d+, 2\); weight_block_size \[32, 32\] needs",
        "index": r"listed but absent \['layers.9.attn.wq_a.weight'\]",
        "v4grid": r"weight_block_size=\[128, 128\] \(expected \[32, 32\]\)",
    }
    return cases, expected


def test_the_recipe_validator_reads_the_folder_format(hub, tmp_path, monkeypatch):
    """A V4.1 recipe's model.path is described at start-up from the headers (names, FP8 / FP4 counts, the
    drafter left out), and each defect a reader refuses is an error on model.path with the reader's message,
    without a weight read. (A tensor missing for the model is found at load, against the model: the
    validator builds none.) Negative control: an unquantised folder is described as such."""
    import safetensors.torch
    from omegaconf import OmegaConf

    from verl_ds4.recipes.checkpoint_check import check_ds41_checkpoint_format

    def check(folder):
        report = types.SimpleNamespace(notes=[], warnings=[], errors=[])
        check_ds41_checkpoint_format(OmegaConf.create({"model": {"path": str(folder)}}), "sft", [], report)
        return report

    cases, expected = _bad_folders(hub, tmp_path)
    monkeypatch.setattr(safetensors.torch, "load_file", lambda *_a, **_k: pytest.fail("a weight was read"))
    good = check(hub.folder)
    assert good.errors == [] and len(good.notes) == 1, good
    print(good.notes[0])
    note = good.notes[0]
    assert "DeepSeek's released names" in note and re.search(r"\d+ FP8 e4m3 weights .* [1-9]\d* FP4 expert weights", note), note
    assert re.search(r"not part of the text model: [1-9]\d* mtp \(DSpark drafter", note), note
    for case, pattern in expected.items():
        if case == "missing":
            continue
        report = check(cases[case])
        assert [p.setting for p in report.errors] == ["model.path"] and re.search(pattern, report.errors[0].message), (case, report)
    monkeypatch.undo()
    plain = tmp_path / "plain"
    save_folder(hub.ours, plain, CONFIG, tokenizer=ref.local_tokenizer())
    assert "unquantised weights" in check(plain).notes[0] and "FP8" not in check(plain).notes[0]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(CONFIG))
    assert "no *.safetensors yet" in check(empty).notes[0]


def test_v4_and_v41_folders_are_refused_both_ways(hub, tmp_path, capsys):
    """A V4 folder given to the V4.1 loaders / verify, and the V4.1 released folder given to V4's loader and
    V4's verify, are refused naming model_type and the fix."""
    from verl_ds4.verify import cli as verify_cli
    from verl_ds4.cpu.ds41_builder import ds41_folder_of
    from verl_ds4.models.ds4.hf_checkpoint import load_hf_checkpoint
    from verl_ds4.models.ds41.folder import load_drafter

    v4 = tmp_path / "v4"
    v4.mkdir()
    (v4 / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "num_hidden_layers": 2}))
    save_file({"layers.0.attn.wq_a.weight": torch.zeros(2, 2)}, str(v4 / "model.safetensors"))
    for load in (load_folder, load_drafter):
        with pytest.raises(ValueError, match=r"model_type='deepseek_v4'.*--model ds4"):
            load(v4)
    with pytest.raises(ValueError, match=r"model_type='deepseek_v4'.*--model ds4"):
        ds41_folder_of(types.SimpleNamespace(_name_or_path=str(v4), num_nextn_predict_layers=0))
    parser = __import__("argparse").ArgumentParser()
    verify_cli.add_arguments(parser)
    assert verify_cli.run(parser.parse_args(["--model", "ds41", "--hf-checkpoint", str(v4)])) == 2
    assert re.search(r"model_type='deepseek_v4'.*--model ds4", capsys.readouterr().err)
    with pytest.raises(ValueError, match=r"DeepSeek-V4.1 checkpoint.*verl-ds4 verify --model ds41"):
        load_hf_checkpoint(hub.folder)
    assert verify_cli.run(parser.parse_args(["--hf-checkpoint", str(hub.folder)])) == 2
    assert re.search(r"^verify --hf-checkpoint: .*DeepSeek-V4.1 checkpoint.*verl-ds4 verify --model ds41", capsys.readouterr().err)


def test_verify_hf_checkpoint(hub, tmp_path, capsys):
    """``verl-ds4 verify --model ds41 --hf-checkpoint DIR --cp 2``: ours (the CPU builder on 2 gloo ranks) and
    NeMo Automodel (its adapter) read the released FP8 / FP4 folder; logits and log-probs within 1e-10.
    Our export in released names (float64) read by ours is the same model as NeMo's reading of the FP8 original;
    folders in our names and in NeMo's in-memory names pass too.
    Negative control: NeMo reading a copy with one scale byte one higher (its 32 x 32 block doubled) is caught."""
    from verl_ds4.verify import cli as verify_cli
    from verl_ds4.verify.ds41_hf import compare_folder_with_nemo, nemo_model_from_folder
    from verl_ds4.models.ds41.folder import save_folder

    parser = __import__("argparse").ArgumentParser()
    verify_cli.add_arguments(parser)
    report = tmp_path / "verify.json"
    args = parser.parse_args(["--model", "ds41", "--hf-checkpoint", str(hub.folder), "--cp", "2", "--json", str(report)])
    assert verify_cli.run(args) == 0, capsys.readouterr().out
    result = json.loads(report.read_text())
    assert result["passed"] and result["style"] == "released" and result["cp"] == 2
    assert result["logits"] < 1e-10 and result["log_probs"] < 1e-10

    # Exit codes: the same numbers against a tolerance no fp64 computation meets exit 1; no reference exits 2.
    from verl_ds4.verify import ds41_hf as verify_ds41_hf
    from verl_ds4.models.ds41 import reference

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(verify_ds41_hf, "compare_folder_with_nemo", lambda *a, **k: {k: v for k, v in result.items() if k in ("logits", "log_probs", "lengths", "style", "seconds")})
        assert verify_cli.run(parser.parse_args(["--model", "ds41", "--hf-checkpoint", str(hub.folder), "--fp64-rtol", "1e-30"])) == 1
        mp.setattr(reference, "reference_missing", lambda: "NeMo Automodel 0.7.0 is not installed: pip install ...")
        assert verify_cli.run(parser.parse_args(["--model", "ds41", "--hf-checkpoint", str(hub.folder)])) == 2
    assert "FAILED" in capsys.readouterr().out
    for extra, words in ((["--dtype", "fp32"], "--dtype fp32 (this comparison runs in fp64 only)"), (["--config", "{}"], "--config"),
                         (["--allow-mtp-skip"], "--allow-mtp-skip"), (["--cp", "0"], "--cp 0 (give N >= 1)")):  # fmt: skip
        assert verify_cli.run(parser.parse_args(["--model", "ds41", "--hf-checkpoint", str(hub.folder), *extra])) == 2
        assert f"options this comparison would ignore: {words}" in capsys.readouterr().err, extra

    exported = save_folder(load_folder(hub.folder, dtype=torch.float64), tmp_path / "export", CONFIG,
                           ref.local_tokenizer(), names="released")
    assert released.name_style(released.read_headers(exported)[0]) == "released"
    same = compare_folder_with_nemo(exported, cp=1, reference_folder=hub.folder)
    assert same["logits"] < 1e-10 and same["log_probs"] < 1e-10

    # Our names and NeMo's in-memory names, each read by both sides (NeMo: renamed by our writer / as is).
    save_folder(load_folder(hub.folder, dtype=torch.float64), tmp_path / "ours", CONFIG, ref.local_tokenizer())
    nemo = nemo_model_from_folder(hub.folder)
    _folder(tmp_path / "nemo", {k: v.detach().clone().contiguous() for k, v in nemo.state_dict().items()})
    for names in ("ours", "nemo"):
        got = compare_folder_with_nemo(tmp_path / names, cp=1)
        assert got["style"] == names and got["logits"] < 1e-10 and got["log_probs"] < 1e-10, (names, got)

    flipped = _copy(hub.folder, tmp_path / "flipped")

    def bump(t):
        scale = t["layers.2.attn.wo_b.scale"].view(torch.uint8).clone()  # not followed by a norm (wq_a is: scale-free)
        scale[0, 0] += 1
        return {**t, "layers.2.attn.wo_b.scale": scale.view(torch.float8_e8m0fnu)}

    _rewrite(flipped, bump)
    off = compare_folder_with_nemo(hub.folder, cp=1, reference_folder=flipped)
    assert off["logits"] > 1e-3, off
    print(f"verify CP 2: logits {result['logits']:.2e}, log-probs {result['log_probs']:.2e}; export vs FP8 original "
          f"{same['logits']:.2e}; one scale flipped {off['logits']:.2e}")
