"""DS4 SFT data path: DS4 chat encoding, assistant-only loss mask, malformed rows, gsm8k data.

The tokenizer is built in the test (a word-level ``tokenizers`` model with DS4's control tokens,
wrapped in ``PreTrainedTokenizerFast``; no hub download). Expected token sequences are written out
by hand from DS4's published turn format, then mapped to ids with the test vocabulary.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pandas as pd
import pytest
import torch
from verl.utils.tokenizer.deepseek import encode_messages

from verl_ds4.models.ds4.chat import (
    MalformedRowError,
    render_conversation,
    resolve_thinking,
    tokenize_conversation,
    validate_conversation,
)
from verl_ds4.models.ds4.sft_dataset import DS4ChatSFTDataset
from verl_ds4.recipes.gsm8k import extract_answer, prepare, to_rl_row, to_sft_row
from verl_ds4.cpu.ds4_tokenizer import ds4_test_vocab, make_ds4_test_tokenizer

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"

WORDS = ["Be", "brief", ".", "What", "is", "2", "+", "?", "4", "a", "b", "c", "d", "r1", "r2", "ok", "Go", "done"]


@pytest.fixture(scope="module")
def tok():
    return make_ds4_test_tokenizer(WORDS)


def ids_of(tokens: list[str]) -> list[int]:
    vocab = ds4_test_vocab(WORDS)
    return [vocab.index(t) for t in tokens]


def test_known_conversation_renders_to_expected_ids_and_mask(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
    ]
    ids, mask = tokenize_conversation(tok, render_conversation(messages))
    expected = [BOS, "Be", "brief", ".", USER, "What", "is", "2", "+", "2", "?", ASSISTANT, END_THINK, "4", ".", EOS]
    assert ids == ids_of(expected)
    assert mask == [0] * 13 + [1, 1, 1]


def test_multi_turn_thinking_drops_old_reasoning_and_trains_every_assistant_turn(tok):
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "reasoning_content": "r1", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "reasoning_content": "r2", "content": "d"},
    ]
    rendered = render_conversation(messages, enable_thinking=True, drop_thinking=True)
    ids, mask = tokenize_conversation(tok, rendered)
    # Turn 1 lost its reasoning (before the last user turn): header "<Assistant></think>".
    expected = [BOS, USER, "a", ASSISTANT, END_THINK, "b", EOS, USER, "c", ASSISTANT, THINK, "r2", END_THINK, "d", EOS]
    assert ids == ids_of(expected)
    assert mask == [0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]
    # Without dropping, both turns keep their reasoning and it is trained.
    ids, mask = tokenize_conversation(tok, render_conversation(messages, enable_thinking=True, drop_thinking=False))
    assert ids[3:8] == ids_of([ASSISTANT, THINK, "r1", END_THINK, "b"]) and mask[3:9] == [0, 0, 1, 1, 1, 1]


def test_text_is_verls_ds4_encoding_and_prompt_matches_rollout(tok):
    """SFT text is exactly verl's DS4 encoder output; the untrained prefix equals the rollout prompt."""
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]
    for thinking in (False, True):
        rendered = render_conversation(messages, enable_thinking=thinking)
        assert rendered.text == encode_messages(messages, add_generation_prompt=False, enable_thinking=thinking)
        ids, mask = tokenize_conversation(tok, rendered)
        prompt = encode_messages(messages[:1], add_generation_prompt=True, enable_thinking=thinking)
        assert ids[: mask.index(1)] == tok.encode(prompt, add_special_tokens=False)
        assert ids == tok.encode(rendered.text, add_special_tokens=False)


def test_tool_call_turns_train_calls_not_results(tok):
    messages = [
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "calc", "arguments": {"x": 2}}}]},
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": "done"},
    ]
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    rendered = render_conversation(messages, tools)
    assert len(rendered.spans) == 2
    first, second = (rendered.text[s:e] for s, e in rendered.spans)
    assert "invoke name=\"calc\"" in first and first.endswith(EOS) and "<tool_result>" not in first
    assert second == "done" + EOS
    # The tool result sits between the spans and is not trained.
    assert "<tool_result>4</tool_result>" in rendered.text[rendered.spans[0][1] : rendered.spans[1][0]]
    ids, mask = tokenize_conversation(tok, rendered)
    trained = [t for t, m in zip(tok.convert_ids_to_tokens(ids), mask) if m]
    assert trained[-2:] == ["done", EOS] and trained.count(EOS) == 2


def test_quick_instruction_task_trains_text_after_task_token(tok):
    messages = [{"role": "user", "content": "a", "task": "query"}, {"role": "assistant", "content": "ok"}]
    rendered = render_conversation(messages)
    assert rendered.text.endswith("<｜query｜>ok" + EOS)
    assert [rendered.text[s:e] for s, e in rendered.spans] == ["ok" + EOS]


def test_slow_tokenizer_path_matches_fast_path(tok):
    class Slow:
        is_fast = False

        def encode(self, text, add_special_tokens=False):
            return tok.encode(text, add_special_tokens=add_special_tokens)

    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "reasoning_content": "r1", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    rendered = render_conversation(messages, enable_thinking=True, drop_thinking=False)
    assert tokenize_conversation(Slow(), rendered) == tokenize_conversation(tok, rendered)


@pytest.mark.parametrize(
    "messages, reason",
    [
        ([], "non-empty list"),
        ([{"role": "user", "content": "a"}], "no assistant message"),
        ([{"role": "robot", "content": "a"}, {"role": "assistant", "content": "b"}], "role 'robot'"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}], "is empty"),
        ([{"role": "user", "content": f"a {EOS} b"}, {"role": "assistant", "content": "b"}], "control token"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": 4}], "content is a int"),
        ([{"role": "user", "content": "a", "task": "dance"}, {"role": "assistant", "content": "b"}], "task 'dance'"),
    ],
)
def test_malformed_conversation_names_row(messages, reason):
    with pytest.raises(MalformedRowError, match="row 7") as info:
        validate_conversation(messages, row=7)
    assert reason in str(info.value) and "drop_malformed_rows" in str(info.value)


def test_thinking_resolution():
    assert resolve_thinking(None, None, "none") is False  # verl's config default string
    assert resolve_thinking(None, None, True) is True
    assert resolve_thinking(True, None, False) is True
    assert resolve_thinking(None, "thinking", False) is True and resolve_thinking(None, "chat", True) is False
    assert resolve_thinking(float("nan"), None, False) is False
    with pytest.raises(MalformedRowError, match="contradicts"):
        resolve_thinking(True, "chat", None, row=3)
    with pytest.raises(MalformedRowError, match="thinking_mode='loud'"):
        resolve_thinking(None, "loud", None, row=3)


def _rows():
    return [
        {
            "messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}],
            "enable_thinking": None,
            "thinking_mode": None,
        },
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b", "reasoning_content": "r1"},
            ],
            "enable_thinking": None,
            "thinking_mode": "thinking",
        },
    ]


def test_dataset_items_from_parquet(tok, tmp_path):
    path = tmp_path / "sft.parquet"
    pd.DataFrame(_rows()).to_parquet(path)
    ds = DS4ChatSFTDataset(str(path), tok, {"max_length": 64, "enable_thinking_default": "none"})
    assert len(ds) == 2
    item = ds[0]
    assert set(item) == {"input_ids", "position_ids", "loss_mask"}
    expected = [BOS, USER, "What", "is", "2", "+", "2", "?", ASSISTANT, END_THINK, "4", ".", EOS]
    assert item["input_ids"].tolist() == ids_of(expected)
    assert item["loss_mask"].tolist() == [0] * 10 + [1, 1, 1]
    assert torch.equal(item["position_ids"], torch.arange(len(expected)))
    # Row 2 selected thinking mode per row: reasoning is rendered and trained.
    thinking = ds[1]
    assert thinking["input_ids"].tolist() == ids_of([BOS, USER, "a", ASSISTANT, THINK, "r1", END_THINK, "b", EOS])
    assert thinking["loss_mask"].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1]

    right = DS4ChatSFTDataset([str(path)], tok, {"max_length": 16, "pad_mode": "right"})[0]
    assert right["input_ids"].shape == (16,) and right["attention_mask"].sum() == 13
    assert right["loss_mask"][13:].sum() == 0 and right["input_ids"][13:].tolist() == [tok.pad_token_id] * 3

    with pytest.raises(ValueError, match="2 of 2 rows are longer than data.max_length=8"):
        DS4ChatSFTDataset(str(path), tok, {"max_length": 8})[0]
    left = DS4ChatSFTDataset(str(path), tok, {"max_length": 8, "truncation": "left"})[0]
    assert left["input_ids"].tolist() == ids_of(expected)[-8:]
    assert left["loss_mask"].tolist()[0] == 0 and left["loss_mask"].tolist()[-3:] == [1, 1, 1]


def test_dataset_rejects_or_drops_malformed_rows(tok, tmp_path, caplog):
    rows = _rows() + [
        {"messages": [{"role": "user", "content": "only a question"}], "enable_thinking": None, "thinking_mode": None}
    ]
    path = tmp_path / "bad.parquet"
    pd.DataFrame(rows).to_parquet(path)
    with pytest.raises(MalformedRowError, match=r"row 2 \(file row index 2\): has no assistant message"):
        DS4ChatSFTDataset(str(path), tok, {})
    with caplog.at_level(logging.WARNING):
        ds = DS4ChatSFTDataset(str(path), tok, {"drop_malformed_rows": True})
    assert len(ds) == 2 and ds.num_dropped == 1
    assert "dropped 1 of 3 rows" in caplog.text


def test_dataset_loads_through_verls_sft_dataset_factory(tok, tmp_path):
    """The recipe's data.custom_cls (a pkg:// path) resolves with verl's own loader."""
    from omegaconf import OmegaConf
    from verl.utils.import_utils import load_extern_object

    from verl_ds4.recipes.compose import compose_recipe

    path = tmp_path / "sft.parquet"
    pd.DataFrame(_rows()).to_parquet(path)
    data_cfg = compose_recipe("sft", [f"data.train_files={path}"]).data
    cls = load_extern_object(data_cfg.custom_cls.path, data_cfg.custom_cls.name)
    assert cls is DS4ChatSFTDataset
    ds = cls(parquet_files=data_cfg.train_files, tokenizer=tok, config=data_cfg, processor=None, max_samples=-1)
    assert len(ds) == 2 and ds[0]["loss_mask"].sum() == 3
    assert OmegaConf.select(data_cfg, "pad_mode") == "no_padding"


def test_gsm8k_preparation_from_local_files(tok, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    example = {"question": "Sam has 2 cats and gets 1,200 more. How many?", "answer": "2+1200=<<2+1200=1202>>1202\n#### 1,202"}
    (raw / "train.jsonl").write_text(json.dumps(example) + "\n")
    pd.DataFrame([example]).to_parquet(raw / "test.parquet")
    written = prepare(str(raw), str(tmp_path / "sft"), str(tmp_path / "rl"), ["train", "test"])
    assert sorted(written.values()) == [1, 1, 1, 1]
    assert extract_answer(example["answer"]) == "1202"
    sft = pd.read_parquet(tmp_path / "sft" / "train.parquet")
    messages = list(sft.iloc[0]["messages"])
    assert messages[0]["role"] == "user" and "####" in messages[0]["content"]
    assert messages[1]["content"] == "2+1200=1202\n#### 1,202"  # calculator annotation removed
    rl = pd.read_parquet(tmp_path / "rl" / "test.parquet").iloc[0]
    assert rl["data_source"] == "openai/gsm8k" and rl["reward_model"]["ground_truth"] == "1202"
    assert rl["prompt"][0]["role"] == "user" and rl["extra_info"]["split"] == "test"
    # The SFT parquet is consumable by the DS4 dataset as written.
    ds = DS4ChatSFTDataset(str(tmp_path / "sft" / "train.parquet"), tok, {"max_length": 256})
    assert ds[0]["loss_mask"].sum() > 0
    assert to_sft_row(example, 0, "train")["extra_info"]["answer"] == to_rl_row(example, 0, "train")["reward_model"]["ground_truth"]
    with pytest.raises(ValueError, match="no '#### <number>'"):
        extract_answer("no final answer")


def test_sft_assets_are_reused_for_the_same_arguments_and_rewritten_otherwise(tmp_path):
    from verl_ds4.cpu.sft_data import prepare_cpu_sft_assets

    first = prepare_cpu_sft_assets(tmp_path, model="tiny_dense", n_train=8)
    train = Path(first["train"])
    stamp = train.stat().st_mtime_ns
    assert prepare_cpu_sft_assets(tmp_path, model="tiny_dense", n_train=8) == first
    assert train.stat().st_mtime_ns == stamp  # reused, not rewritten
    # negative controls: other arguments, or a record whose files are gone, rewrite the folder
    prepare_cpu_sft_assets(tmp_path, model="tiny_dense", n_train=12)
    assert len(pd.read_parquet(train)) == 12
    train.unlink()
    prepare_cpu_sft_assets(tmp_path, model="tiny_dense", n_train=12)
    assert len(pd.read_parquet(train)) == 12
