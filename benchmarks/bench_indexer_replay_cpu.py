"""What rollout indexer replay costs on the CPU: the cpu_demo rollout's decode step and the actor's forward.

A/B in one process, alternating, medians over ``--repeats``: the tiny V4.1 (or DS4) of the CPU RL task,
fp32 as in the run, a batch shaped like one PPO step of ``benchmarks/bench_rl_learning.sh`` (``--seqs``
sequences of ``--prompt`` tokens):

* rollout: one decode step of the whole batch through ``MegatronCPUPolicy`` without recording
  (``next_token_logits_batch``) and with it (``next_token_logits_and_choices``, earlier rows replayed);
* actor: one forward + backward of the batch through the engine forward, native vs replaying the choices.

Each case starts from the same model state: no replay target, not recording (checked before every case; a
target left by the case before would make a "native" case replay it).

Usage: ``python benchmarks/bench_indexer_replay_cpu.py [--model ds41] [--seqs 128] [--prompt 75] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ds41", choices=["ds41", "ds4"])
    parser.add_argument("--seqs", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=75)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)

    import verl_ds4.cpu.ds4_builder  # noqa: F401  (register the models with transformers)
    import verl_ds4.cpu.ds41_builder  # noqa: F401
    from transformers import AutoConfig

    from verl_ds4.cpu.sft_data import prepare_cpu_sft_assets
    from verl_ds4.mcore import batch_plans, indexer_replay, resolver
    from verl_ds4.mcore.model_forward import gptmodel_forward_model_engine
    from verl_ds4.rollout.policy import MegatronCPUPolicy

    folder = prepare_cpu_sft_assets(tempfile.mkdtemp(), model=args.model, n_train=2)["model"]
    policy = MegatronCPUPolicy(AutoConfig.from_pretrained(folder))
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, policy.vocab_size, (args.prompt,), generator=gen).tolist() for _ in range(args.seqs)]
    _, known = policy.next_token_logits_and_choices(seqs, [None] * len(seqs))
    seqs = [s + [5] for s in seqs]  # one decode step later: every row but the last is replayed

    model = policy.model
    for p in model.parameters():
        p.requires_grad_(True)
    model.train()
    resolved = resolver.resolved_for(model)
    offsets = torch.tensor([0, *[len(s) for s in seqs]]).cumsum(0)
    ids = torch.nested.nested_tensor_from_jagged(torch.tensor([t for s in seqs for t in s]), offsets=offsets)
    rows = [indexer_replay.fill_rows(choice, len(seq)) for seq, choice in zip(seqs, known)]
    field = torch.nested.nested_tensor_from_jagged(torch.cat(rows), offsets=offsets)
    replays = [module.indexer_replay for _, module in indexer_replay.selecting_layers(model)]

    def reset() -> None:
        """Every case starts native and not recording (the recording case turns recording on itself)."""
        indexer_replay.clear(model)
        if any(r.target is not None or r.record for r in replays):
            raise RuntimeError("indexer replay state left after clear(): the A/B would be contaminated")

    def train_step(replay: bool) -> None:
        with batch_plans.micro_batch_plans(), indexer_replay.micro_batch_scope() if replay else _null():
            if replay:
                indexer_replay.set_pending(field)
            out = gptmodel_forward_model_engine(model, ids, {}, resolved=resolved)
            out.values().float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)

    cases = {
        "rollout decode step, native": lambda: policy.next_token_logits_batch(seqs),
        "rollout decode step, recording": lambda: policy.next_token_logits_and_choices(seqs, known),
        "actor forward+backward, native": lambda: train_step(False),
        "actor forward+backward, replaying": lambda: train_step(True),
    }
    times = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            reset()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            if name.endswith("native") and any(r.target is not None or r.record for r in replays):
                raise RuntimeError(f"{name}: a replay target or recording was active: not a native forward")
    bytes_per_token = known[0].shape[1] * known[0].shape[2] * 4
    tokens = sum(len(s) for s in seqs)
    print(f"{args.model}: {args.seqs} sequences x {args.prompt + 1} tokens, {known[0].shape[1]} selecting layers x "
          f"index_topk {known[0].shape[2]}: {bytes_per_token} B a token, {bytes_per_token * tokens / 1e6:.2f} MB the batch")
    for name, values in times.items():
        print(f"  {name:36s} median {statistics.median(values) * 1e3:8.1f} ms  (min {min(values) * 1e3:.1f})")


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
