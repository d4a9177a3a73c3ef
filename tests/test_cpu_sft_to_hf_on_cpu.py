"""The SFT -> RL hand-over: the RL task's SFT demonstrations, and the Megatron checkpoint -> HF DS4 folder CLI."""

from __future__ import annotations

import json

import pytest
import torch

from verl_ds4.cpu.sft_data import DIGIT_PROMPT, digit_conversations, prepare_cpu_sft_assets
from verl_ds4.cpu.sft_to_hf import SFTConversionError, convert_sft_checkpoint, main


def test_digit_demonstrations_share_the_rl_prompt():
    from verl.utils.tokenizer.deepseek import EOS_TOKEN, encode_messages

    from verl_ds4.cpu.sft_data import build_char_tokenizer
    from verl_ds4.models.ds4.chat import render_conversation, tokenize_conversation
    from verl_ds4.rollout.demo_task import DATA_SOURCE, compute_score, digit_prompts

    convs = digit_conversations(50, seed=3)
    assert convs == digit_conversations(50, seed=3) and convs != digit_conversations(50, seed=4)
    tokenizer = build_char_tokenizer()
    for (user, answer), row in zip(convs, digit_prompts(5)):
        digit = user["content"].split()[-1].rstrip(".")
        assert user["content"] == DIGIT_PROMPT.format(digit=digit) and set(answer["content"]) == {digit}
        assert 3 <= len(answer["content"]) <= 6 and compute_score(DATA_SOURCE, answer["content"], digit) == 1.0
        rendered = render_conversation([user, answer])
        ids, mask = tokenize_conversation(tokenizer, rendered)
        # What verl's agent loop feeds the rollout for this prompt is the SFT sequence's untrained prefix.
        prompt = tokenizer(encode_messages([user], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)]) and all(mask[len(prompt):])
        assert tokenizer.decode(ids[len(prompt):]) == answer["content"] + EOS_TOKEN
        assert row["prompt"][0]["content"].startswith("Repeat the digit ")  # the RL rows ask the same


def _fake_sft_checkpoint(rank, world, model_dir, step_dir):
    """A dist-checkpoint like the SFT job's (DS4Model state dict, DCP files), with moved weights."""
    import torch.distributed.checkpoint as dcp
    from megatron.core import parallel_state

    from verl_ds4.models.ds4.hf_checkpoint import hf_tensors_of, load_hf_checkpoint

    parallel_state.initialize_model_parallel()
    try:
        model, info = load_hf_checkpoint(model_dir)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        dcp.save(state, checkpoint_id=str(step_dir / "model" / "dist_ckpt"))
        # tensors do not travel back through the result queue (shared memory); a file does
        torch.save(hf_tensors_of(model, info.family, info.dtypes), step_dir / "expected_hf_tensors.pt")
        return str(step_dir / "expected_hf_tensors.pt")
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def sft_checkpoint(tmp_path_factory):
    from verl_ds4.mcore.distributed import run_distributed

    root = tmp_path_factory.mktemp("handover")
    paths = prepare_cpu_sft_assets(root / "assets", model="ds4", task="digits", n_train=8)
    ckpt = root / "checkpoints"
    step_dir = ckpt / "global_step_3"
    [expected_file] = run_distributed(_fake_sft_checkpoint, world_size=1, args=(paths["model"], step_dir))
    expected = torch.load(expected_file)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    return root, paths["model"], ckpt, expected


def test_conversion_writes_the_checkpoints_weights_as_an_hf_folder(sft_checkpoint, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig
    from verl.utils.tokenizer.deepseek import EOS_TOKEN

    from verl_ds4.models.ds4.hf_checkpoint import read_hf_tensors

    root, model_dir, ckpt, expected = sft_checkpoint
    result = convert_sft_checkpoint(ckpt, model_dir, tmp_path / "hf")
    assert result["step"] == 3 and 0 < result["tensors_changed_by_sft"] <= result["tensors"]
    written, original = read_hf_tensors(tmp_path / "hf"), read_hf_tensors(model_dir)
    assert sorted(written) == sorted(expected) == sorted(original)
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name
    # The control: the checkpoint moved the weights, so the folder is not the start folder again.
    assert any(not torch.equal(written[n], original[n]) for n in original if original[n].is_floating_point())
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    eos = GenerationConfig.from_pretrained(tmp_path / "hf").eos_token_id
    assert tokenizer.convert_tokens_to_ids(EOS_TOKEN) in eos and tokenizer.eos_token_id in eos
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "deepseek_v4"
    # Issue 39: the hand-over folder ends with a manifest covering every file (control: a file cut short fails).
    from verl_ds4 import ckpt_manifest

    assert ckpt_manifest.verify_folder(tmp_path / "hf", full=True, require_manifest=True) == []
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    assert ckpt_manifest.verify_folder(tmp_path / "hf")[0].path == weights


def test_conversion_errors_say_what_to_pass(sft_checkpoint, tmp_path, capsys):
    root, model_dir, ckpt, _ = sft_checkpoint
    with pytest.raises(SFTConversionError, match="no model checkpoint at step 7"):
        convert_sft_checkpoint(ckpt, model_dir, tmp_path / "x", step=7)
    with pytest.raises(SFTConversionError, match="latest_checkpointed_iteration.txt"):
        convert_sft_checkpoint(root, model_dir, tmp_path / "x")
    proxy = prepare_cpu_sft_assets(tmp_path / "proxy", model="ds4_proxy", n_train=2)["model"]
    with pytest.raises(SystemExit) as exit_info:
        main(["--checkpoint", str(ckpt), "--model-dir", proxy, "--out", str(tmp_path / "y")])
    assert exit_info.value.code == 2 and "has no safetensors" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()
