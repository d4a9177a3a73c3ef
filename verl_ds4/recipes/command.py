"""Compose, validate and print the parallel plan of a DS4 recipe (no GPU, no Ray).

    verl-ds4 recipe sft  --dry-run  [hydra overrides ...]
    verl-ds4 recipe ppo  --shell-env [hydra overrides ...]
    verl-ds4 recipe grpo --dry-run --json [hydra overrides ...]

KIND is sft (verl.trainer.sft_trainer), ppo or grpo (verl.trainer.main_ppo), or a V4.1 recipe:
deepseek_v41_sft / deepseek_v41_grpo. The overrides are
exactly what the trainer receives; the search path and +recipe= are added when missing.

--dry-run prints the plan and exits 0 when the config is valid (missing model/data paths are
reported as warnings). Without it, missing paths are errors; the plan goes to stderr and, with
--shell-env, NNODES=/GPUS_PER_NODE= lines go to stdout for the launcher. Exit status 1 means the
configuration was rejected; every error names the setting and the fix. --shell-env also prints
DS4_DERIVED_OVERRIDES=(...): the lengths and budgets ds4.max_seq_len derives (verl_ds4/recipes/seq_len.py),
which the launchers pass to the trainer.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from verl_ds4.recipes.compose import TRAINERS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", choices=sorted(TRAINERS), help="which recipe: sft, ppo (GAE critic) or grpo (DeepSeek-V4); deepseek_v41_sft or deepseek_v41_grpo (V4.1)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="compose and validate only, print the resolved parallel plan; missing paths are warnings",
    )
    parser.add_argument(
        "--shell-env",
        action="store_true",
        help="after a successful validation print NNODES=<n>, GPUS_PER_NODE=<g> and DS4_DERIVED_OVERRIDES=(...) (what "
        "ds4.max_seq_len derives, for the trainer's command line) on stdout (plan on stderr)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="with --dry-run: print the plan as JSON (engines, budgets, memory per role: states, activations, logits, "
        "peak, fits) instead of the table; the exit status is the same",
    )
    parser.add_argument(
        "overrides",
        nargs=argparse.REMAINDER,
        help="Hydra overrides passed to the trainer (a leading '--' is ignored)",
    )


def launch_line(kind: str, nnodes: int, gpus_per_node: int, n_overrides: int) -> str:
    trainer = TRAINERS[kind]
    if trainer.kind == "sft":
        return (
            f"torchrun --nnodes={nnodes} --nproc_per_node={gpus_per_node} --node_rank=$NODE_RANK "
            f"--master_addr=$MASTER_ADDR --master_port=$MASTER_PORT -m {trainer.module} <{n_overrides} overrides>"
        )
    return f"python -m {trainer.module} <{n_overrides} overrides> (Ray cluster of {nnodes} nodes x {gpus_per_node} GPUs)"


def plan_json(kind: str, report, lengths=None, cfg=None) -> dict:
    """The machine-readable plan of ``verl-ds4 recipe KIND --dry-run --json``; ``lengths``: what ``ds4.max_seq_len``
    derived (:class:`verl_ds4.recipes.seq_cp.Derivation`; None when it is unset)."""
    return {
        "recipe": kind, "trainer": report.trainer, "model": report.facts.name, "nnodes": report.nnodes,
        "gpus_per_node": report.gpus_per_node, "world_size": report.world_size, "max_seq_len": report.max_seq_len,
        "engines": {r.role: {"tp": r.tp, "pp": r.pp, "vpp": r.vpp, "cp": r.cp, "ep": r.ep, "etp": r.etp,
                             "budgets": {b.key: b.tokens_per_gpu for b in r.budgets}} for r in report.roles},
        "lengths": _lengths_json(cfg, report.trainer, lengths) if cfg is not None else None,
        "memory": report.memory.as_dict() if report.memory is not None else None,
        "errors": [str(p) for p in report.errors], "warnings": [str(p) for p in report.warnings],
        "valid": not report.errors,
    }


def _lengths_json(cfg, trainer: str, lengths) -> dict:
    """The lengths the trainer reads and what ``ds4.max_seq_len`` derived (overrides, CP and the peaks per CP judged)."""
    from omegaconf import OmegaConf

    keys = ["data.max_length"] if trainer == "sft" else [
        "data.max_prompt_length", "data.max_response_length", "actor_rollout_ref.rollout.max_model_len"]
    out = {"max_seq_len": OmegaConf.select(cfg, "ds4.max_seq_len"), **{k: OmegaConf.select(cfg, k) for k in keys}, "derived": None}
    if lengths is not None and lengths.n is not None:
        out["derived"] = lengths.as_dict()
    return out


def run(args: argparse.Namespace) -> int:
    from verl_ds4.recipes.compose import compose_recipe
    from verl_ds4.recipes.plan import format_plan
    from verl_ds4.recipes.validate import RecipeValidationError, validate_recipe

    overrides = list(args.overrides or [])
    # Flags given after KIND land in the remainder; Hydra overrides never start with "--".
    while overrides and overrides[0] in ("--dry-run", "--shell-env", "--json"):
        setattr(args, overrides.pop(0)[2:].replace("-", "_"), True)
    if overrides and overrides[0] == "--":
        overrides = overrides[1:]
    if getattr(args, "json", False) and not args.dry_run:
        print(f"verl-ds4 recipe {args.kind}: --json prints the dry-run plan; expected --dry-run with it. Fix: add --dry-run "
              "(a launch validates with the table on stderr).", file=sys.stderr)
        return 2
    trainer = TRAINERS[args.kind]
    from verl_ds4.recipes.override_keys import check_added_keys, compose_without_added, explain_compose_error

    def compose(ovs: list[str]):
        return compose_recipe(args.kind, ovs)

    try:
        cfg = compose(overrides)
    except Exception as e:  # Hydra composition errors name the bad override themselves; a hint follows an unknown key.
        hint = explain_compose_error(e, compose, overrides)
        hint = f"\nverl-ds4 recipe {args.kind}: {hint}" if hint else ""
        print(f"verl-ds4 recipe {args.kind}: cannot compose the config: {e}{hint}", file=sys.stderr)
        return 1
    try:
        report = validate_recipe(cfg, trainer.kind, dry_run=args.dry_run, raise_on_error=False)
    except RecipeValidationError as e:
        print(str(e), file=sys.stderr)
        return 1
    unread, on_purpose = check_added_keys(compose_without_added(compose, overrides, cfg), cfg, overrides)
    report.errors[:0] = unread
    report.notes += on_purpose
    from omegaconf import OmegaConf

    from verl_ds4.recipes.compose import derivation

    lengths = derivation(args.kind, overrides) if OmegaConf.select(cfg, "ds4.max_seq_len") is not None else None
    derived = list(lengths.overrides) if lengths else []
    if lengths:
        report.errors[:0] = lengths.problems  # a CP that cannot hold ds4.max_seq_len at peak (verl_ds4/recipes/seq_cp.py)
        if lengths.describe():
            report.notes.append(lengths.describe())
    if derived:
        report.notes.append(f"ds4.max_seq_len derived (a key you set is kept): {' '.join(derived)}")
    if getattr(args, "json", False):
        print(json.dumps(plan_json(args.kind, report, lengths, cfg), indent=1))
        return 1 if report.errors else 0
    plan = format_plan(cfg, report, launch_line(args.kind, report.nnodes, report.gpus_per_node, len(overrides)))
    if args.dry_run:
        print("(dry-run: composed and validated without GPUs; nothing was launched)")
        print(plan)
    else:
        print(plan, file=sys.stderr)
    if report.errors:
        print(
            f"verl-ds4 recipe {args.kind}: configuration rejected ({len(report.errors)} errors above).",
            file=sys.stderr,
        )
        return 1
    if args.shell_env and not args.dry_run:
        print(f"NNODES={report.nnodes}")
        print(f"GPUS_PER_NODE={report.gpus_per_node}")
        print(f"DS4_DERIVED_OVERRIDES=({' '.join(shlex.quote(o) for o in derived)})")
    return 0
