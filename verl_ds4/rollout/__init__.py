"""Rollouts verl-ds4 adds to verl's v1 trainer.

``cpu_demo`` (:mod:`verl_ds4.rollout.cpu`): a CPU test/demo rollout (serial sampling from the
actor's own Megatron model, weight sync every step), for the CPU PPO recipe and tests. It refuses
to run where CUDA devices are visible.

verl finds a rollout by name in two registries; :func:`register` fills both:

* ``verl.workers.rollout.base._ROLLOUT_REGISTRY[(name, "async")]`` -> the per-rank ``BaseRollout``
  adapter (dotted path, imported lazily by verl);
* ``verl.workers.rollout.replica.RolloutReplicaRegistry.register(name, loader)`` -> the replica
  that starts the server actors.

Both live in module globals, so every process that resolves the name (the trainer, the agent-loop
workers, the actor workers) must have registered it. Importing this package registers
(cheap: neither Megatron nor the model is imported); the CPU launcher loads it in every process
with ``VERL_USE_EXTERNAL_MODULES=...,verl_ds4.rollout``, which verl imports on ``import verl``.
"""

from __future__ import annotations

ROLLOUT_NAME = "cpu_demo"
ADAPTER_PATH = "verl_ds4.rollout.cpu.CPUServerAdapter"
#: verl agent-loop name of :class:`verl_ds4.rollout.agent_loop.SeededSingleTurnAgentLoop` (one seed per response).
SEEDED_AGENT_LOOP = "ds4_seeded_single_turn"

__all__ = ["ADAPTER_PATH", "ROLLOUT_NAME", "SEEDED_AGENT_LOOP", "register", "is_registered"]


def _load_replica():
    from verl_ds4.rollout.cpu import CPURolloutReplica

    return CPURolloutReplica


def register() -> None:
    """Make ``rollout.name=cpu_demo`` resolvable by verl in this process (idempotent).

    A different rollout already registered under the name is an error, not replaced.
    """
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    key = (ROLLOUT_NAME, "async")
    existing = _ROLLOUT_REGISTRY.get(key)
    if existing is not None and existing != ADAPTER_PATH:
        raise RuntimeError(
            f"verl's rollout registry already maps {key} to {existing!r}; verl-ds4 will not replace it with "
            f"{ADAPTER_PATH!r}."
        )
    loader = RolloutReplicaRegistry._registry.get(ROLLOUT_NAME)
    if loader is not None and loader is not _load_replica:
        raise RuntimeError(f"verl's RolloutReplicaRegistry already has a rollout named {ROLLOUT_NAME!r}.")
    _ROLLOUT_REGISTRY[key] = ADAPTER_PATH
    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)


def is_registered() -> bool:
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    return (
        _ROLLOUT_REGISTRY.get((ROLLOUT_NAME, "async")) == ADAPTER_PATH
        and RolloutReplicaRegistry._registry.get(ROLLOUT_NAME) is _load_replica
    )


register()
