"""Long SFT rows for the CPU main job (``TASK=long`` with ``MAX_SEQ_LEN=N``), and the launcher's length checks.

* :func:`long_conversations` (in :mod:`verl_ds4.cpu.sft_data`, re-exported here) - multi-turn arithmetic chats (:func:`verl_ds4.cpu.sft_data.arithmetic_conversations`'
  turns) packed into conversations of at most ``seq_len`` tokens each, counted with the job's tokenizer and DS4's
  chat encoding (:class:`verl_ds4.models.ds4.sft_dataset.DS4ChatSFTDataset`'s), so every row is one sequence of
  nearly ``seq_len`` tokens: a 16k row is one 16k-token sequence spread over the CP ranks, not many short ones.
  The loss falls as the model learns the turns' format and arithmetic (the same lesson as the short job); it is a
  length and memory test, not a long-range recall task.
* :func:`check_max_seq_len` (``python -m verl_ds4.cpu.long_data check ...``, the launcher runs it before torchrun):
  refuses a length above the model folder's ``max_position_embeddings`` (with the fix: a shorter length, or
  ``MAX_POSITIONS`` to raise the tiny model's field for the run), and data rows longer than the length through the
  SFT dataset's own count (``DS4ChatSFTDataset`` with ``data.truncation=error``): never a silent cut.
* :func:`check_rl_lengths` (``... rl-check``, the CPU RL launcher with ``PROMPT_LENGTH``): prompt + response above the
  model's ``max_position_embeddings`` refused before Ray starts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from verl_ds4.cpu.sft_data import long_conversations, token_count

__all__ = ["check_max_seq_len", "check_rl_lengths", "long_conversations", "model_positions", "token_count"]


def model_positions(model_dir: str | Path) -> int | None:
    """The model folder's ``max_position_embeddings`` (config.json), None when it has none."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    value = cfg.get("max_position_embeddings", (cfg.get("text_config") or {}).get("max_position_embeddings"))
    return None if value is None else int(value)


def check_max_seq_len(seq_len: int, model_dir: str | Path, train_file: str | Path | None = None,
                      max_positions: int | None = None) -> list[str]:
    """Problems (empty: none) of training ``seq_len``-token rows of ``train_file`` on the model of ``model_dir``."""
    problems = []
    limit = model_positions(model_dir)
    if limit is not None and seq_len > limit:
        hint = (f"or raise MAX_POSITIONS={max_positions} to {seq_len} or more" if max_positions else
                f"or MAX_POSITIONS={seq_len} (raises the tiny model folder's max_position_embeddings for the run: a size of "
                "our choosing, no weight or RoPE value reads it)")
        problems.append(f"MAX_SEQ_LEN={seq_len}: the model folder {model_dir} has max_position_embeddings = {limit}, "
                        f"expected MAX_SEQ_LEN <= {limit}; give MAX_SEQ_LEN={limit} or less, {hint}")
    if train_file is not None and not problems:
        from verl.utils import hf_tokenizer

        from verl_ds4.models.ds4.sft_dataset import DS4ChatSFTDataset

        try:  # the trainer's own dataset, as the run will build it: counts the rows over the length, refuses them
            DS4ChatSFTDataset(str(train_file), hf_tokenizer(str(model_dir)), {"max_length": seq_len, "truncation": "error"})
        except ValueError as err:
            problems.append(f"MAX_SEQ_LEN={seq_len}: {err}")
    return problems


def check_rl_lengths(prompt_len: int, response_len: int, model_dir: str | Path) -> list[str]:
    """Problems (empty: none) of prompts of ``prompt_len`` + responses of ``response_len`` tokens on the model of
    ``model_dir``: their sum above its ``max_position_embeddings`` (the rollout's longest sequence) is refused."""
    limit = model_positions(model_dir)
    total = prompt_len + response_len
    if limit is None or total <= limit:
        return []
    return [f"PROMPT_LENGTH={prompt_len} + RESPONSE_LENGTH={response_len} = {total} tokens: the model {model_dir} has "
            f"max_position_embeddings = {limit}, expected prompt + response <= {limit}; shorten them, or "
            f"MAX_POSITIONS={total} (raises the assets' tiny model's field: no weight or RoPE value reads it)"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_ds4.cpu.long_data",
                                     description="Refuse a CPU SFT length (check) or RL prompt + response (rl-check) the "
                                                 "model or the data cannot take (no training).")
    parser.add_argument("command", choices=["check", "rl-check"])
    parser.add_argument("--max-seq-len", type=int, default=None, help="check: the SFT length")
    parser.add_argument("--prompt-len", type=int, default=None, help="rl-check: the prompt length")
    parser.add_argument("--response-len", type=int, default=None, help="rl-check: the response length")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--train-file", default=None)
    parser.add_argument("--max-positions", type=int, default=None)
    args = parser.parse_args(argv)
    if args.command == "rl-check":
        problems = check_rl_lengths(args.prompt_len, args.response_len, args.model_dir)
        for p in problems:
            print(p, file=sys.stderr)
        return 2 if problems else 0
    import transformers

    transformers.logging.set_verbosity_error()  # the tiny config's raised positions make transformers' YaRN note noise
    problems = check_max_seq_len(args.max_seq_len, args.model_dir, args.train_file, args.max_positions)
    for p in problems:
        print(p, file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
