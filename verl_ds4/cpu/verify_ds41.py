"""``verl-ds4 verify --model ds41 --cp N``: the tiny DeepSeek-V4.1 in Megatron-Core against NeMo Automodel.

Builds NeMo Automodel 0.7.0's ``DeepseekV41ForCausalLM`` (the reference, installed without its
dependencies: ``docs/ds41-model.md``) as the random tiny V4.1 of
:func:`verl_ds4.models.ds41.reference.tiny_text_config` (every component on: window-only, ratio-2 and
ratio-1 layers, Full / Reindex / Reuse, the two-level indexer, Engram on a local tokenizer), copies
its weights into our Megatron-Core :class:`~verl_ds4.models.ds41.mcore_model.DS41MegatronModel`, and
scores the same ragged sequences: ours packed THD with the contiguous layout on ``N`` gloo ranks
(:func:`verl_ds4.models.ds4.hf_check.run_on_cp_ranks`), the reference one sequence per forward at
fp64. Prints the max relative errors of logits and per-token log-probs at CP = 1 and CP = N; exit
code 1 above the tolerance, 2 when the reference is not installed.
"""

from __future__ import annotations

import time

import torch

__all__ = ["compare_with_nemo"]


class _Builder:
    def __init__(self, text: dict, state_dict: dict, table: list[int]):
        self.text, self.state_dict, self.table = text, state_dict, table

    def __call__(self, cp_size: int):
        from verl_ds4.models.ds41.mcore_model import DS41MegatronModel, ds41_transformer_config

        model = DS41MegatronModel(ds41_transformer_config(self.text, torch.float64, cp_size), self.table)
        missing, unexpected = model.load_state_dict(self.state_dict, strict=False)
        bad = [k for k in missing if not k.endswith("_extra_state")] + list(unexpected)
        if bad:
            raise RuntimeError(f"verify --model ds41: the weights do not fit the Megatron model: {bad[:5]}")
        return model.eval()


def compare_with_nemo(cp: int, seed: int = 1234, lengths: list[int] | None = None, timeout: float = 600.0) -> dict:
    """``{"cp<k>": {"logits": rel, "log_probs": rel}, ..., "lengths": [...], "seconds": s}`` for CP 1 and ``cp``."""
    from verl_ds4.models.ds4.hf_check import run_on_cp_ranks
    from verl_ds4.models.ds41 import reference as ref
    from verl_ds4.models.ds41.engram import engram_token_map
    from verl_ds4.models.ds41.model import DS41Model

    start = time.perf_counter()
    text = ref.tiny_text_config()
    with ref.fp64_reference():
        theirs = ref.build_reference_model(text, seed=seed)
    table = engram_token_map(ref.local_tokenizer())[0]
    ours = DS41Model(text, table, dtype=torch.float64)
    ref.copy_reference_weights(ours, theirs)
    if lengths is None:
        share = 2 * max(cp, 1) * 8
        lengths = [share + 3, 5, share // 2 + 1, 11]
    gen = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, text["vocab_size"], (n,), generator=gen) for n in lengths]
    with ref.fp64_reference(), torch.no_grad():
        expected = [theirs(s.view(1, -1)).logits[0] for s in sequences]

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    def logp(x, s):
        return torch.log_softmax(x[:-1], -1).gather(-1, s[1:].view(-1, 1))

    result: dict = {"lengths": lengths}
    build = _Builder(text, ours.state_dict(), table)
    for size in sorted({1, cp}):
        got = run_on_cp_ranks(build, sequences, size, timeout=timeout)
        result[f"cp{size}"] = {
            "logits": max(rel(a, b) for a, b in zip(got, expected)),
            "log_probs": max(rel(logp(a, s), logp(b, s)) for a, b, s in zip(got, expected, sequences)),
        }
    result["seconds"] = time.perf_counter() - start
    return result
