"""The engines a composed recipe builds, with their resolved parallel meshes and token budgets.

:func:`collect_roles` reads the *resolved* config (whatever set a value: a ``ds4.*`` knob, a named
mesh or a direct override) into one :class:`RoleMesh` per engine: the SFT engine, or the actor,
reference model and critic of an RL recipe. :mod:`verl_ds4.recipes.validate` checks them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from verl_ds4.memory.types import Finding


class RecipeValidationError(ValueError):
    """A composed recipe cannot run; ``problems`` lists every reason (setting, what, fix)."""

    def __init__(self, problems: list["Problem"]):
        self.problems = list(problems)
        lines = [f"DS4 recipe validation failed with {len(self.problems)} error(s):"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


#: One finding: the config key it is about, what is wrong, and how to fix it. The memory model's ``Finding``
#: (a lower floor) is the same record, so the validator passes the model's findings on as they are.
Problem = Finding


@dataclass(frozen=True)
class Budget:
    """One per-GPU token budget: its config key, value, and the longest sequence it must hold."""

    key: str
    tokens_per_gpu: int


@dataclass
class RoleMesh:
    """The resolved parallel layout of one engine (SFT engine, actor, reference or critic).

    Attributes:
        role: ``"sft"``, ``"actor"``, ``"ref"`` or ``"critic"``.
        engine_key: config path of the engine block (e.g. ``actor_rollout_ref.actor.megatron``).
        model_key: config path of the model block it reads ``use_remove_padding`` from.
        tp, pp, vpp, cp, ep, etp: parallel sizes (vpp may be None).
        dynamic_cp: whether dynamic context parallelism is on.
        thd: packed THD input (``<model_key>.use_remove_padding``).
        cp_partition_mode: ``override_transformer_config.cp_partition_mode`` (None if unset).
        scheduler: ``override_transformer_config.sequence_packing_scheduler`` (None if unset).
        max_seqlen_per_dp_cp_rank: dynamic-CP per-rank cap.
        budgets: per-GPU token budgets that apply to this engine.
        mtp: whether MTP is enabled on its model.
        cp_balance: the engine's ``cp_balance`` (None: batch order, or the field is absent).
        engine_target: the engine block's ``_target_`` (None if unset).
    """

    role: str
    engine_key: str
    model_key: str
    tp: int
    pp: int
    vpp: int | None
    cp: int
    ep: int
    etp: int
    dynamic_cp: bool
    thd: bool
    cp_partition_mode: str | None
    scheduler: str | None
    max_seqlen_per_dp_cp_rank: int | None
    budgets: list[Budget] = field(default_factory=list)
    mtp: bool = False
    cp_balance: str | None = None
    engine_target: str | None = None

    @property
    def uses_cp(self) -> bool:
        """Whether this engine splits sequences over CP ranks (a static CP > 1, or dynamic CP)."""
        return self.cp > 1 or self.dynamic_cp

    def dp(self, world: int) -> int:
        return world // (self.tp * self.pp * self.cp)

    def expert_dp(self, world: int) -> int:
        return world // (self.pp * self.etp * self.ep)


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    node = cfg
    for part in key.split("."):
        if node is None:
            return default
        if isinstance(node, (DictConfig, dict)):
            node = node.get(part, None)
        else:
            return default
    return default if node is None else node


def _int(node: Any, key: str, where: str, default: Any = 1) -> Any:
    value = node.get(key, default)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise RecipeValidationError(
            [Problem(f"{where}.{key}", f"is {value!r}, not an integer.", "set an integer size.")]
        ) from None


def _role_mesh(cfg: DictConfig, role: str, engine_key: str, model_key: str, budgets: list[Budget]) -> RoleMesh:
    engine = _get(cfg, engine_key)
    if engine is None:
        raise RecipeValidationError(
            [Problem(engine_key, "is missing from the composed config.", "select model_engine=megatron (the recipes do).")]
        )
    otc = engine.get("override_transformer_config") or {}
    vpp = _int(engine, "virtual_pipeline_model_parallel_size", engine_key, None)
    etp = _int(engine, "expert_tensor_parallel_size", engine_key, None)
    tp = _int(engine, "tensor_model_parallel_size", engine_key)
    return RoleMesh(
        role=role,
        engine_key=engine_key,
        model_key=model_key,
        tp=tp,
        pp=_int(engine, "pipeline_model_parallel_size", engine_key),
        vpp=vpp,
        cp=_int(engine, "context_parallel_size", engine_key),
        ep=_int(engine, "expert_model_parallel_size", engine_key),
        # Megatron: expert TP defaults to TP when unset.
        etp=tp if etp is None else etp,
        dynamic_cp=bool(engine.get("dynamic_context_parallel", False)),
        thd=bool(_get(cfg, f"{model_key}.use_remove_padding", False)),
        cp_partition_mode=otc.get("cp_partition_mode"),
        scheduler=otc.get("sequence_packing_scheduler"),
        max_seqlen_per_dp_cp_rank=engine.get("max_seqlen_per_dp_cp_rank"),
        budgets=budgets,
        mtp=bool(_get(cfg, f"{model_key}.mtp.enable", False)),
        cp_balance=engine.get("cp_balance", None),
        engine_target=engine.get("_target_", None),
    )


def _budget(cfg: DictConfig, key: str, enabled_key: str | None) -> list[Budget]:
    if enabled_key is not None and not bool(_get(cfg, enabled_key, False)):
        return []
    value = _get(cfg, key)
    return [] if value is None else [Budget(key, int(value))]


def collect_roles(cfg: DictConfig, trainer: str) -> list[RoleMesh]:
    """The engines a composed config will build, with their resolved meshes and budgets."""
    if trainer == "sft":
        budgets = _budget(cfg, "data.max_token_len_per_gpu", "data.use_dynamic_bsz")
        return [_role_mesh(cfg, "sft", "engine", "model", budgets)]

    from verl.trainer.ppo.utils import need_critic, need_reference_policy

    arr = "actor_rollout_ref"
    actor_budgets = _budget(cfg, f"{arr}.actor.ppo_max_token_len_per_gpu", f"{arr}.actor.use_dynamic_bsz")
    actor_budgets += _budget(
        cfg, f"{arr}.rollout.log_prob_max_token_len_per_gpu", f"{arr}.rollout.log_prob_use_dynamic_bsz"
    )
    roles = [_role_mesh(cfg, "actor", f"{arr}.actor.megatron", f"{arr}.model", actor_budgets)]
    if need_reference_policy(cfg):
        ref_budgets = _budget(cfg, f"{arr}.ref.log_prob_max_token_len_per_gpu", f"{arr}.ref.log_prob_use_dynamic_bsz")
        roles.append(_role_mesh(cfg, "ref", f"{arr}.ref.megatron", f"{arr}.model", ref_budgets))
    if need_critic(cfg):
        critic_budgets = _budget(cfg, "critic.ppo_max_token_len_per_gpu", "critic.use_dynamic_bsz")
        critic_budgets += _budget(cfg, "critic.forward_max_token_len_per_gpu", "critic.use_dynamic_bsz")
        roles.append(_role_mesh(cfg, "critic", "critic.megatron", "critic.model", critic_budgets))
    return roles
