"""Plan a DS4 run: a micro-batch's CP layout, or (with --fit) the meshes a model fits on.

Layout (default): given sequence lengths, the CP size and the layout, print each CP rank's rows,
padding, cost and the straggler ratio (see the options below; --balance, --plot).
    verl-ds4 plan --lengths 5,127,1000,23 --cp 2 --min-local-rows 128

Fit (--fit): given a model (flash, pro, v41_flash, or a config.json / HF folder), a GPU type and a GPU count
or range, list the TP=1 meshes (PP, EP, CP, DP) on which every role's peak (states + activations for the
attention kernel path and recompute + the peak moment + margins: the memory model of `verl-ds4 recipe
--dry-run`, verl_ds4/memory/peak.py) stays under the GPU less the headroom, fewest GPUs first, then the
lowest peak, with each role's peak; when none fits, the closest meshes and the levers that bring them under.
    verl-ds4 plan --fit --model flash --gpu H200 --gpus 64
    verl-ds4 plan --fit --model pro --gpu GB300 --gpus 128-512 --recipe grpo --json
"""

from __future__ import annotations

import argparse
import json
import sys

from verl_ds4.layout import plan_cli

MODELS = ("flash", "pro", "v41_flash")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    plan_cli.add_arguments(parser)
    for action in parser._actions:  # --cp is required for the layout plan only
        if action.dest == "cp":
            action.required = False
            action.help += " (layout plan: required)"
    fit = parser.add_argument_group("--fit: meshes that fit a model on a GPU type")
    fit.add_argument("--fit", action="store_true", help="list the meshes that fit instead of a layout plan")
    fit.add_argument("--model", default="flash", help="flash, pro, v41_flash, or a config.json / HF model folder (default flash)")
    fit.add_argument("--gpu", help="GPU type: H100-80GB, H200, B200, GB200, GB300")
    fit.add_argument("--gpu-memory-gib", type=float, help="GiB per GPU (instead of, or to correct, --gpu)")
    fit.add_argument("--gpus", help="GPU count or range, e.g. 64 or 32-256 (multiples of --gpus-per-node)")
    fit.add_argument("--gpus-per-node", type=int, help="GPUs per node (default 4 on GB200/GB300, else 8)")
    fit.add_argument("--recipe", choices=("sft", "ppo", "grpo"), default="sft", help="sft (MTP on) or RL (no MTP, rollout shown)")
    fit.add_argument("--mtp", choices=("on", "off"), help="override the recipe's MTP (sft: on, RL: off)")
    fit.add_argument("--headroom", type=float, default=None, help="fraction of each GPU a role's peak must leave free (default 0.1, the start-up check's)")
    fit.add_argument("--tokens-per-gpu", type=int, default=4096, help="training token budget per GPU (rows per micro-batch after CP; default 4096)")
    fit.add_argument("--infer-tokens-per-gpu", type=int, help="RL forward-only budget (log-probs, reference; default 2 x --tokens-per-gpu)")
    fit.add_argument("--max-seq-len", type=int, help="longest sequence; CP must make budget x CP hold it (default: the budget)")
    fit.add_argument("--kernel", choices=("unfused", "fused", "linear"),
                     help="DS4 attention kernel path: unfused (Megatron's core), linear (dsa_kernel_backend none with "
                          "ds4.sparse_attention=linear, memory linear in tokens) or fused (cudnn); default: unfused on "
                          "H100/H200, fused on B200/GB200/GB300")
    fit.add_argument("--logits", choices=("fused", "unfused"),
                     help="what computes the logits step: fused (verl's Triton kernel, use_fused_kernels) or unfused (the "
                          "[T, V] logits); default the recipe's: fused for ppo / grpo on V4 without MTP, else unfused")
    fit.add_argument("--recompute", choices=("full", "selective", "none"), default="full",
                     help="full (default), selective (moe_act, mhc) or none")
    fit.add_argument("--states-only", action="store_true", help="judge weights + gradients + optimizer alone (not the peak)")
    fit.add_argument("--check-activations", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old command lines
    fit.add_argument("--max", type=int, default=12, help="list at most this many meshes (default 12)")
    fit.add_argument("--json", action="store_true", help="print JSON (all fitting meshes) instead of a table")


def _gpu_counts(text: str, per_node: int) -> list[int]:
    lo, _, hi = text.partition("-")
    lo_n, hi_n = int(lo), int(hi or lo)
    if lo_n < 1 or hi_n < lo_n:
        raise ValueError(f"--gpus {text!r}: expected N or LO-HI with 1 <= LO <= HI.")
    counts = [n for n in range(lo_n, hi_n + 1) if n % per_node == 0]
    if not counts:
        raise ValueError(f"--gpus {text!r} holds no multiple of {per_node} GPUs per node; widen the range or set --gpus-per-node.")
    return counts


def _sizes(model: str):
    from importlib.resources import files

    import yaml

    from verl_ds4 import ds41_facts
    from verl_ds4.models.ds4.provider import load_model_facts
    from verl_ds4.models.ds41.provider import DS41ModelFacts, is_v41_block, load_ds41_model_facts

    name = model if model in MODELS else "flash"
    block = yaml.safe_load((files("verl_ds4.configs_data") / "ds4_model" / f"{name}.yaml").read_text())
    if model in MODELS:
        load = load_ds41_model_facts if is_v41_block(block) else load_model_facts
        facts = load(None, block, f"configs/ds4_model/{model}.yaml")
    else:
        import os

        from verl_ds4.models.ds4.provider import DS4ModelFacts

        path = os.path.join(model, "config.json") if os.path.isdir(model) else model
        if not os.path.isfile(path):
            raise ValueError(f"--model {model!r}: expected {', '.join(MODELS)}, a config.json or a folder holding one.")
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        if ds41_facts.check_model_type(config, "ds41") is None:
            facts = DS41ModelFacts.from_config(config, path, "DeepSeek-V4.1")
            if facts.violations:
                raise ValueError("; ".join(v.engine_message() for v in facts.violations))  # error-catalogue: passes on ds41_facts Violations, sites where they are built
        else:
            facts = DS4ModelFacts.from_hf_config(config, path, DS4ModelFacts.from_recipe_block(block, "flash.yaml"))
    if facts.sizes is None:
        raise ValueError(facts.sizes_missing)
    return facts


def run_fit(args: argparse.Namespace) -> int:
    from verl_ds4.memory.fit import DEFAULT_HEADROOM, find_meshes
    from verl_ds4.memory.kernels import GPU_ARCH
    from verl_ds4.memory.stages import gpu_memory_gib

    if not args.gpus or not (args.gpu or args.gpu_memory_gib):
        raise ValueError("--fit needs --gpus N (or LO-HI) and --gpu TYPE (or --gpu-memory-gib GiB).")
    capacity = gpu_memory_gib(args.gpu, args.gpu_memory_gib)
    per_node = args.gpus_per_node or (4 if (args.gpu or "").startswith("GB") else 8)
    facts = _sizes(args.model)
    headroom = DEFAULT_HEADROOM if args.headroom is None else args.headroom
    mtp = None if args.mtp is None else args.mtp == "on"
    arch = GPU_ARCH.get(args.gpu or "")
    kernel = args.kernel or ("fused" if arch == "sm100" else "unfused")
    recompute = {"full": None, "selective": frozenset({"moe_act", "mhc"}), "none": frozenset()}[args.recompute]
    mtp_on = (args.recipe == "sft") if mtp is None else mtp
    v41 = bool(getattr(facts.sizes, "roles", ()))  # the V4.1 recipes keep verl's non-fused logits
    logits = args.logits or ("fused" if args.recipe != "sft" and not mtp_on and not v41 else "unfused")
    if logits == "fused" and mtp_on:
        raise ValueError("--logits fused with MTP on: verl 0.9.1 runs MTP only on the non-fused path; use --logits unfused or --mtp off.")
    rows = find_meshes(
        facts.sizes, capacity, _gpu_counts(args.gpus, per_node), recipe=args.recipe, mtp=mtp, headroom=headroom,
        tokens_per_gpu=args.tokens_per_gpu, infer_tokens_per_gpu=args.infer_tokens_per_gpu, max_seq_len=args.max_seq_len,
        path=kernel, recompute=recompute, check_activations=not args.states_only, gpus_per_node=per_node, arch=arch,
        levers_for=args.max, logits_kernel=logits,
    )
    fits = [r for r in rows if r.fits]
    settings = {"kernel": kernel, "logits": logits, "recompute": args.recompute, "tokens_per_gpu": args.tokens_per_gpu,
                "infer_tokens_per_gpu": args.infer_tokens_per_gpu or 2 * args.tokens_per_gpu,
                "max_seq_len": args.max_seq_len or args.tokens_per_gpu, "judged_on": "states" if args.states_only else "peak"}
    if args.json:
        print(json.dumps({"model": facts.name, "gpu": args.gpu, "capacity_gib": capacity, "headroom": headroom,
                          "recipe": args.recipe, **settings, "meshes": [f.as_dict() for f in fits],
                          "not_fitting": [f.as_dict() for f in rows if not f.fits][: args.max]}, indent=1))
        return 0 if fits else 1
    _print_fit(args, facts, capacity, headroom, settings, rows, fits, mtp)
    return 0 if fits else 1


def _print_fit(args, facts, capacity, headroom, settings, rows, fits, mtp) -> None:
    s = facts.sizes
    mtp_on = (args.recipe == "sft") if mtp is None else mtp
    mtp_on = mtp_on and s.mtp_layers > 0
    extra = f" incl. {s.engram_tables() / 1e9:.2f}B Engram tables" if hasattr(s, "engram_tables") else ""
    print(f"{facts.name}: {s.total() / 1e9:.2f}B parameters{extra} ({s.activated() / 1e9:.2f}B activated), MTP {'on' if mtp_on else 'off'}; "
          f"{args.gpu or 'GPU'} {capacity:.1f} GiB; fits = every role's {settings['judged_on']} <= {1 - headroom:.2f} x GPU "
          f"= {(1 - headroom) * capacity:.1f} GiB (headroom {headroom:g})")
    print(f"  {settings['kernel']} attention, recompute {settings['recompute']}, {settings['tokens_per_gpu']} tokens per GPU"
          + (f" (forward passes {settings['infer_tokens_per_gpu']})" if args.recipe != "sft" else "")
          + f", longest sequence {settings['max_seq_len']}, {settings['logits']} logits")
    if not fits:
        print(f"no TP=1 mesh fits on {args.gpus} GPUs at these settings; the closest, with the changes that fit:")
    roles = list(rows[0].peaks) if rows else []
    header = ["GPUs", "PP", "EP", "CP", "DPxCP", "eDP", "states"] + [f"{r} peak" for r in roles] + ["fits"] + \
        ([] if args.recipe == "sft" else ["rollout"])
    table = [header]
    shown = (fits or rows)[: args.max]
    for f in shown:
        m = f.mesh
        row = [str(m.world), str(m.pp), str(m.ep), ",".join(map(str, f.cps)), str(f.dp), str(m.expert_dp), f"{f.states_gib:.1f}"]
        row += [f"{f.peaks[r][1].peak_gib:.1f}" for r in roles] + ["yes" if f.fits else "NO"]
        if args.recipe != "sft":
            row.append("none fits" if f.rollout is None else f.rollout.cell())
        table.append(row)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        print("  " + "  ".join(c.rjust(wd) for c, wd in zip(r, widths)))
    if len(fits) > args.max:
        print(f"  ... {len(fits) - args.max} more (--max, or --json for all)")
    for f in shown:
        if f.levers:
            m = f.mesh
            print(f"  PP{m.pp}/EP{m.ep} on {m.world} GPUs ({f.worst_role} peak {f.peak_gib:.1f}): " + "; ".join(f.levers))
    print("per GPU, GiB, on each role's highest pipeline stage and pass (verl_ds4/memory/peak.py; docs/memory.md); "
          "CP: the sizes that hold the longest sequence at this budget and divide DP x CP.")
    if args.recipe != "sft":
        print("rollout: the smallest TP whose weights (GiB per GPU) and one longest sequence's KV cache fit vLLM's share, and "
              "how many such sequences one engine holds at once (the recipe's max_num_seqs must not ask for more).")


def run(args: argparse.Namespace) -> int:
    if args.fit:
        try:
            return run_fit(args)
        except ValueError as e:
            print(f"verl-ds4 plan --fit: {e}", file=sys.stderr)  # error-catalogue: prefixes the message of the error it caught, catalogued where raised
            return 2
    if args.cp is None:
        print("verl-ds4 plan: --cp is required for a layout plan (or use --fit to find meshes).", file=sys.stderr)
        return 2
    return plan_cli.run(args)
