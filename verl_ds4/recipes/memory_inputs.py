"""The memory model's inputs, read once from a composed recipe (the only place its settings are read).

:func:`read_memory_inputs` turns the resolved config and the validation report (meshes, model sizes, world
size, longest sequence) into one :class:`~verl_ds4.memory.types.MemoryInputs`; :mod:`verl_ds4.memory`
is a function of it. A setting is followed to its term in one step: the key is read here into a named field
(docs/memory.md, "From a setting to its term"), and the field is what the model's term reads.

* ``ds4.memory_check`` / ``ds4.mesh.hardware`` / ``ds4.mesh.gpu_memory_gib`` / ``ds4.memory_headroom``: the mode,
  the GPU's capacity and the limit; a value that cannot be used is refused here and the model is skipped.
* per engine (:func:`role_input`): the mesh (``microbatch_group_size_per_vp_stage`` too), the optimizer's storage
  (:func:`optimizer_settings`), verl's offload flags, MTP, the kernel path, recompute and indexer loss
  (:func:`kernel_settings`), each pass's rows per GPU (:func:`pass_settings`), the sequences one update packs
  and the logits' loss buffers (the pass's, ``entropy_coeff``; the kernel, ``<model>.use_fused_kernels``).
* the rollout (``actor_rollout_ref.rollout``: TP, quantization, ``gpu_memory_utilization``, ``prompt_length`` +
  ``response_length``, ``max_num_seqs``; ``data.train_batch_size`` x ``n`` sequences per step), host RAM (``ds4.mesh.host_memory_gib``, Ray's object store),
  ``ds4.max_seq_len`` (the length lever), and the ``plan --fit`` names of the model and recipe.

Each pass's rows: a pass with ``use_dynamic_bsz=true`` holds its token budget per GPU; one with
``use_dynamic_bsz=false`` holds ``micro_batch_size_per_gpu`` sequences of the longest length, split over CP
(:func:`verl_ds4.memory.micro_batches.static_rows`). Every pass keeps its row whichever way it is batched.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from verl_ds4.memory.fixes import OPTIM_KEYS
from verl_ds4.memory.micro_batches import static_rows
from verl_ds4.memory.peak import DEFAULT_HEADROOM, check_headroom
from verl_ds4.memory.stages import gpu_memory_gib
from verl_ds4.memory.types import (
    KernelSettings, MemoryInputs, Mesh, OptimizerSettings, PassSetting, RoleInput, RolloutInput,
)
from verl_ds4.recipes.roles import Problem, RoleMesh, _get

__all__ = [
    "MEMORY_CHECK_MODES", "PASS_KEYS", "kernel_settings", "optimizer_settings", "pass_settings",
    "read_memory_inputs", "role_input",
]

MEMORY_CHECK_MODES = ("error", "warn", "off")
_DTYPE_BYTES = {"fp32": 4, "float32": 4, "32": 4, "bf16": 2, "bfloat16": 2, "16": 2}
#: ``plan --fit --model`` names of the recipes' model blocks (configs/ds4_model).
_FIT_MODELS = {"DeepSeek-V4-Flash": "flash", "DeepSeek-V4-Pro": "pro", "DeepSeek-V4.1-Flash": "v41_flash"}

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


def _dtype_bytes(value: Any, key: str, problems: list[Problem]) -> int:
    text = str(value).replace("torch.", "")
    if text not in _DTYPE_BYTES:
        problems.append(Problem(key, f"is {value!r}; expected fp32 or bf16.", f"set {key} to fp32 or bf16."))
        return 4
    return _DTYPE_BYTES[text]


def optimizer_settings(cfg: DictConfig, role: RoleMesh, problems: list[Problem]) -> OptimizerSettings:
    """Megatron's gradient and Adam-state storage for ``role`` as verl will configure it."""
    key = OPTIM_KEYS.get(role.role)
    optim = _get(cfg, key) if key else None
    engine = _get(cfg, role.engine_key) or {}
    distributed = bool(engine.get("use_distributed_optimizer", True))
    if optim is None:
        return OptimizerSettings(distributed=distributed)
    override = optim.get("override_optimizer_config") or {}
    aware = bool(override.get("use_precision_aware_optimizer", optim.get("use_precision_aware_optimizer", False)))
    grads = params = m = v = 4
    if aware:
        grads = _dtype_bytes(override.get("main_grads_dtype", optim.get("main_grads_dtype", "fp32")), f"{key}.main_grads_dtype", problems)
        m = _dtype_bytes(override.get("exp_avg_dtype", optim.get("exp_avg_dtype", "fp32")), f"{key}.exp_avg_dtype", problems)
        v = _dtype_bytes(override.get("exp_avg_sq_dtype", optim.get("exp_avg_sq_dtype", "fp32")), f"{key}.exp_avg_sq_dtype", problems)
        remainders = bool(override.get("store_param_remainders", True))
        main = _dtype_bytes(override.get("main_params_dtype", "fp32"), f"{key}.override_optimizer_config.main_params_dtype", problems)
        params = 2 if (remainders and main == 4) else main
    fraction = 0.0
    if bool(override.get("optimizer_cpu_offload", False)):
        fraction = float(override.get("optimizer_offload_fraction", 0.0) or 0.0)
        if not 0.0 <= fraction <= 1.0:
            problems.append(
                Problem(f"{key}.override_optimizer_config.optimizer_offload_fraction", f"is {fraction}; expected 0..1.",
                        "set a fraction between 0 and 1 (1.0 keeps the whole optimizer on the host).")
            )
            fraction = min(max(fraction, 0.0), 1.0)
    return OptimizerSettings(distributed, grads, params, m, v, fraction)


def _logits_kind(cfg: DictConfig, role: str) -> str:
    if role == "sft":
        return "sft"
    if role == "critic":
        return "value"
    if role == "ref":
        return "ref"
    entropy = float(_get(cfg, "actor_rollout_ref.actor.entropy_coeff", 0.0) or 0.0)
    return "actor" if entropy != 0.0 or bool(_get(cfg, "actor_rollout_ref.actor.calculate_entropy", False)) else "sft"


def _logits_kernel(cfg: DictConfig, role: RoleMesh) -> str:
    """What computes the role's logits step, as verl 0.9.1 runs it: ``fused`` when ``<model>.use_fused_kernels`` is on
    (``actor_rollout_ref.model`` for the actor and reference, ``model`` for SFT) and verl keeps it on (no MTP, no value
    head, packed input: the validator refuses the others), else ``unfused``."""
    on = bool(_get(cfg, f"{role.model_key}.use_fused_kernels", False))
    return "fused" if on and role.role != "critic" and not role.mtp and role.thd else "unfused"


def kernel_settings(engine: Any, engine_key: str) -> KernelSettings:
    """One engine block's kernel path, recompute and indexer loss (``<engine_key>`` and its
    ``override_transformer_config``), as written."""
    otc = engine.get("override_transformer_config") or {}
    raw = otc.get("recompute_modules")
    return KernelSettings(
        engine_key=engine_key,
        dsa_kernel_backend=str(otc.get("dsa_kernel_backend") or "none"),
        sparse_attention=engine.get("sparse_attention"),
        recompute_granularity=otc.get("recompute_granularity"),
        recompute_modules=None if raw is None else tuple(str(m) for m in (raw or [])),
        recompute_method=otc.get("recompute_method"),
        recompute_num_layers=otc.get("recompute_num_layers"),
        indexer_loss_coeff=otc.get("dsa_indexer_loss_coeff"),
        indexer_sparse_loss=bool(otc.get("dsa_indexer_use_sparse_loss", False)),
    )


def role_input(cfg: DictConfig, role: RoleMesh, world: int, max_seq_len: int, problems: list[Problem]) -> RoleInput:
    """One engine's :class:`~verl_ds4.memory.types.RoleInput` (settings that cannot be used go to ``problems``)."""
    engine = _get(cfg, role.engine_key) or {}
    otc = engine.get("override_transformer_config") or {}
    group = otc.get("microbatch_group_size_per_vp_stage")
    mesh = Mesh(world=world, pp=role.pp, ep=role.ep, cp=role.cp, etp=role.etp, tp=role.tp, vpp=role.vpp,
                vp_group=int(group) if group else None)
    trainable = role.role != "ref"
    optim = optimizer_settings(cfg, role, problems) if trainable else OptimizerSettings()
    passes = pass_settings(cfg, role.role, max_seq_len, role.cp, problems)  # each pass's rows, dynamic or fixed-size
    main = passes.get("update" if trainable else "forward")
    fwd = passes.get("forward") if trainable else None
    kernel = kernel_settings(engine, role.engine_key)
    dense_loss = kernel.dense_indexer_loss
    return RoleInput(
        role=role.role, mesh=mesh, trainable=trainable, tokens_per_gpu=main.tokens if main else max_seq_len,
        param_offload=bool(engine.get("param_offload", False)), optimizer_offload=bool(engine.get("optimizer_offload", False)),
        optimizer=optim, mtp=role.mtp and role.role != "critic", recompute=kernel.recompute,
        sequences=_update_sequences(cfg, role), path=kernel.path, max_seq_len=max_seq_len,
        infer_tokens=fwd.tokens if fwd else None, logits=_logits_kind(cfg, role.role), logits_kernel=_logits_kernel(cfg, role),
        dense_indexer_loss=dense_loss,
        micro_batch_size=(main.key, main.micro_batch_size) if main and main.micro_batch_size else None,
        infer_micro_batch_size=(fwd.key, fwd.micro_batch_size) if fwd and fwd.micro_batch_size else None,
    )


def _update_sequences(cfg: DictConfig, role: RoleMesh) -> int | None:
    """The sequences one update packs (SFT: the batch; actor / critic: the mini-batch x n), None for others."""
    if role.role == "sft":
        sequences = _get(cfg, "data.train_batch_size")
    elif role.role in ("actor", "critic"):
        key = "actor_rollout_ref.actor" if role.role == "actor" else "critic"
        sequences = _get(cfg, f"{key}.ppo_mini_batch_size")
        sequences = None if sequences is None else int(sequences) * int(_get(cfg, "actor_rollout_ref.rollout.n", 1))
    else:
        return None
    return None if sequences is None else int(sequences)


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


def _rollout(cfg: DictConfig) -> RolloutInput | None:
    rollout = _get(cfg, "actor_rollout_ref.rollout")
    if rollout is None:
        return None
    batch, n = _get(cfg, "data.train_batch_size"), rollout.get("n") or 1
    seqs = rollout.get("max_num_seqs")
    return RolloutInput(name=rollout.get("name"), tp=int(rollout.get("tensor_model_parallel_size") or 1),
                        quantization=rollout.get("quantization"), utilization=float(rollout.get("gpu_memory_utilization") or 0.5),
                        prompt_length=int(rollout.get("prompt_length") or 0), response_length=int(rollout.get("response_length") or 0),
                        max_num_seqs=int(seqs) if seqs else None, batch_sequences=int(batch) * int(n) if batch else None)


def _fit_names(report) -> tuple[str, str]:
    """(``plan --fit --model``, ``--recipe``) for this recipe's model and trainer."""
    source = report.facts.source
    model = _FIT_MODELS.get(report.facts.name, source) if source.startswith("recipe") else source
    recipe = report.recipe if report.recipe in ("sft", "ppo", "grpo") else ("sft" if report.trainer == "sft" else "ppo")
    return model, recipe


def read_memory_inputs(cfg: DictConfig, report) -> MemoryInputs:
    """The memory model's inputs from the composed recipe and its ``ValidationReport``, read once.

    Settings that cannot be used are added to ``report`` here (errors, or warnings where the check goes on
    without them); when the model cannot run the inputs say why in ``skipped``."""
    mode = str(_get(cfg, "ds4.memory_check", "error"))
    if mode not in MEMORY_CHECK_MODES:
        report.errors.append(
            Problem("ds4.memory_check", f"is {mode!r}; expected one of {list(MEMORY_CHECK_MODES)}.", "set ds4.memory_check=error (default), warn or off.")
        )
        return MemoryInputs(mode="error", skipped="ds4.memory_check has an unknown value")
    if mode == "off":
        report.warnings.append(Problem("ds4.memory_check", "is off: the memory check was skipped.", "set ds4.memory_check=error to check."))
        return MemoryInputs(mode, report.gpus_per_node, skipped="ds4.memory_check=off: whether the peak fits on the GPUs was NOT checked")
    sizes = report.facts.sizes
    if sizes is None:
        report.warnings.append(Problem("ds4.model", f"memory not checked: {report.facts.sizes_missing}", "add the missing field."))
        return MemoryInputs(mode, report.gpus_per_node, skipped=report.facts.sizes_missing)
    hardware, explicit = _get(cfg, "ds4.mesh.hardware"), _get(cfg, "ds4.mesh.gpu_memory_gib")
    try:
        capacity = gpu_memory_gib(hardware, explicit)
    except ValueError as e:
        report.errors.append(Problem("ds4.mesh.hardware", str(e), "name known hardware or give ds4.mesh.gpu_memory_gib."))
        return MemoryInputs(mode, report.gpus_per_node, skipped="unknown GPU capacity")
    headroom = _get(cfg, "ds4.memory_headroom", DEFAULT_HEADROOM)
    try:
        headroom = check_headroom(float(headroom))
    except (TypeError, ValueError) as e:
        report.errors.append(Problem("ds4.memory_headroom", str(e), "set ds4.memory_headroom to a fraction such as 0.1 (the default)."))
        return MemoryInputs(mode, report.gpus_per_node, capacity, hardware, skipped="ds4.memory_headroom is invalid")
    problems: list[Problem] = []
    world = report.world_size
    roles = tuple(
        role_input(cfg, r, world, report.max_seq_len, problems)
        for r in report.roles
        if min(r.tp, r.pp, r.cp, r.ep, r.etp) >= 1 and Mesh(world, r.pp, r.ep, r.cp, r.etp, r.tp).valid_for(sizes)
    )
    report.errors.extend(problems)
    knob = _get(cfg, "ds4.max_seq_len")
    model, recipe = _fit_names(report)
    return MemoryInputs(
        mode, report.gpus_per_node, capacity, hardware, headroom, sizes=sizes, world=world, roles=roles,
        rollout=_rollout(cfg), host_memory_gib=_get(cfg, "ds4.mesh.host_memory_gib"),
        object_store_memory=_get(cfg, "ray_kwargs.ray_init.object_store_memory") if _get(cfg, "actor_rollout_ref") is not None else None,
        max_seq_len_knob=None if knob is None else int(knob), fit_model=model, fit_recipe=recipe,
    )
