"""The longest sequence as one recipe input: ``ds4.max_seq_len`` and the lengths derived from it.

verl's trainers read several lengths that must agree: SFT's ``data.max_length``; RL's
``data.max_prompt_length`` + ``data.max_response_length``, the rollout engine's
``actor_rollout_ref.rollout.max_model_len`` (vLLM refuses a prompt + response longer than it) and the token
budgets (``ds4.max_token_len_per_gpu`` x CP must hold one whole sequence: verl never splits one). Set
``ds4.max_seq_len=N`` and :func:`derived_overrides` writes them as Hydra overrides that
:func:`verl_ds4.recipes.compose.compose_recipe` (``verl-ds4 recipe``, the launchers) appends to the user's:

- SFT: ``data.max_length = N``;
- RL: ``data.max_prompt_length = min(N // 4, 8192)`` and ``data.max_response_length = N - prompt``
  (a quarter of the length for the prompt, at most 8,192 tokens; the rest is the response). A prompt or a
  response length the user sets is kept and the other one is ``N`` less it;
  ``actor_rollout_ref.rollout.max_model_len = N``;
- both: ``ds4.max_token_len_per_gpu`` (and RL's ``ds4.infer_max_token_len_per_gpu``) raised to
  ``ceil(N / CP)`` when the mesh's budget x CP is shorter than ``N``; the memory check then judges the peak.

The CP is derived first when the user sets none (:mod:`verl_ds4.recipes.seq_cp`: the mesh's CP size that holds
``N`` at peak), and the budgets follow it. A key the user sets on the command line is never replaced; :func:`check_lengths` refuses one that does not
fit ``N`` (and ``N`` above the model's ``max_position_embeddings``). ``ds4.max_seq_len=null`` (the default)
derives nothing: the recipe's own lengths stand (SFT 4,096; RL 1,024 + 2,048).
"""

from __future__ import annotations

from typing import Any

from verl_ds4.recipes.roles import Problem, _get

KNOB = "ds4.max_seq_len"
#: the prompt's share of the length and its cap (RL): prompt = min(N // PROMPT_DIVISOR, PROMPT_CAP)
PROMPT_DIVISOR = 4
PROMPT_CAP = 8192
MAX_MODEL_LEN = "actor_rollout_ref.rollout.max_model_len"


def explicit_keys(overrides: list[str] | tuple[str, ...]) -> set[str]:
    """The config keys a Hydra override list sets (``key=value``, ``+key=``, ``++key=``)."""
    keys = set()
    for o in overrides:
        if "=" in o and not o.startswith("~"):
            keys.add(o.split("=", 1)[0].lstrip("+"))
    return keys


def split_lengths(n: int, prompt: int | None = None, response: int | None = None) -> tuple[int, int]:
    """(prompt, response) for the longest sequence ``n``; a given one is kept, the other is what is left."""
    if prompt is None and response is None:
        prompt = min(n // PROMPT_DIVISOR, PROMPT_CAP)
    if prompt is None:
        return n - int(response), int(response)
    return int(prompt), n - int(prompt) if response is None else int(response)


def max_seq_len_of(cfg: Any) -> int | None:
    """``ds4.max_seq_len`` as an int, or None when unset."""
    value = _get(cfg, KNOB)
    return None if value is None else int(value)


def derived_overrides(cfg: Any, trainer: str, overrides: list[str] | tuple[str, ...]) -> list[str]:
    """Overrides that make a composed ``cfg`` agree with its ``ds4.max_seq_len`` (empty when it is unset).

    ``trainer``: ``"sft"`` or ``"ppo"``. Keys in ``overrides`` (the user's) are left alone.
    """
    n = max_seq_len_of(cfg)
    if n is None or n < 1:
        return []
    user = explicit_keys(overrides)
    out: list[str] = []
    if trainer == "sft":
        if "data.max_length" not in user:
            out.append(f"data.max_length={n}")
    else:
        p_key, r_key = "data.max_prompt_length", "data.max_response_length"
        prompt = int(_get(cfg, p_key)) if p_key in user else None
        response = int(_get(cfg, r_key)) if r_key in user else None
        if prompt is None or response is None:
            p, r = split_lengths(n, prompt, response)
            if p >= 1 and r >= 1:  # a user's length of N or more: check_lengths refuses it
                out += [f"{p_key}={p}"] if prompt is None else []
                out += [f"{r_key}={r}"] if response is None else []
        if MAX_MODEL_LEN not in user:
            out.append(f"{MAX_MODEL_LEN}={n}")
    cp = max(int(_get(cfg, "ds4.mesh.cp") or 1), 1)  # the mesh always names it; 1 for a bare test config
    need = -(-n // cp)
    budgets = ["ds4.max_token_len_per_gpu"] + ([] if trainer == "sft" else ["ds4.infer_max_token_len_per_gpu"])
    for key in budgets:
        value = _get(cfg, key)
        if key not in user and value is not None and int(value) < need:
            out.append(f"{key}={need}")
    return out


def longest_sequence(cfg: Any, trainer: str) -> int:
    """The longest sequence the recipe trains: ``ds4.max_seq_len`` when set, else the data lengths'."""
    n = max_seq_len_of(cfg)
    if n is not None:
        return n
    if trainer == "sft":
        return int(_get(cfg, "data.max_length", 0))
    return int(_get(cfg, "data.max_prompt_length", 0)) + int(_get(cfg, "data.max_response_length", 0))


def check_lengths(cfg: Any, trainer: str, max_position_embeddings: int | None, source: str) -> list[Problem]:
    """Refusals: lengths that do not fit ``ds4.max_seq_len``, vLLM's ``max_model_len`` below prompt + response,
    and a length above the model's ``max_position_embeddings`` (``source``: where that number was read)."""
    problems: list[Problem] = []
    n = max_seq_len_of(cfg)
    if n is not None and n < 1:
        return [Problem(KNOB, f"is {n}; expected a positive number of tokens (or null for the recipe's lengths).",
                        f"set {KNOB}=<tokens>, e.g. {KNOB}=32768, or {KNOB}=null.")]
    if trainer == "sft":
        length = int(_get(cfg, "data.max_length", 0))
        if n is not None and length > n:
            problems.append(Problem("data.max_length", f"is {length}, longer than {KNOB}={n}, the longest sequence.",
                                    f"drop data.max_length (it is derived from {KNOB}) or set it <= {n}, or raise {KNOB}."))
    else:
        prompt, response = int(_get(cfg, "data.max_prompt_length", 0)), int(_get(cfg, "data.max_response_length", 0))
        if n is not None and prompt + response > n:
            problems.append(Problem(
                "data.max_prompt_length + data.max_response_length",
                f"are {prompt} + {response} = {prompt + response}, longer than {KNOB}={n}, the longest sequence.",
                f"set at most one of them (the other is derived as {n} less it) with a sum <= {n}, or raise {KNOB}."))
        model_len = _get(cfg, MAX_MODEL_LEN)
        if model_len is not None and int(model_len) < prompt + response:
            problems.append(Problem(
                MAX_MODEL_LEN, f"is {int(model_len)}, shorter than data.max_prompt_length + data.max_response_length = "
                f"{prompt + response}: vLLM would refuse the longest rollouts.",
                f"drop it (with {KNOB} set it is derived) or set it >= {prompt + response}."))
    longest = longest_sequence(cfg, trainer)
    if max_position_embeddings and longest > max_position_embeddings:
        setting = KNOB if n is not None else ("data.max_length" if trainer == "sft" else "data.max_prompt_length + data.max_response_length")
        problems.append(Problem(
            setting, f"asks for {longest}-token sequences, above the model's max_position_embeddings = "
            f"{max_position_embeddings} ({source}).", f"set {KNOB} <= {max_position_embeddings}."))
    return problems


def describe(cfg: Any, trainer: str) -> str:
    """The plan's length line: the knob and what the trainer reads."""
    n = max_seq_len_of(cfg)
    head = f"{KNOB}={n}" if n is not None else f"{KNOB}=null (the recipe's lengths)"
    if trainer == "sft":
        return f"lengths : {head}: data.max_length {_get(cfg, 'data.max_length')}"
    return (f"lengths : {head}: data.max_prompt_length {_get(cfg, 'data.max_prompt_length')} + data.max_response_length "
            f"{_get(cfg, 'data.max_response_length')}, rollout max_model_len {_get(cfg, MAX_MODEL_LEN)}")
