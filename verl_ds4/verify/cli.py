"""Prove context-parallel parity of the DS4 data path with the full tiny DeepSeek-V4 (CPU, or GPUs with --device cuda).

Runs the CPU jobs' tiny DS4 (``--model ds4``, default: a Megatron-Core GPTModel with mHC, DS4
hybrid attention (sliding, CSA and HCA layers) and the DS4 MoE with a hash layer; or
``--model ds4_proxy``, the attention-only proxy) at CP = 1 and at CP = N on N gloo processes,
through verl-ds4's THD pre/post-processing with the contiguous layout, and compares the loss,
per-token log-probs, entropy, the MTP loss (one MTP depth), the indexer loss (coefficient 1e-2),
the gradients of every parameter group (mtp included), critic values and value-loss gradients
against CP = 1. At CP > 1 it also checks that DS4 attention rejects zigzag rows, that with that
guard bypassed the log-probs differ, that hash ids packed one row off make them differ too, and
that an MTP roll across sequence ends changes the MTP gradients (negative controls).

Prints a table (quantity, max abs diff, max rel diff, pass/fail); exits 1 on any failure.

With ``--hf-checkpoint DIR`` it instead compares our Megatron DS4 loaded from an HF DeepSeek-V4
folder with transformers' ``DeepseekV4ForCausalLM`` at fp64 (:mod:`verl_ds4.verify.hf`) and
prints the max relative errors of logits and per-token log-probs; a folder refused (not DS4, a config
the model cannot read, a tensor that does not fit) exits 2 with the reason and the fix.

With ``--model ds41 --cp N`` it runs one training step of the tiny DeepSeek-V4.1 in Megatron-Core
(every component on) at CP = 1 and N through the same THD path and compares, at fp64, CP = N with
CP = 1 (loss, log-probs, entropy, gradients per group: the Full / Reindex / Reuse / window-only
layers' attention, Engram tables, the rest) and both with NeMo Automodel's V4.1 (logits, log-probs,
loss, gradients); V4.1 has no indexer loss (its indexer is frozen) and the DSpark rows say "not
built" until the drafter's training exists. Negative controls at CP = N that must differ or be
refused: Engram n-grams without the previous rank's tokens, reading layers that recompute the
shared CSA2 state, zigzag (:mod:`verl_ds4.verify.ds41`). Progress goes to stderr.

With ``--device cuda --cp N`` the same step runs on N GPUs (one nccl process each) in fp32 and bf16 and is
compared with CP=1 on the CPU in fp64 (:mod:`verl_ds4.verify.device_run`): bf16 replays the reference's
expert choices and keeps every indexer block; the negative controls run on the GPUs at N > 1.

With ``--seq-len N`` the batch is one N-token sequence between short ones, spread over every CP rank (long-context
parity, :mod:`verl_ds4.verify.seqlen`; V4.1: NeMo Automodel's rows up to ``N`` = 4096,
:data:`verl_ds4.verify.ds41.NEMO_MAX_TOKENS`); ``--indexer-replay on|both`` runs the training step with the indexer's
recorded top-k replayed (DS4; V4.1 with --model ds41), with a negative control.

Examples:  verl-ds4 verify --cp 8
           verl-ds4 verify --cp 8 --seq-len 8192 --indexer-replay both [--sparse-core linear]
           verl-ds4 verify --device cuda --cp 1       (one GPU; --cp 8 on eight)
           verl-ds4 verify --hf-checkpoint path/to/ds4 --cp 2
           verl-ds4 verify --model ds41 --cp 4
           verl-ds4 verify --engine production --cp 2   (Megatron-LM dev's DS4 via Megatron-Bridge: the GPU path's code)
           verl-ds4 verify --model ds41 --cp 8 --seq-len 32768 --indexer-replay both
           verl-ds4 verify --model ds41 --hf-checkpoint path/to/v41 --cp 2   (verl_ds4.verify.ds41_hf: our
               Megatron V4.1 from a V4.1 folder vs NeMo Automodel reading the same folder, fp64)
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cp", type=int, default=None, metavar="N", help="context-parallel size to compare with CP=1 (e.g. 2, 4, 8); with --hf-checkpoint the CP size of our model (default 1)")
    parser.add_argument("--hf-checkpoint", default=None, metavar="DIR", help="compare our Megatron DS4 loaded from this HF DeepSeek-V4 folder with transformers at fp64 (with --model ds41: a DeepSeek-V4.1 folder with NeMo Automodel)")
    parser.add_argument("--allow-mtp-skip", action="store_true", help="with --hf-checkpoint: build no MTP block and ignore the folder's mtp.* tensors (transformers drops them too; the logits are the same)")
    parser.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"],
        help="cpu (default): CP=N vs CP=1 on gloo processes; cuda: CP=N on N GPUs (nccl) vs CP=1 on the CPU in fp64 "
        "(--model ds4 / ds4_proxy; default --dtype fp32 bf16; verl_ds4.verify.device_run)",
    )
    parser.add_argument(
        "--dtype", nargs="+", default=None, choices=["fp64", "fp32", "bf16"],
        help="precisions to run (cpu default: fp64; add fp32 for the fp32 table, about twice the time; "
        "cuda default: fp32 bf16; bf16 on cuda only)",
    )
    parser.add_argument("--fp64-rtol", type=float, default=1e-10, help="max relative difference allowed in fp64 (default 1e-10)")
    parser.add_argument("--fp32-rtol", type=float, default=1e-3, help="max relative difference allowed in fp32 (default 1e-3)")
    parser.add_argument("--bf16-rtol", type=float, default=2e-1, help="--device cuda: max relative difference of bf16 from the fp64 reference (default 0.2)")
    parser.add_argument(
        "--model", default="ds4", choices=["ds4", "ds4_proxy", "ds41"],
        help="ds4: the full tiny DS4 (default); ds4_proxy: the attention-only proxy; ds41: the tiny DeepSeek-V4.1 in "
        "Megatron-Core, one training step at CP=N vs CP=1 and vs NeMo Automodel at fp64, with negative controls",
    )
    parser.add_argument(
        "--sparse-core", choices=("dense", "linear"), default="dense",
        help="the DS4 / V4.1 attention's sparse softmax in the CP=N run (ds41: in every run of ours): dense (every key, "
        "masked: the reference) or linear (verl_ds4.kernels.linear_sparse_attn, what ds4.sparse_attention=linear runs); "
        "the CP=1 reference stays dense, so linear is compared with it (default dense)",
    )  # fmt: skip
    parser.add_argument(
        "--seq-len", type=int, default=None, metavar="N",
        help="long-context parity: the batch is one sequence of N tokens (its longest) between short ones (5, 300 before; "
        "37, 129, 3 after; each clipped to N), so at CP=8 and N=32768 it spreads over every rank, its compressed blocks "
        "and top-k choices cross rank boundaries and every rank but the first exchanges its halo inside it; --model ds4 "
        "or ds41; N >= 2 and, at CP > 1, N >= cp x the model's minimum rows per rank (ds4: 128, ds41: 4). The tiny "
        "models' max_position_embeddings (4096) is raised to N for the run (said on stderr); a --config's is not (N above "
        "it is refused). ds41: NeMo Automodel's reference runs up to N = 4096 (above: CP=N vs CP=1 only). Time and "
        "memory: docs/verify-cp.md",
    )  # fmt: skip
    parser.add_argument(
        "--indexer-replay", choices=("off", "on", "both"), default="off",
        help="--model ds4 or ds41: on: the actor records its indexer's top-k in a no-grad forward and the training step "
        "replays those ids (verl_ds4.mcore.indexer_replay, as indexer_replay=true trains); both: every batch (ds41: every "
        "step) twice, native and replayed; with a negative control at CP > 1 (replaying other valid blocks must change the "
        "log-probs). Default off",
    )  # fmt: skip
    parser.add_argument(
        "--engine", choices=("own", "production"), default="own",
        help="own (default): verl-ds4's own DS4 model; production: Megatron-LM dev's DS4 built by Megatron-Bridge's "
        "provider as a GPU run builds it (Python 3.12 with megatron-bridge 0.6.2 and a Megatron-LM dev export; CPU "
        "substitutes for the GPU-only pieces): CP=N vs CP=1 and vs the own model on the same weights, fp64 "
        "(verl_ds4.verify.production_cli)",
    )  # fmt: skip
    parser.add_argument("--megatron-commit", default=None, metavar="SHA",
                        help="--engine production: the Megatron-LM dev commit to import (default: the image's pin; "
                        "a proven one only: verl_ds4.substitutes.megatron_dev.PROVEN_COMMITS)")
    parser.add_argument("--config", default=None, help="ds4: a DeepseekV4 config.json (path or JSON; default: the CPU jobs' tiny DS4); ds4_proxy: proxy sizes as JSON")
    parser.add_argument("--seed", type=int, default=1234, help="seed for weights and the batch (default 1234)")
    parser.add_argument("--no-layout-checks", action="store_true", help="skip the zigzag rejection / guard-bypass rows (ds41: all negative controls)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON to PATH")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a hung rank is killed (default 600)")


def _run_hf(args: argparse.Namespace) -> int:
    from verl_ds4.verify.hf import compare_with_transformers

    cp = args.cp or 1
    try:
        result = compare_with_transformers(args.hf_checkpoint, cp=cp, seed=args.seed, allow_mtp_skip=args.allow_mtp_skip)
    except ValueError as e:  # the folder refused (model_type, config, a tensor): the message names the fix
        print(f"verify --hf-checkpoint: {e}", file=sys.stderr)  # error-catalogue: passes on a message catalogued where it is built
        return 2
    ok = result["logits"] <= args.fp64_rtol and result["log_probs"] <= args.fp64_rtol
    print(f"DS4 {args.hf_checkpoint}: our Megatron model at CP={cp} vs transformers (fp64), lengths {result['lengths']}")
    print(f"  logits     max rel error {result['logits']:.3e}  (tol {args.fp64_rtol:g})")
    print(f"  log-probs  max rel error {result['log_probs']:.3e}  (tol {args.fp64_rtol:g})")
    print(f"{'PASSED' if ok else 'FAILED'} in {result['seconds']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cp": cp, "passed": ok, **result}, f, indent=2)
    return 0 if ok else 1


def _run_ds41(args: argparse.Namespace) -> int:
    from verl_ds4.models.ds41.reference import reference_missing

    missing = reference_missing()
    if missing:
        print(f"verify --model ds41: {missing}", file=sys.stderr)
        return 2
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    from verl_ds4.verify.parity import format_table, rows_passed
    from verl_ds4.verify.ds41 import NEGATIVE_MIN_REL, print_progress, run_ds41_verify

    cp = args.cp or 1
    lengths = text = query_rows = position_note = None
    if args.seq_len is not None:
        from verl_ds4.models.ds41.reference import tiny_text_config
        from verl_ds4.verify.seqlen import QUERY_CHUNK_ROWS, bound_malloc, fit_positions, long_lengths

        lengths = long_lengths(args.seq_len)
        text, position_note = fit_positions(args.seq_len, tiny_text_config(), given=False)
        query_rows = QUERY_CHUNK_ROWS  # the CP=N run's row chunks end inside the long sequence (CP=1: its budget)
        bound_malloc()
        if position_note:
            print(f"verify: {position_note}.", file=sys.stderr)
    result = run_ds41_verify(cp, seed=args.seed, rtol=args.fp64_rtol, controls=not args.no_layout_checks, lengths=lengths,
                             timeout=args.timeout, progress=print_progress, sparse_core=args.sparse_core,
                             indexer_replay=args.indexer_replay, text=text, query_rows=query_rows)  # fmt: skip
    rows = result["rows"]
    ok = rows_passed(rows)
    notes = [
        "rel = max|x - x_ref| / max|x_ref| (a gradient group: worst abs diff over its tensors / its largest gradient); "
        "grads summed over CP ranks; the indexer is frozen on both sides.",
        f"Batch: {len(result['lengths'])} sequences, {sum(result['lengths'])} tokens {result['lengths']} (ragged: they cross "
        f"every rank boundary); a control differs when rel > {NEGATIVE_MIN_REL:g}.",
    ]
    if query_rows:
        notes.append(f"CP > 1: {query_rows} query rows per chunk of the CSA2 layers' per-query work (CP 1: its 64 MiB budget).")
    if position_note:
        notes.append(position_note[0].upper() + position_note[1:] + ".")
    title = f"DeepSeek-V4.1 (tiny, every component on) in Megatron-Core: CP={cp} vs CP=1 and vs NeMo Automodel (fp64, {args.sparse_core} sparse core)"
    print(format_table(rows, title, notes=notes))
    print(f"{'PASSED' if ok else 'FAILED'} in {result['seconds']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": "ds41",
                    "cp": cp,
                    "sparse_core": args.sparse_core,
                    "seq_len": args.seq_len,
                    "indexer_replay": args.indexer_replay,
                    "passed": ok,
                    "seconds": result["seconds"],
                    "stages": result["stages"],
                    "lengths": result["lengths"],
                    "rows": [
                        {"quantity": r.quantity, "max_abs": r.max_abs, "max_rel": r.max_rel, "tol": r.tol, "expect": r.expect, "passed": r.passed}
                        for r in rows
                    ],
                },
                f,
                indent=2,
            )
    return 0 if ok else 1


def run(args: argparse.Namespace) -> int:
    if args.engine == "production":
        from verl_ds4.verify.production_cli import run as run_production

        return run_production(args)
    if args.megatron_commit is not None:
        print("verify: --megatron-commit selects the Megatron-LM dev of --engine production; add --engine production",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.device == "cuda" or (args.dtype and "bf16" in args.dtype):  # refused before any model is built
        problems = []
        if args.sparse_core != "dense":
            problems.append(f"--sparse-core {args.sparse_core} runs in the CPU harness (fp64 / fp32 on gloo ranks); drop --device cuda")
        if args.seq_len is not None or args.indexer_replay != "off":
            problems.append("--seq-len / --indexer-replay run in the CPU harness (fp64 on gloo ranks); drop --device cuda")
        if args.device != "cuda":
            problems.append("--dtype bf16 runs on --device cuda only (CPU bf16 is neither fast nor what training uses); drop bf16")
        elif args.model == "ds41" or args.hf_checkpoint is not None:
            problems.append("--device cuda runs the CP parity of --model ds4 / ds4_proxy against the fp64 CPU reference; V4.1 "
                            "on a GPU: python benchmarks/gpu/device_checks.py --checks ds41 (drop --device or the model / folder)")  # fmt: skip
        elif args.cp is None or args.cp < 1:
            problems.append("--device cuda needs --cp N >= 1 (N GPUs, one CP rank each)")
        else:
            import torch

            build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            if not torch.cuda.is_available():
                problems.append(f"--device cuda: no CUDA GPU is visible (torch {torch.__version__}, {build}: "
                                "torch.cuda.is_available() is False). Run on a GPU machine, or use --device cpu.")  # fmt: skip
            elif args.cp > torch.cuda.device_count():
                problems.append(f"--device cuda --cp {args.cp}: {torch.cuda.device_count()} CUDA GPU(s) visible, and each CP "
                                f"rank needs its own GPU. Give --cp {torch.cuda.device_count()} or less, or make more GPUs "
                                "visible (CUDA_VISIBLE_DEVICES).")  # fmt: skip
        if problems:
            print("verify (--device, --dtype): " + "; ".join(problems), file=sys.stderr)
            return 2
        from verl_ds4.verify.device_run import run_cli

        return run_cli(args)
    args.dtype = args.dtype or ["fp64"]
    if args.model == "ds41" and args.hf_checkpoint is not None:  # a DeepSeek-V4.1 folder: verl_ds4.verify.ds41_hf
        from verl_ds4.verify.ds41_hf import run_cli

        return run_cli(args)

    if args.model == "ds41":
        problems = []
        if args.cp is not None and args.cp < 1:
            problems.append(f"--cp {args.cp}: give N >= 1 (CP=N is compared with CP=1 and NeMo Automodel)")
        if list(args.dtype) != ["fp64"]:
            problems.append(f"--dtype {' '.join(args.dtype)}: --model ds41 runs in fp64 only (drop --dtype)")
        if args.config is not None:
            problems.append("--config: --model ds41 uses the tiny V4.1 of verl_ds4.models.ds41.reference.tiny_text_config (drop --config)")
        if args.allow_mtp_skip:
            problems.append("--allow-mtp-skip: only with --hf-checkpoint (drop it)")
        if args.seq_len is not None:
            from verl_ds4 import ds41_facts
            from verl_ds4.models.ds41.reference import tiny_text_config
            from verl_ds4.verify.seqlen import check_seq_len

            try:
                check_seq_len(args.seq_len, args.cp or 1, ds41_facts.min_local_rows(tiny_text_config()))
            except ValueError as err:
                problems.append(str(err))
        if problems:
            print("verify --model ds41: " + "; ".join(problems), file=sys.stderr)
            return 2
        return _run_ds41(args)
    if args.hf_checkpoint is not None and (args.seq_len is not None or args.indexer_replay != "off"):
        print("verify --hf-checkpoint: --seq-len and --indexer-replay belong to the CP parity run (--cp N without "
              "--hf-checkpoint); drop them", file=sys.stderr)  # fmt: skip
        return 2
    if args.hf_checkpoint is not None:
        if args.cp is not None and args.cp < 1:
            print(f"verify: --cp must be >= 1, got {args.cp}", file=sys.stderr)
            return 2
        return _run_hf(args)
    if args.cp is None:
        print("verify: give --cp N (CP parity of the tiny DS4) or --hf-checkpoint DIR", file=sys.stderr)
        return 2
    if args.cp < 1:
        print(f"verify: --cp must be >= 1, got {args.cp}", file=sys.stderr)
        return 2
    import warnings

    # Megatron-Core warns at import that TransformerEngine / Apex are absent: expected on CPU.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    from verl_ds4.verify.parity import compare, format_table, rows_passed, run_parity

    try:
        batches, notes = _batches(args)
    except ValueError as err:
        print(f"verify: {err}", file=sys.stderr)  # error-catalogue: passes on a message catalogued where it is built
        return 2
    if args.seq_len is not None:
        from verl_ds4.verify.seqlen import bound_malloc

        bound_malloc()
        if notes and "raised from" in notes[-1]:
            print(f"verify: {notes[-1][0].lower()}{notes[-1][1:]}", file=sys.stderr)
    start = time.perf_counter()
    common = dict(dtypes=tuple(args.dtype), cfg=args.config, seed=args.seed, timeout=args.timeout, model=args.model, batches=batches)
    reference = run_parity(1, layout_checks=False, **common)
    from verl_ds4.verify.parity import RunOptions

    from verl_ds4.verify.seqlen import LINEAR_CHUNK_ROWS

    chunk_rows = LINEAR_CHUNK_ROWS if args.seq_len is not None and args.sparse_core == "linear" else None
    from verl_ds4.verify.seqlen import QUERY_CHUNK_ROWS

    query_rows = QUERY_CHUNK_ROWS if args.seq_len is not None else None
    options = RunOptions(sparse_core=args.sparse_core, linear_chunk_rows=chunk_rows, query_chunk_rows=query_rows)
    result = run_parity(args.cp, layout_checks=not args.no_layout_checks, options=options, **common)
    rows = compare(result, reference, tolerances={"fp64": args.fp64_rtol, "fp32": args.fp32_rtol})
    elapsed = time.perf_counter() - start
    ok = rows_passed(rows)
    name = {"ds4": "DS4 (full tiny model)", "ds4_proxy": "DS4 proxy (attention only)"}[args.model]
    core = "" if args.sparse_core == "dense" else f", {args.sparse_core} sparse core vs the dense CP=1"
    print(format_table(rows, f"{name}: CP={args.cp} vs CP=1 ({', '.join(args.dtype)}{core})", notes=notes))
    print(f"{'PASSED' if ok else 'FAILED'} in {elapsed:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "cp": args.cp,
                    "model": args.model,
                    "sparse_core": args.sparse_core,
                    "seq_len": args.seq_len,
                    "indexer_replay": args.indexer_replay,
                    "batches": {name: list(lengths) for name, lengths in batches.items()},
                    "passed": ok,
                    "seconds": elapsed,
                    "rows": [
                        {"quantity": r.quantity, "max_abs": r.max_abs, "max_rel": r.max_rel, "tol": r.tol, "expect": r.expect}
                        for r in rows
                    ],
                },
                f,
                indent=2,
            )
    return 0 if ok else 1


def _batches(args: argparse.Namespace):
    """``(batches, table notes)`` of a DS4 CP parity run (``--seq-len``, ``--indexer-replay``); ``ValueError``: why
    the flags cannot run."""
    from verl_ds4.verify.parity import RAGGED, SHORT, _ds4_config
    from verl_ds4.verify.seqlen import LINEAR_CHUNK_ROWS, QUERY_CHUNK_ROWS, check_seq_len, fit_positions, long_lengths, replay_batches

    if args.model == "ds4_proxy" and (args.seq_len is not None or args.indexer_replay != "off"):
        raise ValueError("--seq-len / --indexer-replay run the full tiny DS4 (the proxy has no indexer and no MTP); use --model ds4")
    position_note = None
    if args.seq_len is not None:
        from verl_ds4 import ds4_facts

        cfg = _ds4_config(args.config)
        check_seq_len(args.seq_len, args.cp, ds4_facts.min_local_rows(cfg["sliding_window"], (cfg.get("compress_rates") or {}).values()))
        cfg, position_note = fit_positions(args.seq_len, cfg, given=args.config is not None)
        args.config = cfg
    if args.seq_len is None:
        base = {"ragged": RAGGED, "short": SHORT}
        notes = None
    else:
        base = {"long": long_lengths(args.seq_len)}
        lengths = base["long"]
        notes = [
            "rel = max|x_cp - x_cp1| / max|x_cp1| per quantity (for a gradient group: over all its parameters).",
            f"Batch: long = {len(lengths)} sequences {list(lengths)}, {sum(lengths)} tokens: one of {args.seq_len} tokens "
            f"(spread over the CP ranks) between short ones. CP > 1: {QUERY_CHUNK_ROWS} query rows per chunk of the compressed "
            "blocks' work (CP 1: its 64 MiB budget)." + (f" Linear core: {LINEAR_CHUNK_ROWS} query rows per chunk."
                                                               if args.sparse_core == "linear" else "") + (" +replay: the actor replays its recorded indexer choices."
                                                               if args.indexer_replay != "off" else ""),
        ] + ([position_note[0].upper() + position_note[1:] + "."] if position_note else [])  # fmt: skip
    if notes is None and args.indexer_replay != "off":  # the default notes do not name the replayed batches
        notes = [
            "rel = max|x_cp - x_cp1| / max|x_cp1| per quantity (for a gradient group: over all its parameters).",
            f"Batches: ragged = {len(RAGGED)} sequences, {sum(RAGGED)} tokens; short = {len(SHORT)} sequences, {sum(SHORT)} "
            "tokens; +replay: the actor replays its recorded indexer choices.",
        ]
    return replay_batches(base, args.indexer_replay), notes
