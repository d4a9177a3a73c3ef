"""Examples longer than the length are counted at start-up, and dropped or refused, never silently truncated.

SFT: ``DS4ChatSFTDataset`` tokenizes every row when built and counts the rows above ``data.max_length``
(``data.drop_overlong_rows=true`` drops them, ``data.truncation=error`` refuses them, ``left``/``right`` says they
are cut). RL: ``DS4RLHFDataset`` (verl's ``RLHFDataset`` subclassed) measures each prompt with the builder verl's
agent loop renders DS4 prompts with and applies verl's ``data.filter_overlong_prompts`` with a count (verl's own
filter calls ``apply_chat_template``, which DS4 tokenizers lack). Real verl classes, the CPU character tokenizer with
DS4's control tokens; each with a negative control. A few seconds.
"""

from __future__ import annotations

import pandas as pd
import pytest
from omegaconf import OmegaConf

from verl_ds4.cpu.sft_data import build_char_tokenizer
from verl_ds4.models.ds4.rl_dataset import DS4RLHFDataset, OverlongPromptsError
from verl_ds4.models.ds4.sft_dataset import DS4ChatSFTDataset


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _sft(tmp_path, lengths):
    rows = [{"messages": [{"role": "user", "content": "q" * n}, {"role": "assistant", "content": "a"}]} for n in lengths]
    path = tmp_path / "sft.parquet"
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


def test_sft_overlong_rows_are_refused_dropped_or_cut_with_a_count(tok, tmp_path, capsys):
    path = _sft(tmp_path, [5, 60, 10, 80])
    with pytest.raises(ValueError) as e:  # at construction (start-up), not when the row is read mid-epoch
        DS4ChatSFTDataset(path, tok, {"max_length": 40})
    raise_msg = str(e.value)
    assert "2 of 4 rows are longer than data.max_length=40" in raise_msg and "rows [1, 3]" in raise_msg
    assert "data.drop_overlong_rows=true" in raise_msg and "ds4.max_seq_len" in raise_msg


def test_sft_drop_and_cut(tok, tmp_path, capsys):
    path = _sft(tmp_path, [5, 60, 10, 80])
    ds = DS4ChatSFTDataset(path, tok, {"max_length": 40, "drop_overlong_rows": True})
    assert len(ds) == 2 and ds.num_overlong == ds.num_overlong_dropped == 2 and ds.longest > 80
    assert all(len(ds[i]["input_ids"]) <= 40 for i in range(len(ds)))
    assert "2 of 4 rows are longer than data.max_length=40" in capsys.readouterr().out
    cut = DS4ChatSFTDataset(path, tok, {"max_length": 40, "truncation": "left"})
    assert len(cut) == 4 and cut.num_overlong == 2
    assert "each is cut to its last 40 tokens (data.truncation=left)" in capsys.readouterr().out
    # negative control: a length that holds every row counts none and drops nothing
    whole = DS4ChatSFTDataset(path, tok, {"max_length": 200, "drop_overlong_rows": True})
    assert len(whole) == 4 and whole.num_overlong == 0
    assert "0 of 4 rows are longer than data.max_length=200" in capsys.readouterr().out


def _rl(tmp_path, lengths, **config):
    rows = [{"prompt": [{"role": "user", "content": "p" * n}], "data_source": "t", "extra_info": {"index": i}}
            for i, n in enumerate(lengths)]
    path = tmp_path / "rl.parquet"
    pd.DataFrame(rows).to_parquet(path)
    cfg = OmegaConf.create({"max_prompt_length": 40, "truncation": "error", "filter_overlong_prompts": True,
                            "cache_dir": str(tmp_path / "cache"), **config})
    return str(path), cfg


def test_rl_prompts_are_measured_with_the_ds4_builder_and_filtered_with_a_count(tok, tmp_path, capsys):
    path, cfg = _rl(tmp_path, [5, 60, 10, 80, 20])
    ds = DS4RLHFDataset(path, tok, cfg)
    assert (ds.num_prompts, ds.num_overlong, ds.num_filtered, len(ds)) == (5, 2, 2, 3)
    out = capsys.readouterr().out
    assert "2 of 5 prompts are longer than data.max_prompt_length=40" in out and "dropped them" in out
    # the length is the rollout's: the builder verl's agent loop uses for deepseek_v4 (BOS, user, generation prompt)
    builder = ds.prompt_builder()
    kept = [len(builder.build_initial_tokens(list(ds[i]["raw_prompt"]))) for i in range(len(ds))]
    assert sorted(kept) == [5 + 4, 10 + 4, 20 + 4] and ds.longest_prompt == 80 + 4


def test_rl_overlong_prompts_without_the_filter_are_refused_or_reported(tok, tmp_path, capsys):
    path, cfg = _rl(tmp_path, [5, 60], filter_overlong_prompts=False)
    with pytest.raises(OverlongPromptsError, match=r"1 of 2 prompts are longer than data.max_prompt_length=40.*"
                                                   r"data.filter_overlong_prompts=true"):
        DS4RLHFDataset(path, tok, cfg)
    cfg.truncation = "left"
    assert len(DS4RLHFDataset(path, tok, cfg)) == 2
    assert "kept (data.truncation=left); verl's agent loop keeps the last 40 tokens" in capsys.readouterr().out
    # negative control: verl's own RLHFDataset cannot measure a DS4 prompt (no chat template) and drops everything
    from verl.utils.dataset.rl_dataset import RLHFDataset

    tok_no_template = build_char_tokenizer()
    tok_no_template.chat_template = None
    path, cfg = _rl(tmp_path, [5, 10])
    assert len(RLHFDataset(path, tok_no_template, cfg)) == 0
    assert len(DS4RLHFDataset(path, tok_no_template, cfg)) == 2


def test_the_rl_recipes_select_the_ds4_dataset_through_verls_loader():
    from verl.utils.dataset.rl_dataset import get_dataset_class

    from verl_ds4.recipes.compose import compose_recipe

    for kind in ("grpo", "deepseek_v41_grpo"):
        data = compose_recipe(kind, []).data
        assert get_dataset_class(data) is DS4RLHFDataset and data.filter_overlong_prompts is True
    # negative control: without data.custom_cls verl builds its own RLHFDataset
    assert get_dataset_class(OmegaConf.create({"custom_cls": {"path": None}})).__name__ == "RLHFDataset"
