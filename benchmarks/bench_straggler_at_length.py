"""Straggler ratios of GRPO updates at length: verl's DP balancing and dynamic batching, then each CP layout.

Each step draws one GRPO batch (``--prompts`` prompts x ``--n`` responses), then runs what verl 0.9.1 runs:

1. DP split: verl's own ``RayPPOTrainer._balance_batch`` (``trainer.balance_batch=True``, the default),
   called with a stand-in ``self`` that only answers the DP size; each DP rank gets its equal chunk;
2. micro-batches: verl's ``rearrange_micro_batches`` on every DP rank (``use_dynamic_bsz``; a budget of
   ``--tokens-per-gpu`` x CP tokens, the engine's ``max_token_len_per_gpu * sp_size``). verl agrees on one
   micro-batch count across DP ranks with an all-reduce; here the count is raised on every rank to the
   largest any rank needs (``min_num_micro_batch``) until they agree, which is what the all-reduce gives;
3. per micro-batch, the CP layout of its sequences (verl's order inside the micro-batch) in three ways:
   ``batch order`` (contiguous, the order verl hands over: the engine with ``cp_balance=null``),
   ``balanced`` (contiguous, ``cp_balance``: ``verl_ds4.layout.balance``) and ``zigzag`` (every sequence
   cut into 2 CP chunks; DS4 cannot use it, shown as the reference for dense attention),
   with the ``min_local_rows=128`` DS4 padding for the contiguous ones.

Ratios (``verl_ds4/layout/straggler.py``, what the engine reports per step as ``actor/perf/...``):

* ``cp``: ``sum_m max_r c[m, r] / sum_m mean_r c[m, r]`` over one DP rank's micro-batches (the CP group's
  time for the update over the balanced time), averaged over DP ranks: ``perf/cp_straggler_ratio``;
* ``worst mb``: the worst micro-batch's max / mean: ``perf/cp_straggler_ratio_max``;
* ``dp``: the most loaded DP rank's total sequence cost over the mean: ``perf/dp_straggler_ratio``;
* ``step``: the slowest DP rank's ``sum_m max_r c[m, r]`` over the whole batch's cost / (DP x CP): the
  update's time over a perfect split of the same work over every GPU (CP and DP waiting together).

Length mixes (seeded; one prompt length per GRPO group, ``--max-seq-len`` the longest sequence):

* ``longtail``: prompts log-uniform in [1k, 8k]; responses log-normal (median 4k, sigma 1), at least 1k,
  cut at ``max-seq-len - prompt`` (the truncated responses pile up at the cap, as in RL at a length limit);
* ``uniform``: prompts uniform in [1k, 8k]; responses uniform in [1k, max-seq-len - prompt].

Cost models (``verl_ds4/layout/cost.py``, the balancer's): ``ds4`` = DS4-Flash per token (linear/MoE +
window + CSA top-k + indexer p/4 + HCA p/128, unit: one token's position-independent compute), ``dense``
= dense causal attention only (p + 1 keys per token, no linear term).

    python benchmarks/bench_straggler_at_length.py [--steps 50] [--cp 8 16] [--mixes longtail uniform]
        [--models ds4 dense] [--prompts 16] [--n 8] [--dp 2] [--max-seq-len 65536] [--tokens-per-gpu N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

from verl_ds4.layout import PlanOptions
from verl_ds4.layout.balance import BalanceProblem, balanced_host_order
from verl_ds4.layout.cost import dense_causal_cost_model, ds4_cost_model
from verl_ds4.layout.straggler import StepStraggler, dp_rank_costs, ratio, zigzag_rank_costs

MODELS = {"ds4": ds4_cost_model, "dense": dense_causal_cost_model}
LAYOUTS = ("batch order", "balanced", "zigzag")
MIN_LOCAL_ROWS = 128  # DS4's window: the contiguous buffer's minimum rows per rank


def draw_batch(mix: str, rng: np.random.Generator, prompts: int, n: int, max_len: int) -> np.ndarray:
    """``prompts * n`` sequence lengths (prompt + response), grouped by prompt."""
    lo, hi = 1024, 8192
    if mix == "longtail":
        prompt = np.exp(rng.uniform(np.log(lo), np.log(hi), prompts)).astype(np.int64)
        resp = np.exp(rng.normal(np.log(4096), 1.0, (prompts, n)))
    elif mix == "uniform":
        prompt = rng.integers(lo, hi + 1, prompts)
        resp = rng.uniform(0.0, 1.0, (prompts, n)) * (max_len - prompt[:, None] - lo) + lo
    else:
        raise ValueError(mix)
    resp = np.clip(resp.astype(np.int64), lo, (max_len - prompt)[:, None])
    return (prompt[:, None] + resp).reshape(-1)


def dp_split(lengths: np.ndarray, dp: int) -> list[np.ndarray]:
    """verl's ``_balance_batch`` reorder, then the dispatcher's equal chunks: each DP rank's lengths."""
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    mask = torch.arange(int(lengths.max()))[None, :] < torch.from_numpy(lengths)[:, None]
    batch = DataProto.from_single_dict({"attention_mask": mask})
    stand_in = SimpleNamespace(actor_rollout_wg=None, _get_dp_size=lambda wg, role: dp)
    metrics: dict = {}
    RayPPOTrainer._balance_batch(stand_in, batch, metrics=metrics)
    ordered = batch.batch["attention_mask"].sum(-1).numpy()
    return list(ordered.reshape(dp, -1))


def micro_batches(per_rank: list[np.ndarray], max_token_len: int) -> list[list[np.ndarray]]:
    """verl's ``rearrange_micro_batches`` on every DP rank with one micro-batch count (see the docstring)."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    batches = []
    for lengths in per_rank:
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]))
        ids = torch.nested.nested_tensor_from_jagged(torch.zeros(int(offsets[-1]), dtype=torch.uint8), offsets)
        batches.append(tu.get_tensordict(tensor_dict={"input_ids": ids}))
    count = None
    while True:
        out = [rearrange_micro_batches(b, max_token_len=max_token_len, min_num_micro_batch=count)[0] for b in batches]
        counts = {len(mbs) for mbs in out}
        if len(counts) == 1:
            return [[mb["input_ids"].offsets().diff().numpy() for mb in mbs] for mbs in out]
        count = max(counts)


def rank_costs(lengths: np.ndarray, cp: int, layout: str, model, planning: list) -> np.ndarray:
    if layout == "zigzag":
        options = PlanOptions("zigzag", cp_size=cp)
        padded = lengths + (-lengths) % options.sequence_alignment
        return zigzag_rank_costs(lengths, padded, cp, model)
    options = PlanOptions("contiguous", cp_size=cp, min_local_rows=MIN_LOCAL_ROWS)
    prob = BalanceProblem.from_options(lengths, options, model)
    order = np.arange(prob.num_seqs, dtype=np.int64)
    if layout == "balanced":
        start = time.thread_time()
        order = balanced_host_order(lengths, PlanOptions("contiguous", cp_size=cp, min_local_rows=MIN_LOCAL_ROWS,
                                                         balance=model))
        planning.append(time.thread_time() - start)
    return prob.costs_np(order[None, :])[0]


def stats(values) -> str:
    v = np.asarray(values)
    return f"{v.mean():6.3f} {np.percentile(v, 95):6.3f} {v.max():6.3f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--cp", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--mixes", nargs="+", default=["longtail", "uniform"])
    ap.add_argument("--models", nargs="+", default=["ds4", "dense"])
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step (one update: the mini-batch)")
    ap.add_argument("--n", type=int, default=8, help="responses per prompt (GRPO group)")
    ap.add_argument("--dp", type=int, default=2, help="data-parallel ranks")
    ap.add_argument("--max-seq-len", type=int, default=65536)
    ap.add_argument("--tokens-per-gpu", type=int, default=None,
                    help="max_token_len_per_gpu (default: the recipes' 4096, raised to ceil(max-seq-len / CP) as "
                         "ds4.max_seq_len does)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"GRPO steps: {args.steps} x ({args.prompts} prompts x {args.n} responses), DP {args.dp}, "
          f"longest sequence {args.max_seq_len}; ratios: mean p95 max over steps")
    hdr = (f"{'mix':8} {'model':5} {'cp':>3} {'budget':>6} {'mb/rank':>7} | {'layout':11} | {'cp: mean p95 max':>20} | "
           f"{'worst mb: mean p95 max':>22} | {'step: mean p95 max':>20}")
    print(hdr)
    print("-" * len(hdr))
    dp_lines, plan_lines = [], []
    for mix in args.mixes:
        for cp in args.cp:
            budget = args.tokens_per_gpu or max(4096, -(-args.max_seq_len // cp))
            rng = np.random.default_rng(args.seed)
            steps = []
            for _ in range(args.steps):
                per_rank = dp_split(draw_batch(mix, rng, args.prompts, args.n, args.max_seq_len), args.dp)
                steps.append((per_rank, micro_batches(per_rank, budget * cp)))
            n_mb = np.mean([len(mbs[0]) for _, mbs in steps])
            for name in args.models:
                model = MODELS[name]()
                dp_ratios = [ratio(dp_rank_costs(np.concatenate(r), args.dp, model)) for r, _ in steps]
                dp_lines.append(f"{mix:8} {name:5} {cp:3d} | dp: {stats(dp_ratios)}")
                planning: list = []
                for layout in LAYOUTS:
                    cp_r, worst, step_r = [], [], []
                    for per_rank, mbs in steps:
                        ranks = []
                        for rank_mbs in mbs:
                            step = StepStraggler(model)
                            for lengths in rank_mbs:
                                step.add_costs(rank_costs(lengths, cp, layout, model, planning))
                            ranks.append(step)
                        cp_r.append(np.mean([s.cp_ratio() for s in ranks]))
                        worst.append(max(s.worst_micro_batch() for s in ranks))
                        total = sum(float(model.prefix_cost(r).sum()) for r in per_rank)
                        step_r.append(max(sum(s.max_costs) for s in ranks) / (total / (args.dp * cp)))
                    print(f"{mix:8} {name:5} {cp:3d} {budget:6d} {n_mb:7.1f} | {layout:11} | {stats(cp_r):>20} | "
                          f"{stats(worst):>22} | {stats(step_r):>20}", flush=True)
                ms = np.asarray(planning) * 1e3
                plan_lines.append(f"{mix:8} {name:5} {cp:3d} | balancer CPU ms per micro-batch: mean {ms.mean():.1f}, "
                                  f"p95 {np.percentile(ms, 95):.1f}, max {ms.max():.1f}")
    print()
    print("DP straggler ratio (most loaded DP rank's total sequence cost / mean; verl's _balance_batch balances")
    print("tokens + seqlen^2/24576, not the cost model), mean p95 max over steps:")
    print("\n".join(dp_lines))
    print()
    print("\n".join(plan_lines))
    print(f"machine load average while measuring: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
