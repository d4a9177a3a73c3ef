"""The DSpark rows of ``verl-ds4 verify --model ds41``: the drafter's training loss against NeMo Automodel.

:func:`compare_dspark_with_nemo` builds NeMo Automodel 0.7.0's tiny V4.1 target and its DSpark drafter
(random, fp64: :mod:`verl_ds4.models.ds41.reference`), copies both into ours (the Megatron-Core
:class:`~verl_ds4.models.ds41.mcore_model.DS41MegatronModel` and
:class:`~verl_ds4.models.ds41.dspark.DS41DSpark`), and runs one DSpark step on ragged sequences with
prompt tokens masked out:

* NeMo's step (:func:`verl_ds4.models.ds41.dspark_reference.nemo_dspark_step`: its frozen-target
  wrapper, its drafter with the target's embedding / head frozen, its three-term loss) on the anchors
  our sampler draws from the seed;
* ours (:mod:`verl_ds4.models.ds41.dspark_loss`) at CP 1 and CP N on gloo ranks: the target packed THD
  with the contiguous split, each rank capturing its rows' features, gathered; the same anchors
  drawn on every rank; the loss backpropagated.

Figures: loss at CP 1 vs NeMo, drafter gradients at CP 1 vs NeMo (per tensor, relative to the
tensor's largest, floored at 1e-6 of the drafter's largest gradient: stage 0's ``attn_hc.alpha_res``
cancels to ~1e-10 of it because the streams start as identical copies), loss and gradients at CP N
vs CP 1 (every rank), the backbone gradients the DSpark loss leaves (must be none), and the number of
drafter tensors it trains. :func:`dspark_rows` turns the result into rows for the verify report.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["DSparkCase", "build_dspark_case", "nemo_dspark_figures", "ours_on_cp_ranks", "compare_dspark_with_nemo", "dspark_rows"]

DEFAULT_RTOL = 1e-10


class DSparkCase:
    """Everything both sides need, built once in the parent (the gloo ranks are forked from it)."""

    def __init__(self, text, target_state, drafter_state, table, sequences, masks, anchor_seed, num_anchors, reference=None):
        self.text, self.target_state, self.drafter_state, self.table = text, target_state, drafter_state, table
        self.sequences, self.masks, self.anchor_seed, self.num_anchors = sequences, masks, anchor_seed, num_anchors
        self.reference = reference  # (NeMo target, NeMo drafter), parent only

    def anchors(self):
        from verl_ds4.models.ds41.dspark_loss import sample_anchors

        generator = torch.Generator().manual_seed(self.anchor_seed)
        return [sample_anchors(m, self.num_anchors, generator) for m in self.masks]

    def objective(self):
        from verl_ds4.models.ds41.dspark_loss import DSparkLossConfig, DSparkObjective

        return DSparkObjective(self.text, DSparkLossConfig(num_anchors=self.num_anchors))

    def drafter(self):
        from verl_ds4.models.ds41.dspark import DS41DSpark

        drafter = DS41DSpark(self.text, dtype=torch.float64)
        drafter.load_state_dict(self.drafter_state)
        return drafter


def build_dspark_case(seed: int = 1234, num_anchors: int = 4, lengths: list[int] | None = None, prompt: int = 3) -> DSparkCase:
    """The tiny V4.1 (``reference.tiny_text_config``: 8 layers, 3 DSpark stages reading layers 5, 6, 7),
    NeMo's target and drafter random in fp64 and copied into ours; sequences of ``lengths`` (default
    ``[27, 9, 40]``) with the first ``prompt`` tokens masked out of the loss."""
    from verl_ds4.models.ds41 import reference as ref
    from verl_ds4.models.ds41.dspark import DS41DSpark
    from verl_ds4.models.ds41.engram import engram_token_map
    from verl_ds4.models.ds41.model import DS41Model

    text = ref.tiny_text_config()
    with ref.fp64_reference():
        target = ref.build_reference_model(text, seed=seed)
        draft = ref.build_reference_dspark(text, seed=seed + 1, num_anchors=num_anchors)
    table = engram_token_map(ref.local_tokenizer())[0]
    ours = DS41Model(text, table, dtype=torch.float64)
    ref.copy_reference_weights(ours, target)
    drafter = DS41DSpark(text, dtype=torch.float64)
    ref.load_tensors(drafter, ref.dspark_reference_tensors(drafter, draft))
    gen = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, text["vocab_size"], (n,), generator=gen) for n in (lengths or [27, 9, 40])]
    masks = [torch.cat([torch.zeros(min(prompt, len(s))), torch.ones(len(s) - min(prompt, len(s)))]).double() for s in sequences]
    return DSparkCase(text, ours.state_dict(), drafter.state_dict(), table, sequences, masks, seed + 2, num_anchors, (target, draft))


def grad_errors(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor | None]) -> dict[str, float]:
    """Per tensor ``max |got - want| / max(max |want|, 1e-6 * largest gradient)``; ``None`` (an expert no
    token chose) counts as zeros on either side."""
    def dense(g, like):
        return torch.zeros_like(like) if g is None else torch.as_tensor(g, dtype=torch.float64)

    like = {n: torch.as_tensor(g if g is not None else got[n], dtype=torch.float64) for n, g in want.items() if g is not None or got.get(n) is not None}
    scale = max(float(dense(want[n], t).abs().max()) for n, t in like.items())
    return {n: float((dense(got[n], t) - dense(want[n], t)).abs().max()) / max(float(dense(want[n], t).abs().max()), 1e-6 * scale)
            for n, t in like.items()}  # fmt: skip


def nemo_dspark_figures(case: DSparkCase) -> dict[str, Any]:
    """NeMo's step on ``case``: ``{"loss", "ce", "l1", "confidence", "grads"}`` (gradients in our names)."""
    from verl_ds4.models.ds41 import reference as ref
    from verl_ds4.models.ds41.dspark_reference import dspark_fp64_reference, nemo_dspark_step

    target, draft = case.reference
    draft.zero_grad(set_to_none=True)
    anchors = case.anchors()  # drawn outside the fp64 context, whose promotion would turn the float32 keys into float64 ones
    with dspark_fp64_reference():
        out = nemo_dspark_step(target, draft, case.sequences, case.masks, anchors, case.text["pad_token_id"])
    out["grads"] = ref.dspark_reference_tensors(case.drafter(), draft, grads=True)
    return out


def _rank_step(rank: int, world: int, case: DSparkCase):
    """One DSpark step of ours on a gloo rank: the Megatron target at CP ``world``, features gathered,
    anchors from the seed, loss backpropagated."""
    import logging

    from megatron.core import parallel_state

    from verl_ds4.models.ds41.dspark_loss import megatron_target_features
    from verl_ds4.models.ds41.mcore_model import DS41MegatronModel, ds41_transformer_config

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    try:
        group = parallel_state.get_context_parallel_group() if world > 1 else None
        target = DS41MegatronModel(ds41_transformer_config(case.text, torch.float64, world), case.table)
        missing, unexpected = target.load_state_dict(case.target_state, strict=False)
        if unexpected or any(not k.endswith("_extra_state") for k in missing):
            raise RuntimeError(f"verify DSpark: the weights do not fit the Megatron model: {missing[:3]} {unexpected[:3]}")
        target.train()
        drafter = case.drafter().train()
        features, last, logits = megatron_target_features(target, case.sequences, parallel_state.get_context_parallel_rank(), world, group)
        out = case.objective()(drafter, target, case.sequences, features, last, case.masks,
                               generator=torch.Generator().manual_seed(case.anchor_seed))  # fmt: skip
        out.loss.backward()
        backbone = [n for n, p in target.named_parameters() if p.grad is not None and bool(p.grad.ne(0).any())]
        return {
            "loss": float(out.loss),
            "terms": {k: float(out.terms[k]) for k in ("ce", "l1", "confidence", "accept_rate")},
            "grads": {n: (None if p.grad is None else p.grad.tolist()) for n, p in drafter.named_parameters()},
            "backbone_grads": backbone,
            "anchors": [(a.tolist(), k.tolist()) for a, k in out.anchors],
            "local_rows": int(logits.shape[1]),
            "total_rows": sum(int(s.numel()) for s in case.sequences),
        }
    finally:
        parallel_state.destroy_model_parallel()


def ours_on_cp_ranks(case: DSparkCase, cp: int, timeout: float = 600.0) -> list[dict]:
    """:func:`_rank_step` on ``cp`` gloo ranks (``cp = 1`` in a child too): every rank's result."""
    from verl_ds4.mcore.distributed import run_distributed

    return run_distributed(_rank_step, world_size=cp, args=(case,), timeout=timeout)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def compare_dspark_with_nemo(cp: int, seed: int = 1234, case: DSparkCase | None = None, timeout: float = 600.0) -> dict:
    """``{"nemo": {...}, "cp1": {...}, "cp<N>": {...}, "seconds"}``: loss and drafter-gradient errors of
    ours at CP 1 against NeMo and at CP ``cp`` against CP 1 (worst rank), backbone gradients left."""
    start = time.perf_counter()
    case = case or build_dspark_case(seed)
    nemo = nemo_dspark_figures(case)
    result: dict[str, Any] = {"nemo": {k: nemo[k] for k in ("loss", "ce", "l1", "confidence")}}
    base = None
    for size in sorted({1, cp}):
        ranks = ours_on_cp_ranks(case, size, timeout)
        row: dict[str, Any] = {
            "loss": ranks[0]["loss"],
            "loss_vs_nemo": max(_rel(r["loss"], nemo["loss"]) for r in ranks),
            "grads_vs_nemo": max(max(grad_errors(r["grads"], nemo["grads"]).values()) for r in ranks),
            "backbone_grads": sorted({n for r in ranks for n in r["backbone_grads"]}),
            "drafter_tensors_trained": sum(g is not None and any(torch.tensor(g).flatten().ne(0)) for g in ranks[0]["grads"].values()),
            "anchors_equal": all(r["anchors"] == ranks[0]["anchors"] for r in ranks),
            "local_rows": max(r["local_rows"] for r in ranks),
            "total_rows": ranks[0]["total_rows"],
        }
        if base is None:
            base = ranks[0]
        else:
            row["loss_vs_cp1"] = max(_rel(r["loss"], base["loss"]) for r in ranks)
            row["grads_vs_cp1"] = max(max(grad_errors(r["grads"], base["grads"]).values()) for r in ranks)
            row["anchors_equal"] = row["anchors_equal"] and ranks[0]["anchors"] == base["anchors"]
        result[f"cp{size}"] = row
    result["seconds"] = time.perf_counter() - start
    return result


def dspark_rows(result: dict, rtol: float = DEFAULT_RTOL) -> list[dict]:
    """Rows ``{"check", "value", "limit", "passed"}`` of :func:`compare_dspark_with_nemo`'s result."""
    rows = []
    sizes = sorted(int(k[2:]) for k in result if k.startswith("cp"))
    one = result["cp1"]
    rows.append({"check": "DSpark loss, CP=1 vs NeMo Automodel (rel)", "value": one["loss_vs_nemo"], "limit": rtol})
    rows.append({"check": "DSpark drafter gradients, CP=1 vs NeMo Automodel (max rel)", "value": one["grads_vs_nemo"], "limit": rtol})
    for size in sizes:
        row = result[f"cp{size}"]
        if size > 1:
            rows.append({"check": f"DSpark loss, CP={size} vs CP=1 (rel)", "value": row["loss_vs_cp1"], "limit": rtol})
            rows.append({"check": f"DSpark drafter gradients, CP={size} vs CP=1 (max rel)", "value": row["grads_vs_cp1"], "limit": rtol})
        rows.append({"check": f"backbone tensors with a DSpark gradient, CP={size}", "value": len(row["backbone_grads"]), "limit": 0})
        rows.append({"check": f"same anchors on every rank, CP={size}", "value": int(not row["anchors_equal"]), "limit": 0})
    for r in rows:
        r["passed"] = bool(r["value"] <= r["limit"])
    rows.append({"check": "drafter tensors the DSpark loss trains", "value": one["drafter_tensors_trained"], "limit": None,
                 "passed": one["drafter_tensors_trained"] > 0})  # fmt: skip
    return rows
