"""Mean reward of an HF DS4 (or DeepSeek-V4.1) folder on the CPU RL task, sampled the way the cpu_demo rollout samples.

The learning benchmark (``benchmarks/bench_rl_learning.sh``) uses it to say where RL starts: the
SFT hand-over's reward before any RL step (and to pick an SFT length that leaves room for RL).
Prompts are rendered with verl's DS4 encoder (what the agent loop feeds the rollout), responses are
sampled at temperature 1 with the same sampler as ``verl_ds4.rollout.cpu``, stop at an EOS id of
the folder's generation config, are decoded without special tokens and scored by
``verl_ds4.rollout.demo_task.compute_score``.

    python benchmarks/rl_task_reward.py --model runs/rl_learning/sft_hf [--prompts 64] [--max-tokens 8]
    python benchmarks/rl_task_reward.py --model A --model B ...      # several folders, one line each
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _eval_on_rank(rank: int, world: int, folders: list[str], n_prompts: int, max_tokens: int, seed: int, show: int):
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from verl.utils.tokenizer.deepseek import encode_messages

    from verl_ds4.models.ds41.hf_config import register_auto_config
    from verl_ds4.rollout.cpu import sample_next_token
    from verl_ds4.rollout.demo_task import DATA_SOURCE, compute_score, digit_prompts
    from verl_ds4.rollout.policy import MegatronCPUPolicy

    register_auto_config()  # a V4.1 folder: transformers has no deepseek_v41
    rows = digit_prompts(n_prompts, seed=seed + 1000)
    out = []
    for folder in folders:
        hf_config = AutoConfig.from_pretrained(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        eos = {int(tokenizer.eos_token_id)}
        try:
            gen = GenerationConfig.from_pretrained(folder).eos_token_id
            eos |= set(gen if isinstance(gen, list) else [gen])
        except OSError:
            pass
        policy = MegatronCPUPolicy(hf_config)
        generator = torch.Generator().manual_seed(seed)
        scores, examples = [], []
        for row in rows:
            text = encode_messages(row["prompt"], add_generation_prompt=True, add_bos_token=True)
            prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
            tokens: list[int] = []
            for _ in range(max_tokens):
                token, _ = sample_next_token(policy.next_token_logits(prompt + tokens), 1.0, -1, 1.0, generator)
                tokens.append(token)
                if token in eos:
                    break
            response = tokenizer.decode(tokens, skip_special_tokens=True)
            truth = row["reward_model"]["ground_truth"]
            scores.append(compute_score(DATA_SOURCE, response, truth))
            if len(examples) < show:
                examples.append(f"{truth} -> {response!r}")
        out.append({"model": folder, "prompts": len(rows), "mean_reward": sum(scores) / len(scores), "examples": examples})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, help="an HF DS4 folder (repeatable)")
    parser.add_argument("--prompts", type=int, default=64, help="prompts sampled (default 64)")
    parser.add_argument("--max-tokens", type=int, default=8, help="response tokens at most (default 8, the benchmark's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=4, help="example responses printed per model")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    from verl_ds4.mcore.distributed import run_distributed

    [results] = run_distributed(_eval_on_rank, world_size=1, args=(args.model, args.prompts, args.max_tokens, args.seed, args.show),
                                timeout=1800)
    for r in results:
        print(f"{r['model']}: mean reward {r['mean_reward']:.3f} over {r['prompts']} prompts; e.g. {'; '.join(r['examples'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
