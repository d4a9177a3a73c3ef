"""``verl-ds4 verify --engine production --cp N``: the proofs of the CP parity run on the code a GPU run executes.

The production model is Megatron-LM ``dev``'s DeepSeek-V4 built by Megatron-Bridge's provider with verl's overrides
(:mod:`verl_ds4.verify.production`), on a CPU with the substitutes of :mod:`verl_ds4.substitutes.registry`. From the
harness's seeded tiny DS4 (its weights written as a DeepSeek-native folder) it prints three tables:

1. **CP = N vs CP = 1, MTP and indexer loss off**: loss, log-probs, entropy, every gradient group, critic values and
   gradients (fp64, <= ``--fp64-rtol``); DS4 attention refuses zigzag rows, and zigzag rows labelled contiguous give
   other log-probs (the control);
2. **CP = N vs CP = 1, the harness's defaults** (MTP depth 1, indexer loss 1e-2), with verl-ds4's two corrections
   that a GPU run also gets (the real lengths in ``cu_seqlens_q`` and the MTP loss's CP share; docs/verify-cp.md,
   "The production model"): every quantity, the MTP and indexer losses' gradients included;
3. **the production model vs verl-ds4's own model at CP = 1** on the same weights (the own model runs in a child
   interpreter on the released megatron-core): loss, log-probs, entropy, indexer loss, and the gradients of the
   parameters both models name alike; so every proof made on the own model (32k tokens, CP 8, replay) carries over
   up to the difference shown.

Exit 0 when all three tables pass.
"""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

__all__ = ["run"]

#: Batch of the production proofs: ragged lengths that straddle rank boundaries at CP 2 and 4.
BATCH = (5, 127, 300, 23, 129, 55)


def _own_reference(cfg, seed: int, folder: str, timeout: float) -> dict:
    """verl-ds4's own model at CP = 1 on the harness batch, from an interpreter on the released megatron-core."""
    from verl_ds4.verify.production import released_megatron_env

    out = Path(folder) / "own_cp1.pkl"
    args = json.dumps({"cfg": cfg, "seed": seed, "batch": list(BATCH), "out": str(out)})
    done = subprocess.run([sys.executable, "-m", "verl_ds4.verify.production_weights", "--own-parity", args],
                          env=released_megatron_env(), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"verl-ds4's own model at CP=1 failed (exit {done.returncode}): {done.stderr[-2000:]}")  # error-catalogue: passes on the child's own error
    with open(out, "rb") as f:
        return pickle.load(f)


def _own_name(name: str) -> str:
    """A production parameter name as verl-ds4's own model names it (where the two name the same tensor)."""
    name = name.removeprefix("gpt.")
    name = name.replace("self_attention_hyper_connection", "attn_hc").replace("mlp_hyper_connection", "mlp_hc")
    return name.replace("hc_head_fn", "hc_head.head_fn").replace("hc_head_base", "hc_head.base").replace(
        "hc_head_scale", "hc_head.scale")


def compare_with_own(production: dict, own: dict, tol: float) -> list:
    """Rows: the production model at CP = 1 vs verl-ds4's own model at CP = 1 (same weights, same batch)."""
    from verl_ds4.verify.table import Row, group_diff, max_diff

    rows = []
    for q in ("loss", "log_probs", "entropy", "indexer_loss"):
        if q in production and q in own:
            rows.append(Row(f"production vs own model: {q}", *max_diff(production[q], own[q]), tol))
    ours = {_own_name(n): g for n, g in production["grads"].items()}
    common = sorted(set(ours) & set(own["grads"]))
    d_abs, d_rel, n, without = group_diff({k: ours[k] for k in common}, {k: own["grads"][k] for k in common})
    rows.append(Row(f"production vs own model: grads ({n} params named alike of {len(ours)})", d_abs, d_rel, tol))
    return rows


def run(args: argparse.Namespace) -> int:
    problems = []
    if args.model != "ds4":
        problems.append(f"--model {args.model}: the production engine builds DeepSeek-V4 (ds4) only; V4.1's GPU path is verl-ds4's own model")
    if args.device != "cpu" or args.hf_checkpoint is not None or args.seq_len is not None or args.indexer_replay != "off":
        problems.append("--device / --hf-checkpoint / --seq-len / --indexer-replay belong to --engine own (drop them)")
    if args.sparse_core != "dense" or (args.dtype and list(args.dtype) != ["fp64"]):
        problems.append("--engine production runs fp64 with Megatron's own sparse attention (drop --sparse-core / --dtype)")
    if args.cp is None or args.cp < 1:
        problems.append("give --cp N >= 1 (CP=N is compared with CP=1)")
    if problems:
        print("verify --engine production: " + "; ".join(problems), file=sys.stderr)
        return 2
    from verl_ds4.substitutes import megatron_dev
    from verl_ds4.verify.production import require_bridge

    try:
        require_bridge()
        tree = megatron_dev.find(args.megatron_commit or megatron_dev.DEFAULT_COMMIT)
        megatron_dev.use(tree)
    except (RuntimeError, megatron_dev.MegatronDevError) as err:
        print(f"verify --engine production: {err}", file=sys.stderr)  # error-catalogue: passes on a message catalogued where it is built
        return 2
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    from verl_ds4.verify.parity import RunOptions, _ds4_config, compare, format_table, rows_passed, run_parity
    from verl_ds4.verify.production import write_harness_folder

    start = time.perf_counter()
    tol = {"fp64": args.fp64_rtol}
    full_cfg = _ds4_config(args.config)
    exact_cfg = {**full_cfg, "num_nextn_predict_layers": 0}
    batches = {"ragged": BATCH}
    tables, ok = [], True
    for title, cfg, coeff, layouts in (("MTP and indexer loss off", exact_cfg, 0.0, True),
                                       ("MTP depth 1, indexer loss 1e-2", full_cfg, None, False)):
        folder = write_harness_folder(cfg, args.seed)
        try:
            opts = RunOptions(indexer_loss_coeff=coeff, production_folder=folder)
            common = dict(dtypes=("fp64",), cfg=cfg, seed=args.seed, timeout=args.timeout, model="production", batches=batches)
            print(f"verify --engine production: {title}: CP=1 and CP={args.cp} ...", file=sys.stderr, flush=True)
            reference = run_parity(1, layout_checks=False, options=opts, **common)
            result = run_parity(args.cp, layout_checks=layouts and not args.no_layout_checks, options=opts, **common)
            rows = compare(result, reference, tolerances=tol)
            ok = ok and rows_passed(rows)
            tables.append((f"Production model (Megatron-LM dev {tree.short} via Megatron-Bridge): CP={args.cp} vs CP=1, {title}", rows))
            if not layouts:  # the full model: also against the own model at CP 1
                print("verify --engine production: the own model at CP=1 on the same weights ...", file=sys.stderr, flush=True)
                own = _own_reference(cfg, args.seed, folder, args.timeout)
                rows = compare_with_own(reference.results[("fp64", "ragged")], own, args.fp64_rtol)
                ok = ok and rows_passed(rows)
                tables.append(("Production model vs verl-ds4's own model, CP=1, same weights", rows))
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # the weights and the own model's results: this case's only
    for title, rows in tables:
        print(format_table(rows, title, notes=[
            "rel = max|x - x_ref| / max|x_ref| (a gradient group: over all its parameters); fp64 on gloo ranks.",
            f"Batch: {len(BATCH)} sequences {list(BATCH)} (they straddle rank boundaries)."]))
    elapsed = time.perf_counter() - start
    print(f"{'PASSED' if ok else 'FAILED'} in {elapsed:.1f} s (Megatron-LM dev {tree.commit})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engine": "production", "cp": args.cp, "megatron_commit": tree.commit, "passed": ok, "seconds": elapsed,
                       "tables": [{"title": t, "rows": [{"quantity": r.quantity, "max_abs": r.max_abs, "max_rel": r.max_rel,
                                                          "tol": r.tol, "expect": r.expect, "passed": r.passed} for r in rows]}
                                  for t, rows in tables]}, f, indent=2)
    return 0 if ok else 1


def own_parity(spec: dict) -> None:
    """Child side of :func:`_own_reference`: run verl-ds4's own model at CP = 1 and pickle its results."""
    from verl_ds4.verify.parity import run_parity

    result = run_parity(1, dtypes=("fp64",), model="ds4", cfg=spec["cfg"], seed=int(spec["seed"]),
                        batches={"ragged": tuple(spec["batch"])}, layout_checks=False)
    out = result.results[("fp64", "ragged")]
    with open(spec["out"], "wb") as f:
        pickle.dump({k: v for k, v in out.items() if k in ("loss", "log_probs", "entropy", "indexer_loss", "mtp_loss", "grads")}, f)
    assert np.isfinite(out["loss"]).all()
