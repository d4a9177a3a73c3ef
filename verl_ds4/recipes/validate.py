"""Start-up validation of a composed DS4 recipe, before torchrun or Ray do any heavy work.

:func:`validate_recipe` reads the *resolved* config (the values the trainer will use, whether they
came from a ``ds4.*`` knob, a named mesh or a direct override) and returns a
:class:`ValidationReport`. Every problem names the setting, what was expected, and the fix. Errors
are collected and raised together as one :class:`RecipeValidationError`; warnings never stop a run
but are printed with the plan. Nothing here changes the config: a user's explicit setting is
reported, never rewritten.

Rules (DS4 facts: shared doc ds4-context-parallel.md sections 1, 3, 4):

- world size (nnodes x GPUs per node) divisible by TP x PP x CP (so DP is an integer) and by
  PP x ETP x EP (expert data parallelism);
- EP divides the routed-expert count; PP does not exceed the layer count;
- TP = 1 (DS4 attention has no tensor parallelism);
- CP > 1 needs THD (``model.use_remove_padding=True``), ``cp_partition_mode=contiguous`` and a
  packing scheduler Megatron accepts;
- every per-GPU token budget x CP holds at least CP x 128 rows (DS4 pads each micro-batch to
  ``cp * csa_window_size`` rows) and the longest sequence;
- the reference model (colocated with the actor) uses the actor's mesh and layout; the critic
  obeys the same DS4 rules, has no MTP and no dynamic CP;
- model and data paths exist (real runs; a dry-run reports them as warnings);
- the rollout world (TP x DP x PP) divides the GPU count; router replay settings agree;
  prompt-length filtering (needs a chat template DS4 does not ship) is off.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, ListConfig

from verl_ds4.models.ds4.provider import (
    HF_MODEL_TYPE,
    REQUIRED_CP_PARTITION_MODE,
    SEQUENCE_PACKING_SCHEDULERS,
    SUPPORTED_TENSOR_PARALLEL_SIZE,
    DS4ModelFacts,
    is_remote_path,
    load_model_facts,
)

# Parallel sizes the reference model must share with the actor (same processes, one Megatron
# parallel state per process).
_SHARED_WITH_ACTOR = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "dynamic_context_parallel",
)


class RecipeValidationError(ValueError):
    """A composed recipe cannot run; ``problems`` lists every reason (setting, what, fix)."""

    def __init__(self, problems: list["Problem"]):
        self.problems = list(problems)
        lines = [f"DS4 recipe validation failed with {len(self.problems)} error(s):"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


_DS4_ENGINE_CONFIG = "verl_ds4.engine.config.DS4McoreEngineConfig"


def _has_cp_balance_field(target: str | None) -> bool:
    """Whether the engine config class ``target`` (a ``_target_`` string) has a ``cp_balance`` field."""
    if not target:
        return False
    import dataclasses

    from hydra.utils import get_class

    try:
        cls = get_class(target)
    except Exception:
        return False
    return dataclasses.is_dataclass(cls) and "cp_balance" in {f.name for f in dataclasses.fields(cls)}

@dataclass(frozen=True)
class Problem:
    """One finding: the config key it is about, what is wrong, and how to fix it."""

    setting: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.setting}: {self.message} Fix: {self.fix}"


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

    def dp(self, world: int) -> int:
        return world // (self.tp * self.pp * self.cp)

    def expert_dp(self, world: int) -> int:
        return world // (self.pp * self.etp * self.ep)


@dataclass
class ValidationReport:
    """What :func:`validate_recipe` found. ``errors`` is empty when the run may start."""

    recipe: str
    trainer: str
    world_size: int
    nnodes: int
    gpus_per_node: int
    facts: DS4ModelFacts
    roles: list[RoleMesh]
    max_seq_len: int
    errors: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def raise_if_errors(self) -> None:
        if self.errors:
            raise RecipeValidationError(self.errors)


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


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (list, tuple, ListConfig)):
        return [str(v) for v in value]
    return [str(value)]


def _path_exists(path: str) -> bool:
    expanded = os.path.expanduser(path)
    if glob.has_magic(expanded):
        return bool(glob.glob(expanded))
    return os.path.exists(expanded)


def _check_paths(cfg: DictConfig, trainer: str, roles: list[RoleMesh], report: ValidationReport, dry_run: bool) -> None:
    if not bool(_get(cfg, "ds4.check_paths", True)):
        report.warnings.append(
            Problem("ds4.check_paths", "is false: model and data paths were NOT checked.", "set ds4.check_paths=true.")
        )
        return
    env_for = {"data.train_files": "TRAIN_FILES", "data.val_files": "VAL_FILES"}
    keys: list[tuple[str, str]] = []
    model_keys = ["model.path"] if trainer == "sft" else ["actor_rollout_ref.model.path"]
    if any(r.role == "critic" for r in roles):
        model_keys.append("critic.model.path")
    for key in model_keys:
        keys.append((key, "MODEL_PATH"))
        tok = key.rsplit(".", 1)[0] + ".tokenizer_path"
        if _get(cfg, tok):
            keys.append((tok, "MODEL_PATH"))
    keys += [("data.train_files", env_for["data.train_files"]), ("data.val_files", env_for["data.val_files"])]
    if str(_get(cfg, "trainer.resume_mode", "auto")) == "resume_path":
        if not _get(cfg, "trainer.resume_from_path"):
            report.errors.append(
                Problem(
                    "trainer.resume_from_path",
                    "is empty while trainer.resume_mode=resume_path.",
                    "set it to a checkpoint folder (launcher RESUME_FROM) or use resume_mode=auto.",
                )
            )
        else:
            keys.append(("trainer.resume_from_path", "RESUME_FROM"))
    for key, env in keys:
        for path in _as_list(_get(cfg, key)):
            if is_remote_path(path):
                report.notes.append(f"{key}={path} is remote; the trainer fetches it (not checked here).")
                continue
            if _path_exists(path):
                continue
            problem = Problem(
                key,
                f"{path!r} does not exist on this machine.",
                f"point {key} (launcher env {env}) at an existing local path"
                + (", e.g. one made by scripts/prepare_gsm8k.py" if key.startswith("data.") else "")
                + ".",
            )
            if dry_run:
                report.warnings.append(
                    Problem(problem.setting, problem.message + " (dry-run: reported, not fatal)", problem.fix)
                )
            else:
                report.errors.append(problem)


def _check_role(role: RoleMesh, report: ValidationReport) -> None:
    world, facts, ek = report.world_size, report.facts, role.engine_key
    errors, warnings = report.errors, report.warnings
    if role.tp != SUPPORTED_TENSOR_PARALLEL_SIZE:
        errors.append(
            Problem(
                f"{ek}.tensor_model_parallel_size",
                f"is {role.tp}, but DS4's hybrid attention does not support tensor parallelism.",
                "set it to 1 (launcher keeps TP=1) and scale with PP/EP/CP/DP instead.",
            )
        )
    sizes = (
        ("tensor_model_parallel_size", role.tp),
        ("pipeline_model_parallel_size", role.pp),
        ("context_parallel_size", role.cp),
        ("expert_model_parallel_size", role.ep),
        ("expert_tensor_parallel_size", role.etp),
    )
    for name, size in sizes:
        if size < 1:
            errors.append(Problem(f"{ek}.{name}", f"is {size}; parallel sizes must be >= 1.", "use a positive size."))
    if min(role.tp, role.pp, role.cp, role.ep, role.etp) < 1:
        return
    model_parallel = role.tp * role.pp * role.cp
    if world % model_parallel:
        errors.append(
            Problem(
                f"{ek} (TPxPPxCP={role.tp}x{role.pp}x{role.cp}={model_parallel})",
                f"world size {report.nnodes} nodes x {report.gpus_per_node} GPUs = {world} is not divisible by "
                f"TPxPPxCP={model_parallel}, so DP = {world}/{model_parallel} is not an integer.",
                f"pick PP/CP whose product divides {world}, or NNODES x GPUS_PER_NODE (trainer.nnodes, "
                f"trainer.n_gpus_per_node) that is a multiple of {model_parallel}.",
            )
        )
    expert_parallel = role.pp * role.etp * role.ep
    if world % expert_parallel:
        errors.append(
            Problem(
                f"{ek}.expert_model_parallel_size",
                f"world size {world} is not divisible by PPxETPxEP={role.pp}x{role.etp}x{role.ep}={expert_parallel} "
                "(Megatron needs an integer expert-data-parallel size).",
                f"choose EP so that PPxETPxEP divides {world}.",
            )
        )
    if facts.n_routed_experts % role.ep:
        divisors = [d for d in range(1, facts.n_routed_experts + 1) if facts.n_routed_experts % d == 0 and d <= 128]
        errors.append(
            Problem(
                f"{ek}.expert_model_parallel_size",
                f"EP={role.ep} does not divide the {facts.n_routed_experts} routed experts of {facts.name} "
                f"(from {facts.source}).",
                f"use an EP from {divisors}.",
            )
        )
    if role.pp > facts.num_layers:
        errors.append(
            Problem(
                f"{ek}.pipeline_model_parallel_size",
                f"PP={role.pp} exceeds the {facts.num_layers} decoder layers of {facts.name}.",
                f"use PP <= {facts.num_layers}.",
            )
        )
    uses_cp = role.cp > 1 or role.dynamic_cp
    if uses_cp and not role.thd:
        errors.append(
            Problem(
                f"{role.model_key}.use_remove_padding",
                f"is False with CP={role.cp}{' (dynamic CP)' if role.dynamic_cp else ''}: DS4 with context "
                "parallelism needs packed THD input (BSHD with CP is rejected by DS4 attention).",
                f"set {role.model_key}.use_remove_padding=true (verl copies it into the engine).",
            )
        )
    mode = role.cp_partition_mode
    if uses_cp and mode != REQUIRED_CP_PARTITION_MODE:
        what = "is unset (Megatron's default is zigzag)" if mode is None else f"is {mode!r}"
        errors.append(
            Problem(
                f"{ek}.override_transformer_config.cp_partition_mode",
                f"{what} with CP={role.cp}: DS4 derives positions from one contiguous slice per CP rank; a "
                "zigzag rank holds two chunks of every sequence and silently gets wrong positions.",
                f"set it to {REQUIRED_CP_PARTITION_MODE!r} (recipe knob ds4.cp_partition_mode).",
            )
        )
    if role.cp_balance is not None:
        from verl_ds4.engine.config import CP_BALANCE_CHOICES

        if role.cp_balance not in CP_BALANCE_CHOICES:
            errors.append(
                Problem(
                    f"{ek}.cp_balance",
                    f"is {role.cp_balance!r}; expected null (batch order) or a cost model, one of {list(CP_BALANCE_CHOICES)}.",
                    "set the recipe knob ds4.cp_balance to null, ds4 or dense.",
                )
            )
        elif not _has_cp_balance_field(role.engine_target):
            errors.append(
                Problem(
                    f"{ek}._target_",
                    f"is {role.engine_target!r}, which has no cp_balance field (cp_balance={role.cp_balance!r} would "
                    "fail when verl builds the engine config).",
                    f"set {ek}._target_={_DS4_ENGINE_CONFIG} (the DS4 recipes do).",
                )
            )
    if uses_cp and role.scheduler is not None and role.scheduler not in SEQUENCE_PACKING_SCHEDULERS:
        errors.append(
            Problem(
                f"{ek}.override_transformer_config.sequence_packing_scheduler",
                f"is {role.scheduler!r}; DS4 THD with CP>1 accepts only {list(SEQUENCE_PACKING_SCHEDULERS)}.",
                "pick one of those or leave it null (ds4.sequence_packing_scheduler).",
            )
        )
    if uses_cp and role.scheduler == "dp_balanced":
        warnings.append(
            Problem(
                f"{ek}.override_transformer_config.sequence_packing_scheduler",
                "is 'dp_balanced', but verl 0.9.1's Megatron engine replaces it with 'default_dynamic_cp' for "
                "deepseek_v4 with CP>1 (workers/engine/megatron/transformer_impl.py, applied after your overrides).",
                "use the verl-ds4 engine, which keeps your choice, or accept default_dynamic_cp.",
            )
        )
    min_rows = role.cp * facts.csa_window_size
    for budget in role.budgets:
        packed = budget.tokens_per_gpu * role.cp
        if uses_cp and packed < min_rows:
            errors.append(
                Problem(
                    budget.key,
                    f"{budget.tokens_per_gpu} tokens/GPU x CP={role.cp} gives a packed micro-batch of {packed} "
                    f"tokens, below the CP x {facts.csa_window_size} = {min_rows} rows DS4 pads every micro-batch "
                    f"to (each CP rank needs >= {facts.csa_window_size} rows).",
                    f"set {budget.key} >= {facts.csa_window_size} (better: several thousand).",
                )
            )
        if packed < report.max_seq_len:
            errors.append(
                Problem(
                    budget.key,
                    f"{budget.tokens_per_gpu} tokens/GPU x CP={role.cp} = {packed} cannot hold one sequence of "
                    f"the maximum length {report.max_seq_len} (verl refuses to split a sequence).",
                    f"set {budget.key} >= {-(-report.max_seq_len // role.cp)} or lower the maximum length.",
                )
            )
    if role.dynamic_cp:
        cap = role.max_seqlen_per_dp_cp_rank
        if cap is None or int(cap) < facts.csa_window_size:
            errors.append(
                Problem(
                    f"{ek}.max_seqlen_per_dp_cp_rank",
                    f"is {cap} with dynamic CP; each DPxCP rank must be allowed >= {facts.csa_window_size} rows.",
                    f"set it to an integer >= {facts.csa_window_size} (ds4.max_seqlen_per_dp_cp_rank).",
                )
            )


def _check_agreement(roles: list[RoleMesh], cfg: DictConfig, report: ValidationReport) -> None:
    by_role = {r.role: r for r in roles}
    actor, ref, critic = by_role.get("actor"), by_role.get("ref"), by_role.get("critic")
    if actor is not None and ref is not None:
        actor_engine, ref_engine = _get(cfg, actor.engine_key), _get(cfg, ref.engine_key)
        for name in _SHARED_WITH_ACTOR:
            a, r = actor_engine.get(name), ref_engine.get(name)
            if a != r:
                report.errors.append(
                    Problem(
                        f"{ref.engine_key}.{name}",
                        f"is {r} but the actor uses {a}; the reference model runs in the actor's processes, "
                        "which hold one Megatron parallel state.",
                        f"remove the override or set {ref.engine_key}.{name}={a}.",
                    )
                )
        if actor.cp_partition_mode != ref.cp_partition_mode:
            report.errors.append(
                Problem(
                    f"{ref.engine_key}.override_transformer_config.cp_partition_mode",
                    f"is {ref.cp_partition_mode!r} but the actor uses {actor.cp_partition_mode!r}; reference "
                    "log-probs would be computed on a different token layout than the actor's.",
                    f"use {actor.cp_partition_mode!r} for both.",
                )
            )
    if critic is not None:
        if critic.mtp:
            report.errors.append(
                Problem(
                    f"{critic.model_key}.mtp.enable",
                    "is True, but a value head has no MTP layer.",
                    f"set {critic.model_key}.mtp.enable=false (verl then trims csa_compress_ratios).",
                )
            )
        if critic.dynamic_cp:
            report.errors.append(
                Problem(
                    f"{critic.engine_key}.dynamic_context_parallel",
                    "is True, but verl's dynamic CP supports language models only, not the value model.",
                    f"set {critic.engine_key}.dynamic_context_parallel=false (a static CP works).",
                )
            )
        if actor is not None and (critic.cp > 1 or actor.cp > 1) and critic.cp_partition_mode != actor.cp_partition_mode:
            report.errors.append(
                Problem(
                    f"{critic.engine_key}.override_transformer_config.cp_partition_mode",
                    f"is {critic.cp_partition_mode!r} but the actor uses {actor.cp_partition_mode!r}; values "
                    "and log-probs of the same tokens must come from the same layout.",
                    f"use {REQUIRED_CP_PARTITION_MODE!r} for both.",
                )
            )


def _check_rollout(cfg: DictConfig, report: ValidationReport) -> None:
    rollout = _get(cfg, "actor_rollout_ref.rollout")
    if rollout is None:
        return
    tp = int(rollout.get("tensor_model_parallel_size") or 1)
    dp = int(rollout.get("data_parallel_size") or 1)
    pp = int(rollout.get("pipeline_model_parallel_size") or 1)
    replica = tp * dp * pp
    world = report.world_size
    if world % replica:
        report.errors.append(
            Problem(
                "actor_rollout_ref.rollout.tensor_model_parallel_size",
                f"rollout replicas of TPxDPxPP={tp}x{dp}x{pp}={replica} GPUs do not divide the {world} GPUs.",
                f"set the rollout TP (launcher ROLLOUT_TP) to a divisor of {world}, e.g. "
                f"{[d for d in (1, 2, 4, 8, 16) if world % (d * dp * pp) == 0]}.",
            )
        )
    elif tp > report.gpus_per_node:
        report.warnings.append(
            Problem(
                "actor_rollout_ref.rollout.tensor_model_parallel_size",
                f"TP={tp} spans more than one node ({report.gpus_per_node} GPUs per node).",
                "prefer a rollout TP <= GPUs per node unless your engine supports multi-node TP.",
            )
        )
    mode = str(_get(cfg, "actor_rollout_ref.actor.megatron.router_replay.mode", "disabled"))
    rollout_replay = bool(rollout.get("enable_rollout_routing_replay", False))
    if mode == "R3" and not rollout_replay:
        report.errors.append(
            Problem(
                "actor_rollout_ref.rollout.enable_rollout_routing_replay",
                "is False while router_replay.mode=R3 replays the rollout's routes.",
                "set actor_rollout_ref.rollout.enable_rollout_routing_replay=true (launcher ROUTER_REPLAY=R3 does).",
            )
        )
    if mode != "R3" and rollout_replay:
        report.errors.append(
            Problem(
                "actor_rollout_ref.rollout.enable_rollout_routing_replay",
                f"is True while actor router_replay.mode={mode}; only R3 consumes rollout routes.",
                "set router_replay.mode=R3 or enable_rollout_routing_replay=false.",
            )
        )
    if bool(_get(cfg, "data.filter_overlong_prompts", False)):
        report.errors.append(
            Problem(
                "data.filter_overlong_prompts",
                "is True, but it calls tokenizer.apply_chat_template and DS4 checkpoints ship no chat template.",
                "set data.filter_overlong_prompts=false (keep prompts within data.max_prompt_length when preparing data).",
            )
        )


def validate_recipe(
    cfg: DictConfig,
    trainer: str,
    *,
    dry_run: bool = False,
    raise_on_error: bool = True,
) -> ValidationReport:
    """Validate a composed, resolved DS4 recipe config.

    Args:
        cfg: the composed config (see :func:`verl_ds4.recipes.compose.compose_recipe`).
        trainer: ``"sft"`` or ``"ppo"`` (GRPO uses ``"ppo"``).
        dry_run: missing model/data paths become warnings instead of errors.
        raise_on_error: raise :class:`RecipeValidationError` when any error was found.

    Returns:
        The report (errors, warnings, notes, resolved meshes, model facts).
    """
    if trainer not in ("sft", "ppo"):
        raise ValueError(f"trainer must be 'sft' or 'ppo', got {trainer!r}")
    if _get(cfg, "ds4") is None:
        raise RecipeValidationError(
            [
                Problem(
                    "+recipe",
                    "no DS4 recipe is selected (the config has no `ds4` block).",
                    "add 'hydra.searchpath=[pkg://verl_ds4.recipes_data,pkg://verl_ds4.configs_data]' and "
                    "+recipe=deepseek_v4_sft|deepseek_v4_ppo|deepseek_v4_grpo.",
                )
            ]
        )
    nnodes = int(_get(cfg, "trainer.nnodes", 1))
    gpus = int(_get(cfg, "trainer.n_gpus_per_node", 1))
    model_key = "model.path" if trainer == "sft" else "actor_rollout_ref.model.path"
    facts = load_model_facts(_get(cfg, model_key), _get(cfg, "ds4.model"), "recipe ds4.model (configs/ds4_model)")
    if trainer == "sft":
        max_seq_len = int(_get(cfg, "data.max_length", 0))
    else:
        max_seq_len = int(_get(cfg, "data.max_prompt_length", 0)) + int(_get(cfg, "data.max_response_length", 0))
    roles = collect_roles(cfg, trainer)
    report = ValidationReport(
        recipe=str(_get(cfg, "ds4.recipe", trainer)),
        trainer=trainer,
        world_size=nnodes * gpus,
        nnodes=nnodes,
        gpus_per_node=gpus,
        facts=facts,
        roles=roles,
        max_seq_len=max_seq_len,
    )
    if nnodes < 1 or gpus < 1:
        report.errors.append(
            Problem("trainer.nnodes / trainer.n_gpus_per_node", f"are {nnodes} / {gpus}.", "use positive integers.")
        )
        if raise_on_error:
            report.raise_if_errors()
        return report
    if facts.model_type != HF_MODEL_TYPE:
        report.errors.append(
            Problem(
                model_key,
                f"points at a model_type={facts.model_type!r} checkpoint ({facts.source}); these recipes and their "
                f"rules are for {HF_MODEL_TYPE!r}.",
                "point it at a DeepSeek-V4 checkpoint or use a recipe for your model.",
            )
        )
    for role in roles:
        _check_role(role, report)
        engine = _get(cfg, role.engine_key)
        if engine.get("use_remove_padding") is not None and bool(engine.get("use_remove_padding")) != role.thd:
            report.warnings.append(
                Problem(
                    f"{role.engine_key}.use_remove_padding",
                    f"is {engine.get('use_remove_padding')} but verl replaces it with "
                    f"{role.model_key}.use_remove_padding={role.thd}.",
                    f"set {role.model_key}.use_remove_padding instead.",
                )
            )
        if role.role != "critic" and role.mtp and bool(_get(cfg, f"{role.model_key}.use_fused_kernels", False)):
            report.warnings.append(
                Problem(
                    f"{role.model_key}.use_fused_kernels",
                    "is True with MTP enabled; verl 0.9.1 turns fused kernels off for MTP models.",
                    "disable one of them explicitly.",
                )
            )
    _check_agreement(roles, cfg, report)
    if trainer == "ppo":
        _check_rollout(cfg, report)
    _check_paths(cfg, trainer, roles, report, dry_run)
    if raise_on_error:
        report.raise_if_errors()
    return report
