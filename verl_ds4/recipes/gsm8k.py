"""GSM8K -> DS4 recipe data: an SFT ``messages`` parquet and an RL parquet (verl's layout).

    python scripts/prepare_gsm8k.py                                  # from the hub (openai/gsm8k, "main")
    python scripts/prepare_gsm8k.py --source /data/gsm8k             # from local files

A local ``--source`` is a file (``.jsonl``, ``.json`` or ``.parquet`` with ``question`` / ``answer``
columns; used for every split) or a folder holding ``<split>.jsonl`` / ``<split>.parquet`` (also
``main/<split>-*.parquet`` as in the hub repository). Output:

- SFT (``--sft-dir``): ``messages`` = [user question + instruction, assistant worked solution ending in
  ``#### <answer>``] plus ``extra_info``; rendered by :class:`DS4ChatSFTDataset`.
- RL (``--rl-dir``): ``data_source="openai/gsm8k"`` (selects verl's built-in GSM8K rule reward),
  ``prompt`` (chat messages), ``ability``, ``reward_model={"style": "rule", "ground_truth": answer}``,
  ``extra_info``.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from typing import Any, Iterable

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
DATA_SOURCE = "openai/gsm8k"
_ANSWER = re.compile(r"####\s*(-?[0-9.,]+)")
_CALCULATOR = re.compile(r"<<[^<>]*>>")


def extract_answer(solution: str) -> str:
    """The number after ``####`` (commas removed)."""
    match = _ANSWER.search(solution)
    if match is None:
        raise ValueError(f"GSM8K solution has no '#### <number>' final answer: {solution[-80:]!r}")
    return match.group(1).replace(",", "")


def clean_solution(solution: str) -> str:
    """Drop GSM8K's ``<<48/2=24>>`` calculator annotations; keep the text and the final line."""
    return _CALCULATOR.sub("", solution).strip()


def to_sft_row(example: dict[str, Any], index: int, split: str) -> dict[str, Any]:
    question, solution = str(example["question"]), str(example["answer"])
    return {
        "messages": [
            {"role": "user", "content": f"{question} {INSTRUCTION}"},
            {"role": "assistant", "content": clean_solution(solution)},
        ],
        "extra_info": {"split": split, "index": index, "answer": extract_answer(solution)},
    }


def to_rl_row(example: dict[str, Any], index: int, split: str) -> dict[str, Any]:
    question, solution = str(example["question"]), str(example["answer"])
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_answer(solution)},
        "extra_info": {"split": split, "index": index, "answer": solution, "question": question},
    }


def _read_file(path: str) -> list[dict[str, Any]]:
    import pandas as pd

    if path.endswith(".parquet"):
        df = pd.read_parquet(path)
    elif path.endswith(".jsonl"):
        df = pd.read_json(path, lines=True)
    elif path.endswith(".json"):
        df = pd.read_json(path)
    else:
        raise ValueError(f"Unsupported GSM8K file {path!r}: use .jsonl, .json or .parquet.")
    missing = {"question", "answer"} - set(df.columns)
    if missing:
        raise ValueError(f"GSM8K file {path!r} lacks column(s) {sorted(missing)} (has {list(df.columns)}).")
    return df[["question", "answer"]].to_dict("records")


def load_split(source: str, split: str) -> list[dict[str, Any]]:
    """Rows of one split from a local file/folder, or from the hub when ``source`` is not local."""
    expanded = os.path.expanduser(source)
    if os.path.isfile(expanded):
        return _read_file(expanded)
    if os.path.isdir(expanded):
        for pattern in (f"{split}.jsonl", f"{split}.parquet", f"{split}.json", f"main/{split}-*.parquet", f"{split}-*.parquet"):
            found = sorted(glob.glob(os.path.join(expanded, pattern)))
            if found:
                return [row for path in found for row in _read_file(path)]
        raise FileNotFoundError(f"No {split} split in {expanded} (looked for {split}.jsonl/.parquet/.json, main/{split}-*.parquet).")
    if source.startswith((".", "/", "~")):
        raise FileNotFoundError(f"GSM8K source {source!r} does not exist.")
    import datasets

    return [dict(row) for row in datasets.load_dataset(source, "main", split=split)]


def write_parquet(rows: Iterable[dict[str, Any]], path: str) -> int:
    import pandas as pd

    rows = list(rows)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pd.DataFrame(rows).to_parquet(path, index=False)
    return len(rows)


def prepare(source: str, sft_dir: str | None, rl_dir: str | None, splits: list[str], max_rows: int = -1) -> dict[str, int]:
    """Write ``<dir>/<split>.parquet`` for each requested output; returns rows written per file."""
    written: dict[str, int] = {}
    for split in splits:
        examples = load_split(source, split)
        if max_rows > 0:
            examples = examples[:max_rows]
        if sft_dir:
            path = os.path.join(os.path.expanduser(sft_dir), f"{split}.parquet")
            written[path] = write_parquet((to_sft_row(e, i, split) for i, e in enumerate(examples)), path)
        if rl_dir:
            path = os.path.join(os.path.expanduser(rl_dir), f"{split}.parquet")
            written[path] = write_parquet((to_rl_row(e, i, split) for i, e in enumerate(examples)), path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=DATA_SOURCE, help="hub dataset id or a local file/folder (default openai/gsm8k)")
    parser.add_argument("--sft-dir", default="~/data/gsm8k_ds4_sft", help="SFT output folder ('' to skip)")
    parser.add_argument("--rl-dir", default="~/data/gsm8k_ds4_rl", help="RL output folder ('' to skip)")
    parser.add_argument("--splits", nargs="+", default=["train", "test"])
    parser.add_argument("--max-rows", type=int, default=-1, help="keep the first N rows of each split (-1: all)")
    args = parser.parse_args(argv)
    if not args.sft_dir and not args.rl_dir:
        parser.error("nothing to do: both --sft-dir and --rl-dir are empty")
    for path, n in prepare(args.source, args.sft_dir or None, args.rl_dir or None, args.splits, args.max_rows).items():
        print(f"wrote {n} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
