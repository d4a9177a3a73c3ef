"""``verl-ds4 verify --model ds41 --cp N``: CP parity of the tiny DeepSeek-V4.1 and fidelity to NeMo Automodel.

Builds NeMo Automodel 0.7.0's ``DeepseekV41ForCausalLM`` (the reference, installed without its
dependencies: ``docs/ds41-model.md``) as the random tiny V4.1 of
:func:`verl_ds4.models.ds41.reference.tiny_text_config` (every component on: window-only, ratio-2 and
ratio-1 layers, Full / Reindex / Reuse, the two-level indexer, Engram on a local tokenizer), copies its
weights into our Megatron-Core :class:`~verl_ds4.models.ds41.mcore_model.DS41MegatronModel` and runs
one training step on :data:`RAGGED` (ragged sequences whose CSA2 blocks, windows and Engram n-grams
cross the rank boundaries at CP 2-8), everything in float64:

* **the reference** (parent process, inside :func:`~verl_ds4.models.ds41.reference.fp64_reference`):
  one sequence per forward; per-token log-probs of the next token, entropy, the loss (token mean of
  ``-log p`` over every token but each sequence's last) and its gradients, mapped onto our names
  (:func:`~verl_ds4.models.ds41.reference.reference_tensors`);
* **ours at CP = 1 and CP = N** on 1 and N gloo ranks (:func:`verl_ds4.mcore.distributed.run_distributed`,
  Megatron's parallel state with ``context_parallel_size``), through verl-ds4's THD data path as V4's
  verify (:mod:`verl_ds4.verify.parity`: the contiguous plan with the model's ``min_local_rows``, packed
  ids and rolled labels, ``PackedSeqParams``, ``postprocess_thd_engine``): logits, log-probs, entropy,
  the loss, backward, every gradient summed over the CP group (what Megatron's DDP all-reduce adds).

Rows (V4's table: quantity, max abs diff, max rel diff, pass / FAIL; rel = max|a - b| / max|b|; a
gradient group: the worst abs diff over its tensors / the group's largest gradient):

* CP = N vs CP = 1: loss, log-probs, entropy, and the gradients per group (:func:`ds41_param_group`):
  the attention of the Full layers (the KV / index-key *sources*: their compressors also receive the
  gradients of every later layer that reads their state), of the Reindex and Reuse layers (the
  *readers*), of the window-only layers, the Engram tables and the rest of Engram, mHC, router,
  experts, shared experts, norms, embeddings, output layer;
* the indexer loss: **none in V4.1** (an ``n/a`` row): NeMo Automodel freezes the released indexer
  ("the hard top-k operation provides no language-model gradient and the inference release does not
  implement indexer distillation"), Megatron-LM dev has no V4.1 attention, and V4's indexer KL
  (:mod:`verl_ds4.models.ds4.indexer_loss`) is a CSA training objective V4.1 was not released with.
  The indexer tensors have no gradient on either side (the rows count them);
* vs NeMo Automodel: logits, log-probs, entropy, loss and gradients per group at CP = 1 (the
  Megatron wrapper's gradients against the reference directly), logits, log-probs, loss and all
  gradients at CP = N;
* negative controls at CP = N, which must differ from CP = 1 (or be refused): Engram n-grams built
  without the previous rank's last token ids (the halo zeroed); the Reindex layers, then the Reuse
  layers, recomputing their state (the source layer's modules on their own input) instead of reading
  the source layer's shared state; a zigzag CP split refused by the config and by the decoder
  (``packed_seq_params.cp_partition_mode``), and with the decoder's guard bypassed the log-probs differ;
* DSpark: the drafter's loss and gradients, from :mod:`verl_ds4.verify.ds41_dspark` (its own
  step at CP 1 and N against NeMo's, :func:`dspark_rows`).
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
import time
from typing import Any, Callable

import numpy as np
import torch

__all__ = [
    "RAGGED",
    "NEGATIVE_MIN_REL",
    "Case",
    "build_case",
    "ds41_param_group",
    "nemo_step",
    "ours_on_cp_ranks",
    "run_ds41_verify",
    "ds41_rows",
    "dspark_rows",
]

#: Ragged lengths (134 tokens): at CP 2-8 every rank boundary cuts a sequence, ratio-2 blocks and
#: Engram trigrams straddle boundaries, and every rank holds >= 16 rows (``min_local_rows`` is 4).
RAGGED = (5, 27, 40, 9, 33, 3, 17)
#: A negative control passes when its relative difference exceeds this.
NEGATIVE_MIN_REL = 1e-3
#: The longest sequence NeMo Automodel's reference runs (``verify --seq-len``): its attention holds ``[heads, S,
#: S + S / m]`` fp64 logits per layer for backward (:func:`nemo_step`; 4096 tokens: 15.4 GiB max RSS, 83 s; the
#: memory grows as S^2). Above it the table compares CP = N with CP = 1 only (an ``n/a`` row says so), as DS4's
#: ``--seq-len`` does.
NEMO_MAX_TOKENS = 4096

_ATTENTION_ROLES = {"full": "Full", "reindex": "Reindex", "reuse": "Reuse", "window": "window-only"}
_ROLE_NOTES = {"full": "KV/index-key source", "reindex": "reads KV + keys", "reuse": "reads KV + top-k", "window": ""}


class Case:
    """The weights, the Engram table and the batch, built once in the parent (the gloo ranks are forked from it)."""

    def __init__(self, text: dict, state_dict: dict, table: list[int], lengths: tuple[int, ...], seed: int):
        from verl_ds4 import ds41_facts

        self.text, self.state_dict, self.table, self.lengths, self.seed = text, state_dict, table, tuple(lengths), seed
        self.facts = ds41_facts.read_config({"model_type": ds41_facts.HF_MODEL_TYPE, "text_config": text})
        gen = torch.Generator().manual_seed(seed + 2)
        self.sequences = [torch.randint(0, text["vocab_size"], (n,), generator=gen) for n in self.lengths]

    def build(self, cp_size: int):
        from verl_ds4.models.ds41.mcore_model import DS41MegatronModel, ds41_transformer_config

        model = DS41MegatronModel(ds41_transformer_config(self.text, torch.float64, cp_size), self.table)
        missing, unexpected = model.load_state_dict(self.state_dict, strict=False)
        bad = [k for k in missing if not k.endswith("_extra_state")] + list(unexpected)
        if bad:
            raise RuntimeError(f"verify --model ds41: the weights do not fit the Megatron model: {bad[:5]}")
        return model.train()

    def nested_ids(self) -> torch.Tensor:
        offsets = torch.tensor([0, *self.lengths]).cumsum(0)
        return torch.nested.nested_tensor_from_jagged(torch.cat(self.sequences), offsets=offsets)

    def loss_mask(self) -> np.ndarray:
        """True on every token but each sequence's last (its rolled label wraps)."""
        mask = np.ones(sum(self.lengths), dtype=bool)
        mask[np.cumsum(self.lengths) - 1] = False
        return mask


def build_case(seed: int = 1234, lengths: tuple[int, ...] | None = None, text: dict | None = None):
    """``(case, NeMo's model, our pure-PyTorch DS41Model with its weights)`` of ``text`` (default: the tiny V4.1)."""
    from verl_ds4.models.ds41 import reference as ref
    from verl_ds4.models.ds41.engram import engram_token_map
    from verl_ds4.models.ds41.model import DS41Model

    text = text or ref.tiny_text_config()
    with ref.fp64_reference():
        theirs = ref.build_reference_model(text, seed=seed)
    table = engram_token_map(ref.local_tokenizer())[0]
    ours = DS41Model(text, table, dtype=torch.float64)
    ref.copy_reference_weights(ours, theirs)
    return Case(text, ours.state_dict(), table, lengths or RAGGED, seed), theirs, ours


def ds41_param_group(name: str, facts) -> str:
    """The gradient group of one of our parameter names: ``attention:<role>`` (role of the layer),
    ``engram_tables``, ``engram``, ``hc``, ``router``, ``experts``, ``shared_experts``, ``norms``,
    ``embeddings``, ``output_layer``, ``drafter`` (``mtp.*``)."""
    if ".mtp." in f".{name}":
        return "drafter"
    if name.startswith("embedding."):
        return "embeddings"
    if name.startswith("output_layer."):
        return "output_layer"
    match = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if match is None:
        return "norms"  # decoder.final_layernorm
    layer, rest = int(match.group(1)), match.group(2)
    if rest.startswith("engram.multi_head_embedding."):
        return "engram_tables"
    if rest.startswith("engram."):
        return "engram"
    if rest.startswith(("attn_hc.", "mlp_hc.")):
        return "hc"
    if rest.startswith(("self_attention.", "input_layernorm.")):
        return f"attention:{facts.roles[layer].role}"
    if ".router." in f".{rest}":
        return "router"
    if ".shared_experts." in f".{rest}":
        return "shared_experts"
    if ".experts." in f".{rest}":
        return "experts"
    return "norms"


def _group_order(facts) -> list[tuple[str, str]]:
    """``(group, row label)`` in table order, with the layers of each attention role named."""
    out = []
    for role in ("full", "reindex", "reuse", "window"):
        layers = [r.layer for r in facts.roles if r.role == role]
        if layers:
            note = f" {_ROLE_NOTES[role]}" if _ROLE_NOTES[role] else ""
            out.append((f"attention:{role}", f"attn {_ATTENTION_ROLES[role]} {','.join(map(str, layers))}{note}"))
    if facts.engram_layers:
        layers = ",".join(map(str, facts.engram_layers))
        out += [("engram_tables", f"Engram tables {layers}"), ("engram", f"Engram proj + norms {layers}")]
    out += [(g, g) for g in ("hc", "router", "experts", "shared_experts", "norms", "embeddings", "output_layer")]
    out.append(("drafter", "DSpark drafter (mtp.*)"))
    return out


# ---------------------------------------------------------------------------------- the reference


def nemo_step(case: Case, theirs, ours_pure) -> dict[str, Any]:
    """NeMo Automodel's logits ``[T, V]``, log-probs / entropy ``[T]`` (token order; the log-prob of a
    sequence's last token is NaN: it has no label), the loss and its gradients in our names."""
    from verl_ds4.models.ds41 import reference as ref

    theirs.zero_grad(set_to_none=True)
    logits, logp, entropy = [], [], []
    with ref.fp64_reference():
        for s in case.sequences:
            out = theirs(s.view(1, -1)).logits[0]
            all_logp = torch.log_softmax(out, dim=-1)
            logits.append(out)
            entropy.append(-(all_logp.exp() * all_logp).sum(-1))
            logp.append(all_logp[:-1].gather(-1, s[1:].view(-1, 1))[:, 0])
        loss = -torch.cat(logp).sum() / sum(len(s) - 1 for s in case.sequences)
        loss.backward()
    grads = ref.reference_tensors(ours_pure, theirs, grads=True)
    nan = torch.tensor([math.nan], dtype=torch.float64)
    return {
        "logits": torch.cat(logits).detach().numpy(),
        "log_probs": torch.cat([torch.cat([lp.detach(), nan]) for lp in logp]).numpy(),
        "entropy": torch.cat(entropy).detach().numpy(),
        "loss": np.array([loss.item()]),
        "grads": {k: (None if v is None else v.detach().numpy()) for k, v in grads.items()},
    }


# ---------------------------------------------------------------------------------- ours on gloo ranks


def _step(model, ids, cp_rank: int, world: int, layout: str = "contiguous", logits_too: bool = False):
    """One actor forward through verl-ds4's THD path: ``(per-token [T, 2] log-prob / entropy in token
    order, loss, gathered logits [T, V] or None)``."""
    from verl_ds4.verify.parity import _forward
    from verl_ds4.mcore.thd import pack_input, postprocess_thd_engine

    logits, plan, params = _forward(model, ids, layout, cp_rank, int(model.config.min_local_rows), world)
    labels, _ = pack_input(ids, plan, cp_rank, need_roll=True)
    all_logp = torch.log_softmax(logits, dim=-1)
    logp = all_logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(all_logp.exp() * all_logp).sum(-1)
    flat = postprocess_thd_engine(torch.stack((logp, entropy), -1), params, ids, ids.shape[0], cp_layout=layout).values()
    mask = torch.ones(flat.shape[0], dtype=torch.bool)
    mask[ids.offsets()[1:] - 1] = False
    loss = -(flat[:, 0] * mask).sum() / mask.sum()
    gathered = None
    if logits_too:
        with torch.no_grad():
            gathered = postprocess_thd_engine(logits.detach(), params, ids, ids.shape[0], cp_layout=layout).values()
    return flat, loss, gathered


@contextlib.contextmanager
def _engram_halo_zeroed():
    """Every rank's Engram hasher gets zeros where the previous rank's last token ids belong (rank 0's view)."""
    from verl_ds4.models.ds41 import engram

    original = engram.exchange_left_halo
    engram.exchange_left_halo = lambda rows, count, group: rows.new_zeros(count, *rows.shape[1:])
    try:
        yield
    finally:
        engram.exchange_left_halo = original


@contextlib.contextmanager
def _readers_recompute(model, role: str):
    """Layers of ``role`` (``reindex`` / ``reuse``) rebuild the CSA2 state from their own input with the
    source layer's modules (compressor, index keys, selection) instead of reading the state the
    source layer published."""
    from verl_ds4.models.ds41.csa2 import CSA2State

    layers = model.decoder.layers
    patched = []
    for layer in layers:
        attention = layer.self_attention
        if attention.role.role != role:
            continue
        source = layers[attention.role.kv_source].self_attention
        if attention.role.candidate_source is not None:  # a hierarchical layer's candidates come from that layer
            source = layers[attention.role.candidate_source].self_attention

        def recompute(x, state=None, cu_seqlens_padded=None, cp_group=None, _attn=attention, _src=source):
            _, fresh = type(_src).forward(_src, x, CSA2State(), cu_seqlens_padded, cp_group)
            return type(_attn).forward(_attn, x, fresh, cu_seqlens_padded, cp_group)

        attention.forward = recompute
        patched.append(attention)
    if not patched:
        raise ValueError(f"the model has no {role} layer to break")
    try:
        yield [a.role.layer for a in patched]
    finally:
        for attention in patched:
            del attention.forward


def _zigzag_guard_bypassed():
    """The V4.1 decoder accepting any CP partition."""
    from verl_ds4.verify.parity import cp_partition_guard_bypassed
    from verl_ds4.models.ds41.mcore_model import DS41TransformerBlock

    return cp_partition_guard_bypassed(DS41TransformerBlock)


def _rank(rank: int, world: int, case: Case, controls: bool, sparse_core: str = "dense", replay: bool = False,
          query_rows: int | None = None):
    import logging

    from megatron.core import parallel_state

    from verl_ds4.verify.parity import _grads

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    try:
        group = parallel_state.get_context_parallel_group() if world > 1 else None
        cp_rank = parallel_state.get_context_parallel_rank()
        model = case.build(world)
        if sparse_core != "dense":
            from verl_ds4.kernels import set_sparse_core

            set_sparse_core(model, sparse_core)
        from verl_ds4.verify import seqlen

        if query_rows:  # --seq-len: row-chunk boundaries inside the long sequence (verl_ds4.verify.seqlen)
            seqlen.use_query_chunk_rows(model, query_rows)
        ids = case.nested_ids()
        model.zero_grad(set_to_none=True)
        from verl_ds4.verify.parity import _forward

        def record():  # the rollout's no-grad forward, every selecting layer recording its choice
            _forward(model, ids, "contiguous", cp_rank, int(model.config.min_local_rows), world)

        if replay:  # the training step replays the recorded choices (verl_ds4.mcore.indexer_replay)
            seqlen.record_and_load(model, record)
        flat, loss, logits = _step(model, ids, cp_rank, world, logits_too=True)
        loss.backward()
        if replay:
            seqlen.stop_replay(model)
        result = {
            "log_probs": flat[:, 0].detach().numpy(),
            "entropy": flat[:, 1].detach().numpy(),
            "loss": np.array([loss.item()]),
            "logits": logits.numpy(),
            "grads": _grads(model, group),
            "checks": {},
        }
        if controls and world > 1:
            checks = result["checks"]
            with torch.no_grad():
                with _engram_halo_zeroed():
                    checks["engram_halo_off"] = _step(model, ids, cp_rank, world)[0][:, 0].numpy()
                for role in ("reindex", "reuse"):
                    with _readers_recompute(model, role) as layers:
                        checks[f"{role}_recompute"] = (layers, _step(model, ids, cp_rank, world)[0][:, 0].numpy())
                try:
                    _step(model, ids, cp_rank, world, layout="zigzag")
                    checks["zigzag_error"] = None
                except ValueError as err:
                    checks["zigzag_error"] = str(err)
                with _zigzag_guard_bypassed():
                    checks["zigzag_bypassed"] = _step(model, ids, cp_rank, world, layout="zigzag")[0][:, 0].numpy()
            if replay:  # replaying another valid choice must change the log-probs (the replay takes effect)
                checks["replay_other_blocks"] = seqlen.replaying_other_blocks(model, record, lambda: _step(model, ids, cp_rank, world))[0][:, 0].numpy()
        return result if rank == 0 else None
    finally:
        parallel_state.destroy_model_parallel()


def ours_on_cp_ranks(case: Case, cp: int, controls: bool = False, timeout: float = 600.0, sparse_core: str = "dense",
                     replay: bool = False, query_rows: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Rank 0's result of one training step of our Megatron V4.1 on ``cp`` gloo ranks (``controls``:
    also the negative controls, at ``cp > 1``; ``sparse_core``: the attention's sparse softmax; ``replay``: the
    step replays the indexer choices a no-grad forward recorded, and the controls add replaying other blocks;
    ``query_rows``: the attention's query rows per chunk, None: its budget)."""
    from verl_ds4.mcore.distributed import run_distributed
    from verl_ds4.models.ds41 import mcore_model as _mcore  # noqa: F401  (import Megatron once: forked ranks start fast)

    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}.")
    return run_distributed(_rank, world_size=cp, args=(case, controls, sparse_core, replay, query_rows), timeout=timeout)[0]


# ---------------------------------------------------------------------------------- rows


def _diff(a: np.ndarray, b: np.ndarray, mask: np.ndarray | None = None) -> tuple[float, float]:
    from verl_ds4.verify.table import max_diff as diff

    if mask is not None and a.shape == b.shape:
        a, b = a[mask], b[mask]
    return diff(a, b)


def _grad_rows(prefix: str, ours: dict, ref: dict, facts, tol: float, groups=None) -> list:
    from verl_ds4.verify.table import Row, group_diff

    rows = []
    present = {ds41_param_group(n, facts) for n in ref}
    for group, label in groups or _group_order(facts):
        if group not in present:
            continue
        pick = lambda d: {n: v for n, v in d.items() if ds41_param_group(n, facts) == group}  # noqa: E731
        d_abs, d_rel, n, without = group_diff(pick(ours), pick(ref))
        note = f" + {without} frozen indexer" if without else ""
        rows.append(Row(f"{prefix}grads {label} ({n}{note})", d_abs, d_rel, tol))
    return rows


def _all_grads_row(prefix: str, ours: dict, ref: dict, tol: float):
    from verl_ds4.verify.table import Row, group_diff

    d_abs, d_rel, n, without = group_diff(ours, ref)
    note = f" + {without} frozen indexer" if without else ""
    return Row(f"{prefix}grads, all ({n}{note})", d_abs, d_rel, tol)


def ds41_rows(case: Case, nemo: dict | None, runs: dict[int, dict], cp: int, rtol: float = 1e-10,
              zigzag_config_error: str | None = None, tag: str = "") -> list:  # fmt: skip
    """The table's rows (:class:`verl_ds4.verify.table.Row`) of :func:`run_ds41_verify`'s results (``tag``: after
    each run's name, e.g. ``+replay``; ``nemo`` None: the reference did not run, one ``n/a`` row says why)."""
    from verl_ds4.verify.table import Row

    facts, mask = case.facts, case.loss_mask()
    rows: list[Row] = []
    one = runs[1]
    if cp > 1:
        other, prefix = runs[cp], f"CP={cp}{tag} vs CP=1{tag}: "
        for q in ("loss", "log_probs", "entropy"):
            rows.append(Row(prefix + q, *_diff(other[q], one[q]), rtol))
        rows.append(Row(prefix + "indexer loss: none in V4.1 (indexer frozen, as NeMo)", 0.0, 0.0, rtol, expect="absent"))
        rows += _grad_rows(prefix, other["grads"], one["grads"], facts, rtol)
    if nemo is None:
        rows.append(Row(f"vs NeMo{tag}: not run, a {max(case.lengths)}-token sequence > {NEMO_MAX_TOKENS} (NeMo's fp64 "
                        "attention holds [heads, S, S + S/m] per layer); verify without --seq-len compares", 0.0, 0.0, rtol,
                        expect="absent"))  # fmt: skip
    for size in sorted(runs) if nemo is not None else ():
        ours, prefix = runs[size], f"CP={size}{tag} vs NeMo: "
        rows.append(Row(prefix + "logits", *_diff(ours["logits"], nemo["logits"]), rtol))
        rows.append(Row(prefix + "log_probs", *_diff(ours["log_probs"], nemo["log_probs"], mask), rtol))
        if size == 1:
            rows.append(Row(prefix + "entropy", *_diff(ours["entropy"], nemo["entropy"]), rtol))
        rows.append(Row(prefix + "loss", *_diff(ours["loss"], nemo["loss"]), rtol))
        if size == 1:
            rows += _grad_rows(prefix, ours["grads"], nemo["grads"], facts, rtol)
        else:
            rows.append(_all_grads_row(prefix, ours["grads"], nemo["grads"], rtol))
    checks = runs[cp].get("checks") or {}
    if cp > 1 and checks:
        ref_logp = one["log_probs"]
        prefix = f"CP={cp}{tag} control: "
        if "replay_other_blocks" in checks:
            rows.append(Row(prefix + "indexer replay of other valid blocks: log_probs must differ",
                            *_diff(checks["replay_other_blocks"], ref_logp), NEGATIVE_MIN_REL, expect="differ"))  # fmt: skip
        rows.append(Row(prefix + "Engram halo zeroed (no rank r-1 tokens): log_probs must differ",
                        *_diff(checks["engram_halo_off"], ref_logp), NEGATIVE_MIN_REL, expect="differ"))  # fmt: skip
        for role in ("reindex", "reuse"):
            layers, logp = checks[f"{role}_recompute"]
            rows.append(Row(f"{prefix}{_ATTENTION_ROLES[role]} {','.join(map(str, layers))} recompute, not read, the state: "
                            "log_probs must differ", *_diff(logp, ref_logp), NEGATIVE_MIN_REL, expect="differ"))  # fmt: skip
        refused = zigzag_config_error is not None and "contiguous" in zigzag_config_error
        flag = 0.0 if refused else math.inf
        rows.append(Row(prefix + "zigzag: DS41TransformerConfig refuses it", flag, flag, 0.0, expect="error"))
        message = checks.get("zigzag_error")
        flag = 0.0 if message is not None and "contiguous" in message else math.inf
        rows.append(Row(prefix + "zigzag rows: the V4.1 decoder refuses them", flag, flag, 0.0, expect="error"))
        rows.append(Row(prefix + "zigzag, decoder guard bypassed: log_probs must differ",
                        *_diff(checks["zigzag_bypassed"], ref_logp), NEGATIVE_MIN_REL, expect="differ"))  # fmt: skip
    return rows


def dspark_rows(cp: int, seed: int, timeout: float, rtol: float, progress: Callable[[str], None] = lambda s: None) -> list:
    """The DSpark rows of :mod:`verl_ds4.verify.ds41_dspark` (its entries ``{"check", "value", "limit",
    "passed"}``; ``limit`` ``None`` = a count that must be above 0) as table rows."""
    from verl_ds4.verify import ds41_dspark as dspark
    from verl_ds4.verify.table import Row

    progress(f"DSpark drafter step (NeMo, CP=1, CP={cp})")
    rows = []
    for entry in dspark.dspark_rows(dspark.compare_dspark_with_nemo(cp, seed=seed, timeout=timeout), rtol):
        value = float(entry["value"])
        name = entry["check"] if entry["check"].startswith("DSpark") else f"DSpark {entry['check']}"
        if entry.get("limit") is None:
            rows.append(Row(name, value, value, 0.0, expect="differ"))
        else:
            rows.append(Row(name, value, value, float(entry["limit"])))
    return rows


def run_ds41_verify(cp: int, seed: int = 1234, rtol: float = 1e-10, lengths: tuple[int, ...] | None = None,
                    controls: bool = True, timeout: float = 600.0, progress: Callable[[str], None] | None = None,
                    dspark: bool = True, sparse_core: str = "dense", indexer_replay: str = "off", text: dict | None = None,
                    query_rows: int | None = None) -> dict[str, Any]:  # fmt: skip
    """``{"rows": [Row], "seconds": s, "stages": {stage: s}, "lengths": [...]}`` for ``verl-ds4 verify --model ds41 --cp cp``
    (``sparse_core``: the attention's sparse softmax in our runs, CP=1 and CP=cp; NeMo Automodel stays the reference;
    ``indexer_replay``: ``off``, ``on`` (our steps replay their recorded indexer choices) or ``both`` (each step twice:
    rows without and with ``+replay``); the native choice replayed is the native step, so NeMo stays the reference;
    ``text``: the model config (default: the tiny V4.1); ``query_rows``: the CP=cp run's attention query rows per chunk
    (``--seq-len``); NeMo runs when no sequence is longer than :data:`NEMO_MAX_TOKENS`)."""
    from verl_ds4.models.ds41.mcore_model import ds41_transformer_config

    if cp < 1:
        raise ValueError(f"--cp must be >= 1, got {cp}.")
    start = time.perf_counter()
    stages: dict[str, float] = {}
    say = progress or (lambda s: None)

    def stage(name: str):
        say(f"[verify ds41 {time.perf_counter() - start:6.1f}s] {name}")
        stages[name] = time.perf_counter()

    def done(name: str):
        stages[name] = time.perf_counter() - stages[name]

    stage("building NeMo Automodel's tiny V4.1 (fp64) and copying its weights into ours")
    case, theirs, ours_pure = build_case(seed, lengths, text)
    if not case.lengths or min(case.lengths) < 2:
        raise ValueError(f"lengths={list(case.lengths)}: give sequences of >= 2 tokens (each needs a next-token label).")
    done(next(reversed(stages)))
    nemo = None
    if max(case.lengths) <= NEMO_MAX_TOKENS:
        stage("NeMo Automodel forward + backward (fp64, one sequence per forward)")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the gloo ranks: its many tiny scatter_adds crawl on shared, busy cores
        try:
            nemo = nemo_step(case, theirs, ours_pure)
        finally:
            torch.set_num_threads(threads)
        done(next(reversed(stages)))
    if indexer_replay not in ("off", "on", "both"):
        raise ValueError(f"indexer_replay={indexer_replay!r}: expected off, on or both.")  # error-catalogue: internal: argparse restricts the choices
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[indexer_replay]
    all_runs: dict[bool, dict[int, dict]] = {}
    for replay in modes:
        runs = all_runs.setdefault(replay, {})
        for size in sorted({1, cp}):
            extra = " + negative controls" if controls and size > 1 else ""
            what = ", indexer choices replayed" if replay else ""
            stage(f"ours, CP={size}: one training step on {size} gloo rank{'s' if size > 1 else ''}{extra} ({sparse_core} sparse core{what})")
            runs[size] = ours_on_cp_ranks(case, size, controls=controls and size > 1, timeout=timeout, sparse_core=sparse_core,
                                          replay=replay, query_rows=query_rows if size > 1 else None)  # fmt: skip
            done(next(reversed(stages)))
    zigzag_config_error = None
    if cp > 1:
        try:
            ds41_transformer_config(case.text, torch.float64, cp, cp_partition_mode="zigzag")
        except ValueError as err:
            zigzag_config_error = str(err)
    rows = []
    for replay, runs in all_runs.items():
        rows += ds41_rows(case, nemo, runs, cp, rtol, zigzag_config_error if controls else None, tag="+replay" if replay else "")
    if dspark:
        rows += dspark_rows(cp, seed, timeout, rtol, say)
    return {"rows": rows, "seconds": time.perf_counter() - start, "stages": stages, "lengths": list(case.lengths)}


def print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
