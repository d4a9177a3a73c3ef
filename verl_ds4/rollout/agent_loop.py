"""A single-turn agent loop whose requests each get their own deterministic id (and so their own sampling seed).

Why: under ``actor_rollout_ref.rollout.full_determinism=true`` verl's ``single_turn_agent`` names a request
``det-<priority>``. verl's v0 agent-loop manager numbers the batch's samples as priorities, but the v1
trainer's TransferQueue agent loop (``verl/trainer/ppo/v1/agent_loop_tq.py``) passes none, so every request of
every step is ``det-0``. The ``cpu_demo`` rollout seeds each request from its id (and the weight version,
:func:`verl_ds4.rollout.cpu.request_seed`), so all the responses of a step were sampled with the same random
numbers: a GRPO group's responses to one prompt were identical (every group-relative advantage 0, no policy
gradient: measured ``critic/advantages/{min,max} = 0`` on every step of a 60-step GRPO run), and PPO's
prompts, which differ in one digit, mostly got the same response.

:class:`SeededSingleTurnAgentLoop` is verl's ``single_turn_agent`` with one change: it hands verl the
priority ``index * n + session_id`` (the dataset row's ``extra_info.index``, the response's place in its
group, ``n`` the larger of ``rollout.n`` and ``rollout.val_kwargs.n``), so the request id is ``det-<that>``:
distinct for every response of a step, and the same for the same row and response in a resumed run. It is
registered with verl's agent-loop registry as :data:`verl_ds4.rollout.SEEDED_AGENT_LOOP`; the CPU recipes select it
(``actor_rollout_ref.rollout.agent.default_agent_loop``) and list this module in
``VERL_USE_EXTERNAL_MODULES`` (the agent-loop workers resolve the name in their own process).

A row without an integer ``extra_info.index`` (verl's dataset then uses 0 for every row) is refused with
the fix, since two rows would share ids.
"""

from __future__ import annotations

import operator
from typing import Any, Mapping

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

from verl_ds4.mcore import indexer_replay
from verl_ds4.rollout import SEEDED_AGENT_LOOP

__all__ = ["IndexerAgentLoopOutput", "SeededSingleTurnAgentLoop", "request_priority"]


class IndexerAgentLoopOutput(AgentLoopOutput):
    """verl's agent-loop output plus the rollout's indexer choices, put in the batch as the tensor field
    ``indexer_topk`` ``[prompt + response tokens, layers, index_topk]`` (rows the rollout never ran, the
    last token's, are ``NOT_RECORDED``), beside verl's ``routed_experts`` (:mod:`verl_ds4.mcore.indexer_replay`)."""

    indexer_topk: Any = None

    def as_dict(self) -> dict[str, Any]:
        output = super().as_dict()
        rows = output.pop(indexer_replay.FIELD, None)
        if rows is not None:  # one row per token of prompt + response (the recorded ones, then NOT_RECORDED)
            tokens = sum(output[part].size(0) for part in ("prompts", "responses"))
            output[indexer_replay.FIELD] = indexer_replay.fill_rows(rows, tokens)
        return output


def with_indexer_choices(output: AgentLoopOutput) -> AgentLoopOutput:
    """Move the CPU rollout's ``extra_fields['indexer_topk']`` into :class:`IndexerAgentLoopOutput`'s tensor field."""
    if not isinstance(output, AgentLoopOutput):  # (verl's single-turn loop returns one output; leave others alone)
        return output
    rows = output.extra_fields.pop(indexer_replay.FIELD, None)
    if rows is None:
        return output
    fields = {name: getattr(output, name) for name in output.model_fields_set}
    return IndexerAgentLoopOutput(**fields, indexer_topk=rows)


def request_priority(extra_info: Mapping[str, Any] | None, session_id: Any, group_size: int) -> int:
    """``index * group_size + session_id``: one integer per (dataset row, response of its group)."""
    raw = (extra_info or {}).get("index")
    try:
        index = None if isinstance(raw, bool) else operator.index(raw)  # int, NumPy integers
    except TypeError:
        index = None
    if index is None:
        raise ValueError(
            f"{SEEDED_AGENT_LOOP}: the prompt row has extra_info.index={raw!r}; expected the row's integer index "
            "in the dataset (verl's RL parquet convention, e.g. extra_info={'index': 17}). Without it every row's "
            "requests would share one sampling seed. Add the column, or use verl's single_turn_agent "
            "(actor_rollout_ref.rollout.agent.default_agent_loop=single_turn_agent) with full_determinism=false."
        )
    session = int(session_id)
    if index < 0 or not 0 <= session < group_size:
        raise ValueError(
            f"{SEEDED_AGENT_LOOP}: extra_info.index={index} must be >= 0 and session_id={session} in [0, {group_size})."
        )
    return index * group_size + session


class SeededSingleTurnAgentLoop(SingleTurnAgentLoop):
    """verl's ``single_turn_agent`` with a distinct deterministic request id per response (module docstring)."""

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs) -> Any:
        rollout = self.rollout_config
        val_n = getattr(getattr(rollout, "val_kwargs", None), "n", 1) or 1
        group_size = max(int(rollout.n or 1), int(val_n))
        priority = request_priority(kwargs.get("extra_info"), kwargs.get("session_id", 0), group_size)
        return with_indexer_choices(await super().run(sampling_params, priority=priority, **kwargs))


register(SEEDED_AGENT_LOOP)(SeededSingleTurnAgentLoop)
