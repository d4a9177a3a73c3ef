"""Run verl-ds4's CP parity harness on the production model (Megatron-LM dev's DS4 built by Megatron-Bridge) and
print the tables as JSON. Run by tests/test_production_cp_parity_on_cpu.py in a subprocess, because it imports
Megatron-LM dev in place of the installed megatron-core.

usage: python tests/production_cp_parity.py COMMIT CP [CP ...]

For each CP size N: ``run_parity(N)`` twice at float64 on the harness's tiny DS4 (mHC, window / CSA-4 / HCA-128
layers, hash and learned routing; seeded weights written as a native folder):

* ``exact``: MTP off and the indexer loss off (coefficient 0): every quantity against CP = 1, and the zigzag
  refusal and its control;
* ``indexer``: MTP off, the indexer loss on (1e-2);
* ``indexer_padded``: ``indexer`` with verl's padded lengths in ``cu_seqlens_q`` (what verl 0.9.1 hands every model;
  verl-ds4's DS4 engines hand dev's DS4 the real ones), at the smallest CP: the negative control of that choice;
* ``mtp``: MTP on (depth 1), the indexer loss off;
* ``mtp_unfixed``: ``mtp`` without verl-ds4's MTP fix (:func:`verl_ds4.substitutes.upstream_fixes.
  install_mtp_cp_token_share`), at the smallest CP: the fix's negative control;
* ``full``: the harness's defaults (MTP depth 1, indexer loss 1e-2), at every CP size given;
* ``linear``: the ``indexer`` case with verl-ds4's linear sparse attention installed into dev's layers
  (``ds4.sparse_attention=linear``), against the same case with dev's own functions, at CP 1 and at the smallest CP.
"""

import dataclasses
import json
import shutil
import sys
import time

from verl_ds4.substitutes import megatron_dev


def rows(result, reference):
    from verl_ds4.verify.parity import compare

    return [dict(quantity=r.quantity, max_rel=r.max_rel, tol=r.tol, expect=r.expect, passed=r.passed)
            for r in compare(result, reference)]


def main(commit: str, cps: list[int]) -> dict:
    tree = megatron_dev.find(commit)
    megatron_dev.use(tree)
    from verl_ds4.verify.parity import RunOptions, run_parity
    from verl_ds4.verify.production import write_harness_folder

    no_mtp = {**_default_cfg(), "num_nextn_predict_layers": 0}
    batches = {"ragged": (5, 127, 300, 23, 129, 55)}
    out = {"megatron_file": __import__("megatron.core").core.__file__, "commit": tree.commit, "cases": {}}
    written = []  # the folders this run writes, removed at its end
    try:
        cases = (("exact", no_mtp, 0.0), ("indexer", no_mtp, None), ("mtp", None, 0.0), ("full", None, None))
        for name, cfg, coeff in cases:
            if name in ("exact", "mtp"):  # indexer reuses exact's folder, full reuses mtp's (the same weights)
                folder = write_harness_folder(cfg, 1234)
                written.append(folder)
            opts = RunOptions(indexer_loss_coeff=coeff, production_folder=folder)
            t = time.time()
            sizes = cps if name in ("exact", "full") else cps[:1]  # the single-fix cases and controls: the smallest CP > 1
            runs = {cp: run_parity(cp, dtypes=("fp64",), model="production", cfg=cfg, batches=batches,
                                   layout_checks=cp > 1 and name == "exact", options=opts) for cp in [1, *sizes]}
            out["cases"][name] = {str(cp): rows(runs[cp], runs[1]) for cp in sizes}
            out["cases"][name + "_seconds"] = round(time.time() - t, 1)
            control = dict(out=out, cp=cps[0], reference=runs[1], cfg=cfg, batches=batches, options=opts)
            if name == "mtp":  # the same case without the MTP fix
                from verl_ds4.substitutes import upstream_fixes

                _control("mtp_unfixed", upstream_fixes, "install_mtp_cp_token_share", lambda patches: False, **control)
            if name == "indexer":  # verl's padded lengths in cu_seqlens_q
                from verl_ds4.verify.production import ProductionLM

                _control("indexer_padded", ProductionLM, "real_cu_seqlens", False, **control)
                t = time.time()
                linear = dataclasses.replace(opts, sparse_core="linear")
                out["cases"]["linear"] = {str(cp): rows(run_parity(cp, dtypes=("fp64",), model="production", cfg=cfg,
                                                                  batches=batches, layout_checks=False, options=linear), runs[cp])
                                          for cp in [1, cps[0]]}
                out["cases"]["linear_seconds"] = round(time.time() - t, 1)
    finally:
        for folder in written:
            shutil.rmtree(folder, ignore_errors=True)
    return out


def _control(name, owner, attribute, value, *, out, cp, reference, **run_args) -> None:
    """A negative control: the case at ``cp`` with ``owner.attribute = value`` in this process while it runs (the
    ranks are forked: they inherit it), compared with the corrected CP = 1 run, as ``out["cases"][name]``."""
    from verl_ds4.substitutes.patching import Patches
    from verl_ds4.verify.parity import run_parity

    t, patches = time.time(), Patches()
    patches.set(owner, attribute, value)
    try:
        result = run_parity(cp, dtypes=("fp64",), model="production", layout_checks=False, **run_args)
    finally:
        patches.undo()
    out["cases"][name] = {str(cp): rows(result, reference)}
    out["cases"][name + "_seconds"] = round(time.time() - t, 1)


def _default_cfg() -> dict:
    from verl_ds4.verify.parity import _ds4_config

    return _ds4_config(None)


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], [int(c) for c in sys.argv[2:]])))
