"""Start-up validation of a composed DS4 recipe, before torchrun or Ray do any heavy work.

:func:`validate_recipe` reads the *resolved* config (the values the trainer will use, whether they
came from a ``ds4.*`` knob, a named mesh or a direct override) and returns a
:class:`ValidationReport`. Every problem names the setting, what was expected, and the fix. Errors
are collected and raised together as one :class:`RecipeValidationError`; warnings never stop a run
but are printed with the plan. Nothing here changes the config: a user's explicit setting is
reported, never rewritten.

Rules (the DS4 rules are verl_ds4.ds4_facts' check_* functions, which the engine raises too; the
contract behind them: docs/ds4-context-parallel.md sections 1, 3, 4):

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
- a local checkpoint's format is noted; MTP on a DSpark drafter checkpoint is refused
  (:mod:`verl_ds4.recipes.checkpoint_check`);
- the rollout world (TP x DP x PP) divides the GPU count; router replay settings agree;
  prompt-length filtering runs on DS4's encoder (DS4RLHFDataset; verl's own needs a chat template);
- every role's weights + gradients + optimizer states fit on its GPUs, alone and beside the roles
  verl colocates with it, and the rollout's weights fit its memory share
  (:mod:`verl_ds4.recipes.memory_check`; ``ds4.memory_check=error|warn|off``).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, ListConfig

from verl_ds4 import ds4_facts, ds41_facts
from verl_ds4.models.ds4.provider import DS4ModelFacts, is_remote_path, load_model_facts
from verl_ds4.models.ds41.provider import DS41ModelFacts, is_v41_block, load_ds41_model_facts
from verl_ds4.recipes import seq_len
from verl_ds4.recipes.checkpoint_check import check_async_save, check_checkpoint_format, check_ds41_checkpoint_format
from verl_ds4.recipes.roles import Problem, RecipeValidationError, RoleMesh, _get, collect_roles

__all__ = ["Problem", "RecipeValidationError", "ValidationReport", "validate_recipe"]

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

@dataclass
class ValidationReport:
    """What :func:`validate_recipe` found. ``errors`` is empty when the run may start."""

    recipe: str
    trainer: str
    world_size: int
    nnodes: int
    gpus_per_node: int
    facts: DS4ModelFacts | DS41ModelFacts
    roles: list[RoleMesh]
    max_seq_len: int
    errors: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    memory: Any = None  # verl_ds4.memory.roles.MemoryReport once checked

    def raise_if_errors(self) -> None:
        if self.errors:
            raise RecipeValidationError(self.errors)


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


def _add(report: ValidationReport, engine_key: str, violation: ds4_facts.Violation | None) -> None:
    """Report a DS4 rule violation (the same rule the engine raises at start-up) as an error."""
    if violation is not None:
        key, message, fix = violation.recipe_problem()
        report.errors.append(Problem(f"{engine_key}.{key}", message, fix))  # error-catalogue: a ds4_facts.Violation, a site where it is built


def _check_fused_kernels(cfg: DictConfig, role, report: ValidationReport) -> None:
    """``use_fused_kernels=true`` where verl 0.9.1 would turn it off with only a warning is refused."""
    key = f"{role.model_key}.use_fused_kernels"
    on = bool(_get(cfg, key, False))
    why = "the critic is a value model" if role.role == "critic" else "MTP is enabled" if role.mtp else None
    why = why or (None if role.thd else "use_remove_padding is False")
    if on and why and not any(p.setting == key for p in report.errors):  # actor and ref share the model block
        report.errors.append(Problem(key, f"is True but {why}: verl 0.9.1's Megatron engine would turn the fused "
                                     "log-prob kernel off with only a warning (the logits then cost the non-fused "
                                     "path's memory).", f"set {key}=false, or turn MTP off / use_remove_padding on."))  # fmt: skip


def _check_role(role: RoleMesh, report: ValidationReport) -> None:
    _add(report, role.engine_key, ds4_facts.check_tensor_parallel(role.tp))
    if not _check_sizes(role, report):
        return
    _check_model_fit(role, report)
    _check_context_parallel(role, report)
    _check_cp_balance(role, report)
    _check_budgets(role, report)


def _check_sizes(role: RoleMesh, report: ValidationReport) -> bool:
    """Positive sizes whose products divide the world; False when a size is not even positive."""
    world, ek, errors = report.world_size, role.engine_key, report.errors
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
    if min(size for _, size in sizes) < 1:
        return False
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
    return True


def _check_model_fit(role: RoleMesh, report: ValidationReport) -> None:
    """EP divides the routed experts; PP does not exceed the layers."""
    facts, ek = report.facts, role.engine_key
    if facts.n_routed_experts % role.ep:
        divisors = [d for d in range(1, facts.n_routed_experts + 1) if facts.n_routed_experts % d == 0 and d <= 128]
        report.errors.append(
            Problem(
                f"{ek}.expert_model_parallel_size",
                f"EP={role.ep} does not divide the {facts.n_routed_experts} routed experts of {facts.name} "
                f"(from {facts.source}).",
                f"use an EP from {divisors}.",
            )
        )
    if role.pp > facts.num_layers:
        report.errors.append(
            Problem(
                f"{ek}.pipeline_model_parallel_size",
                f"PP={role.pp} exceeds the {facts.num_layers} decoder layers of {facts.name}.",
                f"use PP <= {facts.num_layers}.",
            )
        )


def _check_context_parallel(role: RoleMesh, report: ValidationReport) -> None:
    """THD input, the partition mode and the packing scheduler, with CP."""
    ek = role.engine_key
    if role.uses_cp and not role.thd:
        report.errors.append(
            Problem(
                f"{role.model_key}.use_remove_padding",
                f"is False with CP={role.cp}{' (dynamic CP)' if role.dynamic_cp else ''}: DS4 with context "
                "parallelism needs packed THD input (BSHD with CP is rejected by DS4 attention).",
                f"set {role.model_key}.use_remove_padding=true (verl copies it into the engine).",
            )
        )
    _add(report, ek, ds4_facts.check_cp_partition_mode(role.cp_partition_mode, role.cp, role.dynamic_cp, _attention(report)))
    if role.uses_cp and role.cp_partition_mode is None:
        report.notes.append(
            f"{ek}.override_transformer_config.cp_partition_mode is unset; verl-ds4's engine sets "
            f"{ds4_facts.CP_PARTITION_MODE!r} (Megatron's own default would be zigzag)."
        )
    _add(report, ek, ds4_facts.check_packing_scheduler(role.scheduler, role.cp, role.dynamic_cp))
    if role.uses_cp and role.scheduler == "dp_balanced":
        report.warnings.append(
            Problem(
                f"{ek}.override_transformer_config.sequence_packing_scheduler",
                "is 'dp_balanced', but verl 0.9.1's Megatron engine replaces it with 'default_dynamic_cp' for "
                "deepseek_v4 with CP>1 (workers/engine/megatron/transformer_impl.py, applied after your overrides).",
                "use the verl-ds4 engine, which keeps your choice, or accept default_dynamic_cp.",
            )
        )


def _attention(report: ValidationReport) -> str:
    """The attention the CP rules speak for (V4's or V4.1's)."""
    if isinstance(report.facts, DS41ModelFacts):
        return "DeepSeek-V4.1 (Megatron-LM dev's CSA2 attention or verl-ds4's DS41Attention, and Engram)"
    return "DeepSeek-V4 attention"


def _check_v41_model(report: ValidationReport, model_key: str, roles: list[RoleMesh]) -> None:
    """A V4.1 recipe: every V4.1 config rule (field, why, fix), and no MTP (the ``mtp.*`` stages are DSpark)."""
    facts = report.facts
    in_recipe = not facts.source.endswith("config.json")
    for v in facts.violations:
        where = f"ds4.model.{v.key}" if in_recipe else f"{model_key} ({facts.source}) {v.key}"
        fix = v.fix if not in_recipe else f"{v.fix} (recipe: ds4.model.{v.key}=..., or ds4_model=v41_flash)"
        report.errors.append(Problem(where, f"is {v.value!r}{v.context}, but {v.reason}.", fix))
    for role in roles:
        if role.mtp and role.role != "critic":
            report.errors.append(Problem(
                f"{role.model_key}.mtp.enable",
                f"is True, but {facts.name} has no MTP layer: its {facts.dspark_stages or 'mtp.*'} mtp.* stages are a "
                "DSpark drafter, which verl's MTP path would half-load and these recipes do not train.",
                "set ds4.mtp=false (the V4.1 recipes' default).",
            ))


def _check_cp_balance(role: RoleMesh, report: ValidationReport) -> None:
    if role.cp_balance is None:
        return
    from verl_ds4.engine.config import CP_BALANCE_CHOICES

    ek = role.engine_key
    if role.cp_balance not in CP_BALANCE_CHOICES:
        report.errors.append(
            Problem(
                f"{ek}.cp_balance",
                f"is {role.cp_balance!r}; expected null (batch order) or a cost model, one of {list(CP_BALANCE_CHOICES)}.",
                "set the recipe knob ds4.cp_balance to null, ds4 or dense.",
            )
        )
    elif not _has_cp_balance_field(role.engine_target):
        report.errors.append(
            Problem(
                f"{ek}._target_",
                f"is {role.engine_target!r}, which has no cp_balance field (cp_balance={role.cp_balance!r} would "
                "fail when verl builds the engine config).",
                f"set {ek}._target_={_DS4_ENGINE_CONFIG} (the DS4 recipes do).",
            )
        )


def _check_budgets(role: RoleMesh, report: ValidationReport) -> None:
    """Token budgets hold the rows every CP rank needs and the longest sequence."""
    min_rows = report.facts.min_local_rows  # the engine's padding minimum: ds4_facts.min_local_rows
    for budget in role.budgets:
        packed = budget.tokens_per_gpu * role.cp
        if role.uses_cp and budget.tokens_per_gpu < min_rows:
            report.errors.append(
                Problem(
                    budget.key,
                    f"{budget.tokens_per_gpu} tokens/GPU x CP={role.cp} gives a packed micro-batch of {packed} "
                    f"tokens, below the CP x {min_rows} = {role.cp * min_rows} rows DS4 pads every micro-batch "
                    f"to (each CP rank needs >= {min_rows} rows).",
                    f"set {budget.key} >= {min_rows} (better: several thousand).",
                )
            )
        if packed < report.max_seq_len:
            report.errors.append(
                Problem(
                    budget.key,
                    f"{budget.tokens_per_gpu} tokens/GPU x CP={role.cp} = {packed} cannot hold one sequence of "
                    f"the maximum length {report.max_seq_len} (verl refuses to split a sequence).",
                    f"set {budget.key} >= {-(-report.max_seq_len // role.cp)} or lower the maximum length.",
                )
            )
    if role.dynamic_cp:
        _add(
            report,
            role.engine_key,
            ds4_facts.check_rows_per_rank(
                role.max_seqlen_per_dp_cp_rank, min_rows, "max_seqlen_per_dp_cp_rank", context=" with dynamic CP"
            ),
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
                    f"use {ds4_facts.CP_PARTITION_MODE!r} for both.",
                )
            )


#: Rollout engines that return the indexer's top-k choices (verl_ds4.mcore.indexer_replay.FIELD).
INDEXER_REPLAY_ROLLOUTS = ("cpu_demo",)


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
    engine = rollout.get("name")
    if bool(_get(cfg, "actor_rollout_ref.actor.megatron.indexer_replay", False)) and engine not in INDEXER_REPLAY_ROLLOUTS:
        report.errors.append(
            Problem(
                "actor_rollout_ref.actor.megatron.indexer_replay",
                f"is True, but rollout.name={engine} returns no indexer choices (the batch field 'indexer_topk'); "
                f"only {list(INDEXER_REPLAY_ROLLOUTS)} records them today.",
                "set actor_rollout_ref.actor.megatron.indexer_replay=false (recipe knob ds4.indexer_replay) until "
                "the engine returns them (docs/rl-on-a-laptop.md, 'Indexer replay').",
            )
        )
    if bool(_get(cfg, "data.filter_overlong_prompts", False)) and str(_get(cfg, "data.custom_cls.name")) != "DS4RLHFDataset":
        report.errors.append(
            Problem(
                "data.filter_overlong_prompts",
                "is True with verl's RLHFDataset, whose filter calls tokenizer.apply_chat_template; DS4 checkpoints ship "
                "no chat template.",
                "select verl-ds4's DS4RLHFDataset (data.custom_cls.path=pkg://verl_ds4.models.ds4.rl_dataset "
                "data.custom_cls.name=DS4RLHFDataset; the DS4 recipes do), which measures prompts with DS4's encoder, or "
                "set data.filter_overlong_prompts=false.",
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
        raise ValueError(f"trainer must be 'sft' or 'ppo', got {trainer!r}")  # error-catalogue: internal: a caller passed a bad argument
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
    block = _get(cfg, "ds4.model")
    load = load_ds41_model_facts if is_v41_block(block) else load_model_facts
    facts = load(_get(cfg, model_key), block, "recipe ds4.model (configs/ds4_model)")
    max_seq_len = seq_len.longest_sequence(cfg, trainer)  # ds4.max_seq_len, else the data lengths
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
    v41 = ds41_facts.check_model_type({"model_type": facts.model_type}, "ds4")
    if isinstance(facts, DS41ModelFacts):
        _check_v41_model(report, model_key, roles)
    elif v41 is not None:
        report.errors.append(Problem(model_key, f"points at a model_type={facts.model_type!r} checkpoint ({facts.source}): {v41.reason}.", v41.fix))
    elif facts.model_type != ds4_facts.HF_MODEL_TYPE:
        report.errors.append(
            Problem(
                model_key,
                f"points at a model_type={facts.model_type!r} checkpoint ({facts.source}); these recipes and their "
                f"rules are for {ds4_facts.HF_MODEL_TYPE!r}.",
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
        _check_fused_kernels(cfg, role, report)
    report.errors += seq_len.check_lengths(cfg, trainer, facts.max_position_embeddings, facts.source)
    _check_agreement(roles, cfg, report)
    if trainer == "ppo":
        _check_rollout(cfg, report)
    check_async_save(cfg, trainer, report)
    from verl_ds4.recipes.kernel_check import check_kernels
    from verl_ds4.recipes.memory_check import check_memory

    check_kernels(cfg, report)
    report.memory = check_memory(cfg, report)
    _check_paths(cfg, trainer, roles, report, dry_run)
    if isinstance(facts, DS41ModelFacts):
        check_ds41_checkpoint_format(cfg, trainer, roles, report)
    else:
        check_checkpoint_format(cfg, trainer, roles, report)
    if raise_on_error:
        report.raise_if_errors()
    return report
