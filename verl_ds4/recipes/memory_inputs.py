"""Each role's passes as verl runs them: the rows a GPU holds per micro-batch, read per pass from its own settings.

A pass with ``use_dynamic_bsz=true`` holds its token budget per GPU; one with ``use_dynamic_bsz=false`` holds
``micro_batch_size_per_gpu`` sequences of the longest length, split over CP
(:func:`verl_ds4.memory.micro_batches.static_rows`). Every pass keeps its row whichever way it is batched.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from verl_ds4.memory.micro_batches import static_rows
from verl_ds4.recipes.roles import Problem, _get

__all__ = ["PASS_KEYS", "PassSetting", "pass_settings"]

_ARR = "actor_rollout_ref"
#: Per role and pass: (the dynamic-batch switch, the token budget per GPU, the fixed micro-batch size per GPU).
PASS_KEYS = {
    "sft": {"update": ("data.use_dynamic_bsz", "data.max_token_len_per_gpu", "data.micro_batch_size_per_gpu")},
    "actor": {
        "update": (f"{_ARR}.actor.use_dynamic_bsz", f"{_ARR}.actor.ppo_max_token_len_per_gpu", f"{_ARR}.actor.ppo_micro_batch_size_per_gpu"),
        "forward": (f"{_ARR}.rollout.log_prob_use_dynamic_bsz", f"{_ARR}.rollout.log_prob_max_token_len_per_gpu",
                    f"{_ARR}.rollout.log_prob_micro_batch_size_per_gpu"),
    },
    "ref": {"forward": (f"{_ARR}.ref.log_prob_use_dynamic_bsz", f"{_ARR}.ref.log_prob_max_token_len_per_gpu",
                        f"{_ARR}.ref.log_prob_micro_batch_size_per_gpu")},
    "critic": {
        "update": ("critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu", "critic.ppo_micro_batch_size_per_gpu"),
        "forward": ("critic.use_dynamic_bsz", "critic.forward_max_token_len_per_gpu", "critic.forward_micro_batch_size_per_gpu"),
    },
}


@dataclass(frozen=True)
class PassSetting:
    """One pass's batching: ``tokens`` rows per GPU per micro-batch; ``micro_batch_size`` (None: dynamic) and its key."""

    tokens: int
    micro_batch_size: int | None = None
    key: str | None = None


def pass_settings(cfg: DictConfig, role: str, max_seq_len: int, cp: int, problems: list[Problem]) -> dict[str, PassSetting]:
    """The role's passes (``update`` and / or ``forward``) with the rows a GPU holds in each."""
    out = {}
    for name, (switch, budget, size_key) in PASS_KEYS.get(role, {}).items():
        if bool(_get(cfg, switch, False)):
            value = _get(cfg, budget)
            out[name] = PassSetting(int(value) if value is not None else max_seq_len)
            continue
        size = _get(cfg, size_key)
        if size is None or int(size) < 1:
            problems.append(Problem(size_key, f"is {size!r} with {switch}=false; expected the sequences per micro-batch per GPU "
                                    "(a positive integer), which sets the rows each GPU holds.",
                                    f"set {size_key} (e.g. 1) or {switch}=true with {budget}."))
            size = 1
        out[name] = PassSetting(static_rows(int(size), max_seq_len, cp), int(size), size_key)
    return out
