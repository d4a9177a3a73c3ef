"""``verl-ds4 verify --hf-checkpoint DIR [--cp N]``: our Megatron DS4 against transformers at fp64.

Loads ``DIR`` twice: into our Megatron DS4 (:func:`verl_ds4.models.ds4.hf_check.hf_logits`, on ``N`` gloo
ranks, packed THD with the contiguous layout) and into transformers' ``DeepseekV4ForCausalLM``
(fp64, its float32 steps promoted, top-k under the DS4 tie rule: equal scores in index order).
Both score the same random sequences (ragged lengths that straddle the CP rank boundaries); the
max relative errors of logits and per-token log-probs are printed, and the exit code is 1 when
either exceeds the tolerance.
"""

from __future__ import annotations

import time

import torch

__all__ = ["compare_with_transformers", "default_lengths"]


def default_lengths(cp: int, min_rows: int) -> list[int]:
    """Ragged lengths: one longer than a rank's share, one short, one odd-sized in between."""
    total = max(cp, 1) * max(min_rows, 8) * 2
    return [total // 2 + 3, 5, total // 3 + 1, 11]


def compare_with_transformers(folder, cp: int = 1, lengths: list[int] | None = None, seed: int = 1234, allow_mtp_skip: bool = False) -> dict:
    """``{"logits": max rel, "log_probs": max rel, "lengths": [...], "seconds": s}`` for ``folder`` at ``cp``."""
    from transformers import DeepseekV4ForCausalLM

    from verl_ds4.models.ds4 import hf_logits
    from verl_ds4.models.ds4.hf_checkpoint import read_config
    from verl_ds4.models.ds4.hf_reference import fp64_reference, hf_model_logits

    start = time.perf_counter()
    config = read_config(folder)
    if lengths is None:
        lengths = default_lengths(cp, int(config.get("sliding_window", 128)))
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, int(config["vocab_size"]), (n,), generator=gen) for n in lengths]
    ours = hf_logits(folder, seqs, cp=cp, allow_mtp_skip=allow_mtp_skip)
    with fp64_reference():  # built under it so that its rotary tables are computed in fp64 too
        reference = DeepseekV4ForCausalLM.from_pretrained(
            folder, dtype=torch.float64, experts_implementation="eager", attn_implementation="eager"
        ).double().eval()  # from_pretrained keeps its _keep_in_fp32_modules in float32: cast them too
        ref = hf_model_logits(reference, seqs)

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    def logp(x, s):
        return torch.log_softmax(x[:-1], -1).gather(-1, s[1:].view(-1, 1))

    pairs = [(a, b, s) for a, b, s in zip(ours, ref, seqs) if s.numel() > 1]
    return {
        "logits": max(rel(a, b) for a, b, _ in pairs),
        "log_probs": max(rel(logp(a, s), logp(b, s)) for a, b, s in pairs),
        "lengths": lengths,
        "seconds": time.perf_counter() - start,
    }
