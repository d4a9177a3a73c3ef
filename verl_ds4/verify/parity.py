"""CP parity harness for the DS4 models: every CP size must reproduce CP = 1.

``model="ds4"`` (default) is the full tiny DeepSeek-V4 of the CPU jobs
(:func:`verl_ds4.cpu.ds4_model_dir.ds4_tiny_hf_config`: mHC, sliding / CSA / HCA attention, DS4 MoE
with a hash layer, seeded weights and hash table) with one MTP depth and the indexer loss switched
on (:data:`MTP_DEPTHS`, :data:`INDEXER_LOSS_COEFF`), so every part of DS4 that meets CP is checked;
``model="ds4_proxy"`` the attention-only proxy.
For a CP size ``N`` the harness starts ``N`` gloo processes (:func:`verl_ds4.mcore.distributed.run_distributed`)
with Megatron's parallel state initialised (``context_parallel_size=N``), builds the same actor
(LM head) and critic (value head) on every rank, and runs one micro-batch through the THD data path
of :mod:`verl_ds4.mcore.thd` (plan with the contiguous layout and the model's ``min_local_rows``,
pack ids and rolled labels, ``PackedSeqParams``, forward, ``postprocess_thd_engine`` all-gather).
Then it computes

* per-token log-probs of the labels and per-token entropy,
* the loss: token mean of ``-log p`` over real tokens (each sequence's last token is masked,
  its label would wrap), backward, and every parameter gradient summed over the CP group (what
  Megatron's DDP all-reduce does), compared per parameter group (:func:`param_group`: ``hc``,
  ``router``, ``experts``, ``shared_experts``, ``attention``, ``embeddings``, ``norms``,
  ``output_layer``, ``mtp``); the MTP loss (its gradient joins the backward, as in training; the
  model gets the real-token ``loss_mask`` packed by the plan, as verl's engine passes it) and the
  indexer loss (real tokens as queries, :mod:`verl_ds4.models.ds4.indexer_loss`),
* critic values, a value loss (token-mean squared error to fixed targets), and every critic gradient.

:func:`compare` puts the results of a CP size next to the CP = 1 results (max abs / max rel diff
per quantity; rel = max|a - b| / max|b|, gradients compared parameter by parameter).

It also shows what the layout guards protect: the same batch packed with the zigzag layout is
rejected by DS4 attention, and with that guard bypassed the log-probs no longer match CP = 1; for
the full DS4, hash layers fed ids packed with a wrong plan (this rank's ids shifted by one row)
give log-probs that no longer match either, and an MTP roll that crosses sequence boundaries gives
other MTP gradients than the correct roll (on :data:`MTP_CONTROL`, at the same CP size). ``hash_ids_shift`` applies that shift to every forward (a test hook: the table
must then fail).
Batches: ``RAGGED`` (lengths straddling rank boundaries) and ``SHORT`` (fewer real tokens than
``cp * 128``: only the minimum-rows padding makes it runnable).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from verl_ds4.verify import routes, seqlen
from verl_ds4.verify.table import Row, group_diff, max_diff, rows_passed

__all__ = ["MODELS", "RAGGED", "SHORT", "ParityResult", "Row", "param_group", "run_parity", "compare", "rows_passed", "format_table"]

MODELS = ("ds4", "ds4_proxy", "production")

# Ragged lengths around the 128-row window / HCA block size; they straddle rank boundaries at CP 2-8.
RAGGED = (5, 127, 300, 23, 129, 520, 55, 181, 95, 1)
# 70 real tokens: below the 128-row minimum of every CP rank.
SHORT = (3, 50, 17)
# The MTP-roll negative control: 24 short sequences (a roll that ignores sequence ends changes the
# MTP label of every sequence's last row; compared with the correct roll at the same CP size).
MTP_CONTROL = (3,) * 20 + (5,) * 4

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}
#: Config changes per precision, applied to a run and to its fp64 reference alike: in bf16 the indexer
#: keeps every compressed block (a bf16 near-tie would pick another block: a different function).
PRECISION_OVERRIDES = {"bf16": {"dsa_indexer_topk": 1 << 20}}

#: What the harness switches on in the CPU jobs' tiny DS4 (whose defaults are MTP off and the
#: indexer loss at 0, as the recipes): one MTP depth and a non-zero indexer-loss coefficient.
MTP_DEPTHS = 1
INDEXER_LOSS_COEFF = 1e-2
#: The CPU jobs' tiny DS4 vocabulary: ``sft_data.padded_vocab_size(sft_data.tokenizer_size())``, recorded
#: because that tokenizer takes DS4's control tokens from verl, which a GPU machine running verify may
#: lack (tests/test_verify_device_on_cpu.py checks the record against the tokenizer).
TINY_VOCAB_SIZE = 104


@dataclass
class ParityResult:
    """Rank 0's view of one CP run (numpy arrays, gathered over CP)."""

    cp_size: int
    results: dict[str, Any] = field(default_factory=dict)  # (dtype, batch) -> quantities
    checks: dict[str, Any] = field(default_factory=dict)  # layout-guard demonstrations
    routes: dict[str, Any] = field(default_factory=dict)  # (dtype, batch) -> role -> router -> routes (routes.collect)


@dataclass(frozen=True)
class RunOptions:
    """Where and how a parity run computes (``verify --device``; the defaults are the CPU run)."""

    device: str = "cpu"  # "cpu" (gloo ranks) or "cuda" (nccl ranks, one GPU each)
    reference: bool = False  # every precision name computed in fp64 (with that name's config): a device run's reference
    record_routes: bool = False  # keep every router's choice per (dtype, batch) (:mod:`.routes`)
    replay: dict | None = None  # (dtype, batch) -> role -> router -> [T, k]: routes the routers must use
    sparse_core: str = "dense"  # the attention's sparse softmax: "dense" (reference) or "linear" (verl_ds4.kernels)
    linear_chunk_rows: int | None = None  # the linear core's query rows per chunk (None: its memory-budget default)
    query_chunk_rows: int | None = None  # the attention's row chunks over compressed blocks (None: verl_ds4.models.query_chunks' budget)
    production_folder: str | None = None  # model="production": the harness's weights as a native HF folder (run_parity writes it)
    indexer_loss_coeff: float | None = None  # the actor's indexer-loss coefficient (None: INDEXER_LOSS_COEFF)


def _np(t: torch.Tensor) -> np.ndarray:
    """A result on the host (bf16 as fp64: NumPy has no bf16)."""
    t = t.detach()
    return (t.double() if t.dtype == torch.bfloat16 else t).cpu().numpy()


def _batch(lengths, vocab: int, seed: int, device=None):
    """Seeded ids (jagged) and value targets, drawn on the CPU (the same on every device), placed on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    ids = torch.randint(0, vocab, (total,), generator=gen)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    targets = torch.randn(total, generator=gen, dtype=torch.float64)
    ids, offsets, targets = (t.to(device or "cpu") for t in (ids, offsets, targets))
    return torch.nested.nested_tensor_from_jagged(ids, offsets=offsets), targets


@contextlib.contextmanager
def cp_partition_guard_bypassed(owner: type):
    """Let ``owner`` (a class with a ``check_cp_partition`` classmethod) accept any CP partition, only to show
    what the guard prevents (a negative control)."""
    original = owner.__dict__["check_cp_partition"]
    owner.check_cp_partition = classmethod(lambda cls, mode, cp_size: None)
    try:
        yield
    finally:
        owner.check_cp_partition = original


def _layout_guard_bypassed():
    """DS4 attention accepting any CP partition."""
    from verl_ds4.models.ds4.attention import DS4HybridAttention

    return cp_partition_guard_bypassed(DS4HybridAttention)


def _forward(model, input_ids, layout: str, cp_rank: int, min_local_rows: int, cp_size: int, hash_ids_shift: int = 0):
    """Pack, forward: returns (this rank's outputs, plan, params). ``hash_ids_shift`` rolls the ids the
    hash layers read by that many rows (ids packed with a wrong plan; negative controls only)."""
    from verl_ds4.layout import PlanOptions
    from verl_ds4.mcore.thd import make_plan, pack_input, packed_seq_params_for, postprocess_thd_engine

    plan = make_plan(input_ids, PlanOptions(layout=layout, cp_size=cp_size, min_local_rows=min_local_rows))
    # megatron-core 0.16.1 lacks PackedSeqParams.cp_partition_mode; DS4 attention reads the attribute.
    # real_cu_seqlens: what verl-ds4's engines hand Megatron-LM dev's DS4 (ResolvedCPLayout.real_cu_seqlens)
    params = packed_seq_params_for(plan, layout_consumer_checked=True,
                                   real_cu_seqlens=getattr(model, "real_cu_seqlens", False))
    ids, positions = pack_input(input_ids, plan, cp_rank)
    kwargs = {}
    if hash_ids_shift:
        kwargs["hash_token_ids"] = torch.roll(ids, hash_ids_shift, dims=1)
    if getattr(model, "mtp_block", None) is not None:
        # The real-token mask packed by the plan (0 on padding rows), as verl's engine passes it.
        real = torch.ones(input_ids.values().shape[0], dtype=torch.bool, device=ids.device)
        kwargs["loss_mask"] = plan.pack(real, cp_rank).unsqueeze(0)
    out = model(ids, positions, None, packed_seq_params=params, **kwargs)
    return out, plan, params


def _actor_step(model, input_ids, layout, cp_rank, min_rows, cp_size, group, hash_ids_shift=0):
    from verl_ds4.mcore.thd import pack_input, postprocess_thd_engine

    logits, plan, params = _forward(model, input_ids, layout, cp_rank, min_rows, cp_size, hash_ids_shift)
    labels, _ = pack_input(input_ids, plan, cp_rank, need_roll=True)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # [1, L]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    both = torch.stack((logp, entropy), dim=-1)  # [1, L, 2]
    jagged = postprocess_thd_engine(both, params, input_ids, input_ids.shape[0], cp_layout=layout)
    flat = jagged.values()  # [T, 2], original token order
    last = input_ids.offsets()[1:] - 1
    mask = torch.ones(flat.shape[0], dtype=torch.bool, device=flat.device)
    mask[last] = False
    loss = -(flat[:, 0] * mask).sum() / mask.sum()
    return flat, loss


def _critic_step(critic, input_ids, targets, layout, cp_rank, min_rows, cp_size, hash_ids_shift=0):
    from verl_ds4.mcore.thd import postprocess_thd_engine

    values, plan, params = _forward(critic, input_ids, layout, cp_rank, min_rows, cp_size, hash_ids_shift)
    jagged = postprocess_thd_engine(values, params, input_ids, input_ids.shape[0], cp_layout=layout)
    flat = jagged.values()[:, 0]
    loss = ((flat - targets.to(flat.dtype)) ** 2).mean()
    return flat, loss


def _grads(model, group) -> dict[str, np.ndarray | None]:
    """Every parameter's gradient summed over the CP group; ``None`` where no rank has one.

    A rank whose rows never reach an expert has no gradient for it while another rank has one, so
    the ranks first agree (one all-reduce of has-grad flags) on which gradients to sum."""
    params = list(model.named_parameters())
    device = params[0][1].device
    has = torch.tensor([p.grad is not None for _, p in params], dtype=torch.int64, device=device)
    if group is not None:
        torch.distributed.all_reduce(has, group=group)
    out = {}
    for (name, p), any_rank in zip(params, has.tolist()):
        if not any_rank:
            out[name] = None
            continue
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        if group is not None:
            torch.distributed.all_reduce(g, group=group)
        out[name] = g.to(torch.float64 if g.dtype == torch.bfloat16 else g.dtype).cpu().numpy()
    return out


class _Models:
    """Builds the actor / critic of ``model`` (``ds4`` or ``ds4_proxy``) the same way on every rank."""

    def __init__(self, model: str, cfg, seed: int):
        if model not in MODELS or model == "production":
            raise ValueError(f"model={model!r}; expected one of {MODELS}.")
        self.model, self.seed = model, seed
        if model == "ds4_proxy":
            from verl_ds4.models.ds4.proxy import load_proxy_config

            self.cfg = load_proxy_config(cfg)
            self.vocab = self.cfg["vocab_size"]
        else:
            self.cfg = _ds4_config(cfg)
            self.vocab = self.cfg["vocab_size"]
        self.indexer_loss_coeff = INDEXER_LOSS_COEFF

    def build(self, dtype, value_head: bool = False, device=None, overrides: dict | None = None):
        """The actor (or critic) in ``dtype`` on ``device`` (default: the CPU); ``overrides``: config fields."""
        seed = self.seed + (1 if value_head else 0)
        if self.model == "ds4_proxy":
            from verl_ds4.models.ds4.proxy import build_proxy_model

            return build_proxy_model(self.cfg, dtype=dtype, value_head=value_head, seed=seed).to(device or "cpu")
        from verl_ds4.cpu.ds4_model_dir import hash_table
        from verl_ds4.models.ds4.model import build_ds4_model

        overrides = {**(overrides or {}), **({} if value_head else {"dsa_indexer_loss_coeff": self.indexer_loss_coeff})}
        # A critic has no next-token head: it is built without the MTP block (as verl's critic).
        model = build_ds4_model(self.cfg, dtype=dtype, value_head=value_head, seed=seed, allow_mtp_skip=value_head,
                                config_overrides=overrides, device=device)
        table = hash_table(self.vocab, self.cfg["n_routed_experts"], self.cfg["num_experts_per_tok"], seed + 7)
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith("tid2eid"):
                    buf.copy_(table)
                elif name.endswith("expert_bias"):  # a bias that moves the choice, so the bias path is checked
                    buf.copy_(0.05 * torch.randn(buf.shape, generator=torch.Generator().manual_seed(seed + 8), dtype=torch.float64).to(buf.dtype))
        return model

    def min_local_rows(self, model) -> int:
        return int(model.config.min_local_rows)

    @property
    def has_hash_layers(self) -> bool:
        return self.model == "ds4" and "hash_moe" in self.cfg.get("mlp_layer_types", [])

    def aux_losses(self, actor) -> dict[str, np.ndarray]:
        return _aux_losses(actor)

    def use_sparse_core(self, model, core: str) -> None:
        from verl_ds4.kernels import set_sparse_core

        set_sparse_core(model, core)

    def layout_guard_bypassed(self):
        return _layout_guard_bypassed()


def _models_for(model: str, cfg, seed: int, world: int, opts: RunOptions):
    """The harness's model builder: the project's DS4 / proxy, or (``production``) Megatron-LM dev's DS4 built by
    Megatron-Bridge from the same weights (:class:`verl_ds4.verify.production.ProductionModels`)."""
    models = _Models("ds4" if model == "production" else model, cfg, seed)
    if opts.indexer_loss_coeff is not None:
        models.indexer_loss_coeff = opts.indexer_loss_coeff
    if model != "production":
        return models
    from verl_ds4.verify.production import ProductionModels

    return ProductionModels(models, world, opts.production_folder)


def _ds4_config(cfg) -> dict:
    """The full DS4's config dict: ``cfg`` (dict, JSON text or a config.json / folder path) or the CPU jobs' tiny DS4."""
    import json
    from pathlib import Path

    from verl_ds4.cpu.ds4_model_dir import ds4_tiny_hf_config

    if cfg is None:
        return ds4_tiny_hf_config(vocab_size=TINY_VOCAB_SIZE, num_nextn_predict_layers=MTP_DEPTHS).to_dict()
    if isinstance(cfg, dict):
        return dict(cfg)
    text = str(cfg)
    if text.lstrip().startswith("{"):
        return json.loads(text)
    path = Path(text)
    return json.loads((path / "config.json" if path.is_dir() else path).read_text())


def _aux_losses(actor) -> dict[str, np.ndarray]:
    """The last forward's MTP loss (scaled, as it joins the training loss) and indexer loss, global
    over CP; a quantity the model does not have is left out."""
    from verl_ds4.models.ds4.indexer_loss import indexer_loss_report
    from verl_ds4.models.ds4.mtp import mtp_loss_report

    out = {}
    mtp = mtp_loss_report(actor)
    if mtp:
        out["mtp_loss"] = np.array([mtp["mtp loss (scaled)"]])
    indexer = indexer_loss_report(actor)
    if indexer is not None:
        out["indexer_loss"] = np.array([indexer])
    return out


def param_group(name: str) -> str:
    """The parameter group of a Megatron parameter name (the rows of the gradient table)."""
    if ".mtp." in f".{name}":
        return "mtp"
    if ".router." in name:
        return "router"
    if ".shared_experts." in name:
        return "shared_experts"
    if ".experts." in name:
        return "experts"
    if "_hc." in name or "hc_head." in name:
        return "hc"
    if ".self_attention." in name or ".input_layernorm." in name:
        return "attention"
    if name.startswith("embedding."):
        return "embeddings"
    if name.startswith("output_layer."):
        return "output_layer"
    if ".mlp." in name:
        return "mlp"  # the proxy's dense MLP
    return "norms"


#: Gradient rows of the table, in order; groups a model does not have are left out.
GRAD_GROUPS = ("embeddings", "attention", "hc", "router", "experts", "shared_experts", "mlp", "norms", "output_layer", "mtp")


def _worker(rank: int, world: int, model_name: str, cfg, dtypes, batches, seed: int, layout_checks: bool, hash_ids_shift: int,
            opts: RunOptions = RunOptions()):  # fmt: skip
    import logging

    from megatron.core import parallel_state

    # torch.fx logs a deprecation note on every rank when Megatron checks for tracing: noise here.
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)

    parallel_state.initialize_model_parallel(context_parallel_size=world)
    try:
        group = parallel_state.get_context_parallel_group() if world > 1 else None
        cp_rank = parallel_state.get_context_parallel_rank()
        models = _models_for(model_name, cfg, seed, world, opts)
        result = ParityResult(cp_size=world)
        result.checks["model"] = model_name
        device = torch.device("cuda", torch.cuda.current_device()) if opts.device == "cuda" else torch.device("cpu")
        for dtype_name in dtypes:
            dtype = torch.float64 if opts.reference else DTYPES[dtype_name]
            overrides = PRECISION_OVERRIDES.get(dtype_name)
            actor = models.build(dtype, device=device, overrides=overrides)
            critic = models.build(dtype, value_head=True, device=device, overrides=overrides)
            if opts.sparse_core != "dense":
                for built in (actor, critic):
                    models.use_sparse_core(built, opts.sparse_core)
                if opts.linear_chunk_rows:
                    seqlen.use_linear_chunk_rows(opts.linear_chunk_rows)
            if opts.query_chunk_rows:
                for built in (actor, critic):
                    seqlen.use_query_chunk_rows(built, opts.query_chunk_rows)
            min_rows = models.min_local_rows(actor)
            for batch_name, lengths in batches.items():
                input_ids, targets = _batch(lengths, models.vocab, seed + 2, device)
                taped = routes.attach_for_run(opts, (dtype_name, batch_name), actor, critic, input_ids, min_rows, world, cp_rank)
                actor.zero_grad(set_to_none=True)
                critic.zero_grad(set_to_none=True)
                replay = batch_name.endswith(seqlen.REPLAY_SUFFIX)  # the actor replays its own recorded indexer choices
                if replay:
                    seqlen.record_and_load(actor, lambda: _forward(actor, input_ids, "contiguous", cp_rank, min_rows, world))
                per_token, loss = _actor_step(actor, input_ids, "contiguous", cp_rank, min_rows, world, group, hash_ids_shift)
                loss.backward()
                if replay:
                    seqlen.stop_replay(actor)
                values, value_loss = _critic_step(critic, input_ids, targets, "contiguous", cp_rank, min_rows, world, hash_ids_shift)
                value_loss.backward()
                aux = models.aux_losses(actor)
                result.results[(dtype_name, batch_name)] = {
                    **aux,
                    "log_probs": _np(per_token[:, 0]),
                    "entropy": _np(per_token[:, 1]),
                    "loss": np.array([loss.item()]),
                    "grads": _grads(actor, group),
                    "values": _np(values),
                    "value_loss": np.array([value_loss.item()]),
                    "value_grads": _grads(critic, group),
                }
                if taped is not None:
                    plan, tapes = taped
                    result.routes[(dtype_name, batch_name)] = {role: routes.collect(t, plan, group) for role, t in tapes.items()}
                    routes.detach(actor), routes.detach(critic)
        if layout_checks and world > 1:
            dtype = torch.float64 if opts.reference else DTYPES[dtypes[0]]
            actor = models.build(dtype, device=device, overrides=PRECISION_OVERRIDES.get(dtypes[0]))
            min_rows = models.min_local_rows(actor)
            input_ids, _ = _batch(batches[next(iter(batches))], models.vocab, seed + 2, device)
            try:
                with torch.no_grad():
                    _actor_step(actor, input_ids, "zigzag", cp_rank, min_rows, world, group)
                result.checks["zigzag_error"] = None
            except ValueError as err:
                result.checks["zigzag_error"] = str(err)
            with models.layout_guard_bypassed(), torch.no_grad():
                per_token, _ = _actor_step(actor, input_ids, "zigzag", cp_rank, min_rows, world, group)
            result.checks["zigzag_bypassed_log_probs"] = _np(per_token[:, 0])
            if models.has_hash_layers:
                with torch.no_grad():
                    per_token, _ = _actor_step(actor, input_ids, "contiguous", cp_rank, min_rows, world, group, hash_ids_shift=1)
                result.checks["hash_shifted_log_probs"] = _np(per_token[:, 0])
            if getattr(actor, "mtp_block", None) is not None and model_name != "production":
                from verl_ds4.models.ds4 import mtp  # the control flips this project model's roll (not dev's)

                # Many short sequences: each sequence end is a row the bad roll gives the next one's token.
                mtp_ids, _ = _batch(MTP_CONTROL, models.vocab, seed + 3, device)
                # A random model's CE hardly depends on which label a row gets, so the control reads
                # the MTP gradients (softmax - onehot(label): a changed label changes them by O(1)).
                grads = []
                for respect in (True, False):
                    mtp._RESPECT_SEQUENCE_BOUNDARIES = respect  # this forked rank only; a negative control
                    try:
                        actor.zero_grad(set_to_none=True)
                        _actor_step(actor, mtp_ids, "contiguous", cp_rank, min_rows, world, group)[1].backward()
                    finally:
                        mtp._RESPECT_SEQUENCE_BOUNDARIES = True
                    grads.append({n: g for n, g in _grads(actor, group).items() if param_group(n) == "mtp"})
                result.checks["mtp_roll"] = tuple(grads)
            replayed = [b for b in batches if b.endswith(seqlen.REPLAY_SUFFIX)]
            if replayed:  # replaying another valid choice must change the log-probs (the replay takes effect)
                replay_ids, _ = _batch(batches[replayed[0]], models.vocab, seed + 2, device)
                per_token, _ = seqlen.replaying_other_blocks(
                    actor, lambda: _forward(actor, replay_ids, "contiguous", cp_rank, min_rows, world),
                    lambda: _actor_step(actor, replay_ids, "contiguous", cp_rank, min_rows, world, group))  # fmt: skip
                result.checks["replay_other_blocks"] = (replayed[0], _np(per_token[:, 0]))
            result.checks["dtype"] = dtypes[0]
        return result if rank == 0 else None
    finally:
        parallel_state.destroy_model_parallel()


def run_parity(
    cp_size: int,
    dtypes=("fp64",),
    batches: dict[str, tuple[int, ...]] | None = None,
    cfg=None,
    seed: int = 1234,
    layout_checks: bool = True,
    timeout: float = 600.0,
    model: str = "ds4",
    hash_ids_shift: int = 0,
    options: RunOptions | None = None,
) -> ParityResult:
    """Run ``model`` at ``cp_size`` on that many gloo processes (``options.device="cuda"``: nccl processes,
    one GPU each); returns rank 0's gathered results.

    ``hash_ids_shift`` (a test hook) hands every hash layer this rank's ids rolled by that many rows.
    """
    options = options or RunOptions()
    from verl_ds4.mcore.distributed import run_distributed

    made_folder = None  # a production folder this call writes, and removes after the run
    if model == "production":
        import dataclasses

        from verl_ds4.verify.production import require_megatron_dev, write_harness_folder

        require_megatron_dev()
        if options.production_folder is None:
            made_folder = write_harness_folder(cfg, seed)
            options = dataclasses.replace(options, production_folder=made_folder)
    from verl_ds4.models.ds4 import model as _ds4_model  # noqa: F401  (import megatron once in the parent: forked ranks start fast)

    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}.")
    if model not in MODELS:
        raise ValueError(f"model={model!r}; expected one of {MODELS}.")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise ValueError(f"unknown dtype(s) {unknown}; choose from {sorted(DTYPES)}.")
    batches = dict(batches or {"ragged": RAGGED, "short": SHORT})
    cuda = options.device == "cuda"
    try:
        results = run_distributed(
            _worker,
            world_size=cp_size,
            args=(model, cfg, tuple(dtypes), batches, seed, layout_checks, hash_ids_shift, options),
            timeout=timeout,
            # CUDA ranks start in a clean interpreter (a forked CUDA context is unusable) and talk over nccl.
            **({"backend": "nccl", "start_method": "spawn"} if cuda else {}),
        )
    finally:
        if made_folder is not None:
            import shutil

            shutil.rmtree(made_folder, ignore_errors=True)
    return results[0]


DEFAULT_TOLERANCES = {"fp64": 1e-10, "fp32": 1e-3}


def compare(result: ParityResult, reference: ParityResult, tolerances: dict[str, float] | None = None) -> list[Row]:
    """Rows of (quantity, max abs diff, max rel diff, tolerance) of ``result`` against ``reference`` (CP = 1)."""
    tolerances = {**DEFAULT_TOLERANCES, **(tolerances or {})}
    rows: list[Row] = []
    for key, ours in result.results.items():
        dtype_name, batch_name = key
        ref = reference.results[key]
        tol = tolerances[dtype_name]
        prefix = f"{dtype_name} {batch_name}"
        for q in ("loss", "mtp_loss", "indexer_loss", "log_probs", "entropy", "values", "value_loss"):
            if q in ref or q in ours:
                rows.append(Row(f"{prefix} {q}", *(max_diff(ours[q], ref[q]) if q in ours and q in ref else (math.inf, math.inf)), tol))
        groups = {param_group(n) for n in ref["grads"]}
        for g in GRAD_GROUPS:
            if g not in groups:
                continue
            pick = lambda d: {n: v for n, v in d.items() if param_group(n) == g}  # noqa: E731
            d_abs, d_rel, n, without = group_diff(pick(ours["grads"]), pick(ref["grads"]))
            note = f"; {without} without grad" + (": indexer" if g == "attention" else "") if without else ""
            rows.append(Row(f"{prefix} grads {g} ({n} params{note})", d_abs, d_rel, tol))
        d_abs, d_rel, n, without = group_diff(ours["value_grads"], ref["value_grads"])
        note = f"; {without} without grad: indexer" if without else ""
        rows.append(Row(f"{prefix} value_grads, all ({n} params{note})", d_abs, d_rel, tol))
    checks = result.checks
    if "replay_other_blocks" in checks:
        batch_name, log_probs = checks["replay_other_blocks"]
        d_abs, d_rel = max_diff(log_probs, reference.results[(checks["dtype"], batch_name)]["log_probs"])
        rows.append(Row("indexer replay of other valid blocks: log_probs must differ", d_abs, d_rel, ZIGZAG_MIN_REL, expect="differ"))
    if "zigzag_error" in checks:
        message = checks["zigzag_error"]
        rejected = message is not None and "contiguous" in message
        flag = 0.0 if rejected else math.inf
        rows.append(Row("zigzag rows rejected by DS4 attention", flag, flag, 0.0, expect="error"))
        first_batch = next(b for (d, b) in reference.results if d == checks["dtype"])
        ref = reference.results[(checks["dtype"], first_batch)]["log_probs"]
        d_abs, d_rel = max_diff(checks["zigzag_bypassed_log_probs"], ref)
        rows.append(Row("zigzag with guard bypassed: log_probs must differ", d_abs, d_rel, ZIGZAG_MIN_REL, expect="differ"))
        if "hash_shifted_log_probs" in checks:
            d_abs, d_rel = max_diff(checks["hash_shifted_log_probs"], ref)
            rows.append(Row("hash ids packed one row off: log_probs must differ", d_abs, d_rel, ZIGZAG_MIN_REL, expect="differ"))
        if "mtp_roll" in checks:
            within, across = checks["mtp_roll"]
            d_abs, d_rel, _, _ = group_diff(across, within)
            rows.append(Row(f"MTP roll across sequence ends ({len(MTP_CONTROL)} sequences): grads mtp must differ",
                            d_abs, d_rel, ZIGZAG_MIN_REL, expect="differ"))
    return rows


ZIGZAG_MIN_REL = 1e-3


def format_table(rows: list[Row], title: str = "", notes: list[str] | None = None) -> str:
    """The table; ``notes``: the lines under it (default: V4's rel definition and batches)."""
    width = max(len(r.quantity) for r in rows) + 2
    lines = [title] if title else []
    lines.append(f"{'quantity':<{width}}{'max abs diff':>14}{'max rel diff':>14}  result")
    lines.append("-" * (width + 48))
    for r in rows:
        if r.expect == "absent":
            lines.append(f"{r.quantity:<{width}}{'-':>14}{'-':>14}  n/a")
            continue
        bound = {"match": f"<= {r.tol:.0e}", "differ": f">  {r.tol:.0e}", "error": "ValueError raised"}[r.expect]
        lines.append(f"{r.quantity:<{width}}{r.max_abs:>14.3e}{r.max_rel:>14.3e}  {'pass' if r.passed else 'FAIL'} ({bound})")
    if notes is not None:
        lines.extend(notes)
        return "\n".join(lines)
    lines.append("rel = max|x_cp - x_cp1| / max|x_cp1| per quantity (for a gradient group: over all its parameters).")
    lines.append(
        f"Batches: ragged = {len(RAGGED)} sequences, {sum(RAGGED)} tokens (straddling rank boundaries); "
        f"short = {len(SHORT)} sequences, {sum(SHORT)} tokens (padded to cp * 128 rows)."
    )
    return "\n".join(lines)
