"""The CPU PPO demo's task: a tiny, download-free RL dataset and its rule reward.

Prompts ask for one digit repeated (``"Repeat the digit 7."``); the rule reward
(:func:`compute_score`, verl's ``custom_reward_function`` signature) scores the decoded response
per character: 1 for the asked digit, 0.2 for any other digit, 0 otherwise, averaged over the
response (so in [0, 1], and a random policy already earns a little of it).

:func:`write_ppo_assets` writes everything a run needs into one folder, deterministically:
``model/`` (the character tokenizer with its chat template and, by default, the full tiny DS4's
checkpoint folder: config + seeded safetensors; ``model="ds4_proxy"`` writes the attention-only
proxy's config instead; :mod:`verl_ds4.cpu.sft_data`) and ``data/{train,val}.parquet`` in verl's RL format
(``data_source``, ``prompt`` as chat messages, ``ability``, ``reward_model`` with the
``ground_truth``, ``extra_info``).

    python -m verl_ds4.rollout.demo_task --out runs/ds4_proxy_ppo_cpu/assets
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

__all__ = ["DATA_SOURCE", "compute_score", "digit_prompts", "write_ppo_assets"]

DATA_SOURCE = "verl_ds4/cpu_digits"


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **kwargs) -> float:
    """Per-character reward of a response for the digit ``ground_truth`` (see module docstring)."""
    if data_source != DATA_SOURCE:
        raise ValueError(f"compute_score scores {DATA_SOURCE!r} rows only, got data_source={data_source!r}.")
    text = solution_str or ""
    if not text:
        return 0.0
    score = sum(1.0 if ch == ground_truth else 0.2 if ch.isdigit() else 0.0 for ch in text)
    return score / len(text)


#: Tokens of the chat template around a prompt's content (<|user|> ... <|end|><|assistant|>), with room to spare.
PROMPT_OVERHEAD = 8


def long_context(chars: int, seed: int) -> str:
    """``chars`` characters of arithmetic Q/A text (one token each with the CPU jobs' character tokenizer), a pure
    function of ``(chars, seed)``: the context in front of a long prompt's instruction."""
    from verl_ds4.cpu.sft_data import arithmetic_conversations

    text, k = "", 0
    while len(text) < chars:
        batch = arithmetic_conversations(64, seed=seed * 1000 + k)
        text += " ".join(turn["content"] for conv in batch for turn in conv) + " "
        k += 1
    return text[:chars]


def digit_prompts(n: int, seed: int = 0, prompt_len: int | None = None) -> list[dict[str, Any]]:
    """``n`` RL rows (a pure function of ``n``, ``seed`` and ``prompt_len``). ``prompt_len``: each prompt is filled
    to about that many tokens (at most) with arithmetic text in front of the instruction (a long-context run)."""
    from verl_ds4.cpu.sft_data import DIGIT_PROMPT

    rng = random.Random(seed)
    rows = []
    for index in range(n):
        digit = str(rng.randrange(10))
        content = DIGIT_PROMPT.format(digit=digit)
        if prompt_len:
            fill = prompt_len - PROMPT_OVERHEAD - len(content) - 1
            if fill < 1:
                raise ValueError(f"prompt_len={prompt_len}: expected more than {len(content) + PROMPT_OVERHEAD + 1} tokens")
            content = long_context(fill, seed + index) + "\n" + content
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": content}],
                "ability": "copy",
                "reward_model": {"style": "rule", "ground_truth": digit},
                "extra_info": {"index": index, "digit": digit},
            }
        )
    return rows


def _write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


PPO_MODELS = ("ds4", "ds4_proxy", "ds41")


def write_ppo_assets(
    out_dir: str | Path, *, n_train: int = 256, n_val: int = 16, seed: int = 0, model: str = "ds4",
    prompt_len: int | None = None, max_positions: int | None = None, family: str = "transformers",
) -> dict[str, str]:
    """Write ``model/`` and ``data/{train,val}.parquet`` under ``out_dir``; returns their paths. A folder
    that an earlier call with the same arguments completed (its ``assets.json``) is reused as it is.
    ``family``: the model's tensor names, transformers' or DeepSeek's ``native`` ones (what Megatron-Bridge reads:
    the production CPU engine); ``ds4`` only."""
    if n_train < 1 or n_val < 0:
        raise ValueError(f"need n_train >= 1 and n_val >= 0, got n_train={n_train}, n_val={n_val}.")
    if model not in PPO_MODELS:
        raise ValueError(f"model={model!r}; the CPU PPO run trains one of {PPO_MODELS}.")
    if family not in ("transformers", "native") or (family == "native" and model != "ds4"):
        raise ValueError(f"family={family!r} with model={model!r}: expected transformers, or native with model ds4 "
                         "(the tiny DS4 in DeepSeek's names, which Megatron-Bridge reads)")
    out_dir = Path(out_dir)
    from verl_ds4.cpu.sft_data import record_assets, reuse_assets, write_cpu_model_folder

    recorded = {"model": model, "n_train": n_train, "n_val": n_val, "seed": seed}
    recorded |= {k: int(v) for k, v in (("prompt_len", prompt_len), ("max_positions", max_positions)) if v}
    if family != "transformers":
        recorded["family"] = family
    paths = {"model": str(out_dir / "model"), "train": str(out_dir / "data" / "train.parquet"),
             "val": str(out_dir / "data" / "val.parquet")}
    if reuse_assets(out_dir, recorded, paths.values()):
        return paths
    write_cpu_model_folder(out_dir / "model", model, max_positions, family=family)
    rows = digit_prompts(n_train + n_val, seed=seed, prompt_len=prompt_len)
    _write_parquet(Path(paths["train"]), rows[:n_train])
    _write_parquet(Path(paths["val"]), rows[n_train:] or rows[:1])
    record_assets(out_dir, recorded)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the CPU PPO demo's model folder and RL parquet files.")
    parser.add_argument("--out", required=True, help="output folder (model/ and data/ are created inside)")
    parser.add_argument("--n-train", type=int, default=256, help="training prompts (default 256)")
    parser.add_argument("--n-val", type=int, default=16, help="validation prompts (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", choices=PPO_MODELS, default="ds4", help="ds4: the full tiny DS4 (default); ds4_proxy: attention-only proxy; ds41: the tiny DeepSeek-V4.1")
    parser.add_argument("--prompt-len", type=int, default=None,
                        help="fill each prompt to about this many tokens with arithmetic text before the instruction")
    parser.add_argument("--max-positions", type=int, default=None,
                        help="the model config's max_position_embeddings (default: the tiny model's own)")
    parser.add_argument("--family", choices=("transformers", "native"), default="transformers",
                        help="the model's tensor names: transformers' (default) or DeepSeek's native ones, which "
                             "Megatron-Bridge reads (the production CPU engine; --model ds4 only)")
    args = parser.parse_args(argv)
    paths = write_ppo_assets(args.out, n_train=args.n_train, n_val=args.n_val, seed=args.seed, model=args.model,
                             prompt_len=args.prompt_len, max_positions=args.max_positions, family=args.family)
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
