"""Human-readable parallel plan of a validated DS4 recipe (what ``--dry-run`` prints)."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from verl_ds4.models.ds4.provider import pipeline_stage_layers
from verl_ds4.recipes import seq_len
from verl_ds4.recipes.roles import _get
from verl_ds4.recipes.validate import ValidationReport


def _fmt(value: Any) -> str:
    return "-" if value is None else str(value)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def _mesh_changes(mesh: Any) -> str:
    """Describe which fields of the named mesh the run overrides (e.g. by launcher env knobs)."""
    name = mesh.get("name") if mesh else None
    if not name:
        return ""
    try:
        from importlib.resources import files

        import yaml

        shipped = yaml.safe_load((files("verl_ds4.configs_data") / "ds4_mesh" / f"{name}.yaml").read_text())
    except Exception:  # a user-provided mesh outside the package: nothing to compare with
        return ""
    changed = [f"{k} {shipped[k]}->{mesh.get(k)}" for k in shipped if k in mesh and mesh.get(k) != shipped[k]]
    return f", overridden: {', '.join(changed)}" if changed else ""


def _scheduler(value: Any, report: ValidationReport) -> str:
    if value is None and any(r.cp > 1 or r.dynamic_cp for r in report.roles):
        return "null (verl 0.9.1's engine sets default_dynamic_cp for deepseek_v4 with CP>1)"
    return _fmt(value)


def _v41_line(facts) -> list[str]:
    """V4.1's own facts (CSA2 roles, Engram, the DSpark drafter), one line; nothing for V4."""
    if getattr(facts, "family", None) != "ds41" or facts.sizes is None:
        return []
    s = facts.sizes
    roles = ", ".join(f"{s.roles.count(r)} {r}" for r in ("full", "reindex", "reuse", "window"))
    return [
        f"V4.1    : CSA2 layers {roles}; Engram on layers {list(facts.engram_layers)} ({s.engram_tables() / 1e9:.2f}B "
        f"table parameters, split over EP; needs the checkpoint's tokenizer.json); DSpark drafter "
        f"{facts.dspark_stages} stages ({s.dspark_total() / 1e9:.2f}B, not trained); {s.total() / 1e9:.2f}B parameters"
    ]


def format_plan(cfg: DictConfig, report: ValidationReport, launch: str | None = None) -> str:
    """Render the resolved parallel plan, the DS4 settings that matter, and every finding."""
    facts = report.facts
    mesh = _get(cfg, "ds4.mesh") or {}
    lines = [
        f"DS4 recipe plan: {report.recipe} ({report.trainer} trainer)",
        f"model   : {facts.name}: {facts.num_layers} layers + {facts.mtp_layers} MTP, {facts.n_routed_experts} "
        f"routed experts (top-{facts.num_experts_per_tok}), hidden {facts.hidden_size}, {facts.num_attention_heads} "
        f"heads, window {facts.csa_window_size}, CSA top-{facts.index_topk}, >= {facts.min_local_rows} rows per CP "
        f"rank  [facts from {facts.source}]",
        *_v41_line(facts),
        f"cluster : {report.nnodes} nodes x {report.gpus_per_node} GPUs = {report.world_size} GPUs"
        f"  [named mesh {_fmt(mesh.get('name'))} ({_fmt(mesh.get('hardware'))}){_mesh_changes(mesh)}]",
        f"max sequence length: {report.max_seq_len} tokens",
        seq_len.describe(cfg, report.trainer),
        "",
        "engines (resolved):",
    ]
    header = ["role", "TP", "PP", "VPP", "CP", "EP", "ETP", "DP", "expert-DP", "CP layout", "THD", "dyn-CP", "MTP"]
    rows = [header]
    world = report.world_size
    for r in report.roles:
        ok = min(r.tp, r.pp, r.cp, r.ep, r.etp) >= 1
        ok = ok and world % (r.tp * r.pp * r.cp) == 0 and world % (r.pp * r.etp * r.ep) == 0
        rows.append(
            [
                r.role,
                str(r.tp),
                str(r.pp),
                _fmt(r.vpp),
                str(r.cp),
                str(r.ep),
                str(r.etp),
                str(r.dp(world)) if ok else "n/a",
                str(r.expert_dp(world)) if ok else "n/a",
                _fmt(r.cp_partition_mode) if r.cp > 1 or r.dynamic_cp else f"{_fmt(r.cp_partition_mode)} (CP=1)",
                "yes" if r.thd else "no",
                "yes" if r.dynamic_cp else "no",
                "on" if r.mtp else "off",
            ]
        )
    lines += _table(rows)
    lines.append("")
    lines.append("token budgets (per GPU x CP = packed micro-batch; DS4 pads each micro-batch to CP x window rows):")
    budget_rows = [["role", "setting", "tokens/GPU", "packed micro-batch", "min rows (CP x window)"]]
    for r in report.roles:
        for b in r.budgets:
            budget_rows.append(
                [
                    r.role,
                    b.key,
                    str(b.tokens_per_gpu),
                    str(b.tokens_per_gpu * r.cp),
                    str(r.cp * facts.min_local_rows) if r.cp > 1 or r.dynamic_cp else "- (CP=1)",
                ]
            )
        if r.dynamic_cp:
            budget_rows.append([r.role, f"{r.engine_key}.max_seqlen_per_dp_cp_rank", _fmt(r.max_seqlen_per_dp_cp_rank), "-", "-"])
    if len(budget_rows) > 1:
        lines += _table(budget_rows)
    else:
        lines.append("  (dynamic batch size off: micro_batch_size_per_gpu sets the micro-batches)")
    lines.append("")
    for r in report.roles:
        if r.pp >= 1 and r.pp <= facts.num_layers:
            stages = pipeline_stage_layers(facts.num_layers, r.pp)
            mtp = f" + {facts.mtp_layers} MTP on the last stage" if r.mtp and facts.mtp_layers else ""
            lines.append(f"pipeline ({r.role}): {facts.num_layers} layers over PP{r.pp} -> {stages}{mtp}")
    otc_key = report.roles[0].engine_key + ".override_transformer_config" if report.roles else None
    otc = _get(cfg, otc_key) or {}
    lines.append(
        "DS4 settings: "
        f"scheduler={_scheduler(otc.get('sequence_packing_scheduler'), report)}, "
        f"indexer_loss_coeff={_fmt(otc.get('dsa_indexer_loss_coeff'))}, "
        f"dsa_kernel_backend={_fmt(otc.get('dsa_kernel_backend'))}, "
        f"sparse_attention={_fmt(_get(cfg, report.roles[0].engine_key + '.sparse_attention') if report.roles else None)}, "
        f"recompute={_fmt(otc.get('recompute_granularity'))}:{_fmt(otc.get('recompute_modules'))}, "
        f"param_offload={_fmt(_get(cfg, report.roles[0].engine_key + '.param_offload') if report.roles else None)}, "
        f"optimizer_offload={_fmt(_get(cfg, report.roles[0].engine_key + '.optimizer_offload') if report.roles else None)}"
    )
    if report.trainer == "ppo":
        rollout = _get(cfg, "actor_rollout_ref.rollout") or {}
        tp = int(rollout.get("tensor_model_parallel_size") or 1)
        dp = int(rollout.get("data_parallel_size") or 1)
        pp = int(rollout.get("pipeline_model_parallel_size") or 1)
        replicas = world // (tp * dp * pp) if world % (tp * dp * pp) == 0 else "n/a"
        lines.append(
            f"rollout : {rollout.get('name')} TP{tp} x DP{dp} x PP{pp} -> {replicas} replicas, n={rollout.get('n')}, "
            f"quantization={_fmt(rollout.get('quantization'))}, router replay="
            f"{_get(cfg, 'actor_rollout_ref.actor.megatron.router_replay.mode', 'disabled')}"
            f" (rollout routes {'on' if rollout.get('enable_rollout_routing_replay') else 'off'})"
        )
        lines.append(
            f"algorithm: adv_estimator={_get(cfg, 'algorithm.adv_estimator')}, "
            f"critic={'yes' if any(r.role == 'critic' for r in report.roles) else 'no'}, "
            f"reference={'yes' if any(r.role == 'ref' for r in report.roles) else 'no'}"
        )
    lines.append(
        f"checkpoints: {_get(cfg, 'trainer.default_local_dir')} (resume_mode={_get(cfg, 'trainer.resume_mode')}, "
        f"save_freq={_get(cfg, 'trainer.save_freq')}"
        + (", async saves" if report.trainer == "sft" and bool(_get(cfg, "checkpoint.async_save", False)) else "") + ")"
    )
    from verl_ds4.memory.table import format_memory

    lines += format_memory(report.memory)
    if launch:
        lines.append(f"launch  : {launch}")
    for note in report.notes:
        lines.append(f"note    : {note}")
    for w in report.warnings:
        lines.append(f"WARNING : {w}")
    for e in report.errors:
        lines.append(f"ERROR   : {e}")
    lines.append("validation: " + ("FAILED" if report.errors else "OK") + f" ({len(report.errors)} errors, {len(report.warnings)} warnings)")
    return "\n".join(lines)
