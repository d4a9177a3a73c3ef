"""Activations, transients and logits of one DS4 step on one GPU: the dynamic half of the peak (pure Python).

:mod:`verl_ds4.memory.stages` counts the states (weights, gradients, optimizer); this module counts
what a step adds on top, per pipeline stage, for the attention kernel path and the recompute a recipe
configures. Every term is a named tensor with its bytes per token (:class:`Term`); ``docs/memory.md``
lists them and ``benchmarks/gpu/memory_calibration.py --compare`` checks them against measured peaks.

Shapes: ``T`` rows per GPU per micro-batch (after CP: a GPU holds its token budget), ``S`` the longest
sequence, ``W`` the window (128), ``r`` a layer's compression ratio, ``k`` the indexer top-k, ``n_h``
heads of ``d``, ``n_I`` indexer heads of ``d_I``, ``h`` hidden, ``n`` mHC streams, ``k_e`` experts per
token of width ``I``, ``V`` the vocabulary. A layer's attention keys per query ``K``: ``W`` (ratio 0),
``W + S / r`` (HCA: every completed block), ``W + min(k, S / r)`` (CSA and V4.1's top-k layers). The
rows of one rank's packed key buffer ``n_kv = T + cp x T / r`` (+ the ``W`` halo rows under CP: the
compressed KV is all-gathered over CP).

The peak of one training step on a stage (``in_flight`` micro-batches: :func:`verl_ds4.memory.micro_batches.in_flight`)::

    states + (in_flight - 1) x kept(stage) + max over the stage's layers i of
        [kept(layers before i) + backward transient(i) (+ kept(i) when it is recomputed)],
    or + the loss buffers of the logits on the last stage, whichever is larger,
    + the expert-parallel all-to-all buffers of one layer + the allocator margin.

A forward-only pass (log-probs, reference, values) keeps nothing: one layer's forward transient plus
the logits. Attention kernel paths (Megatron-LM ``dev``'s ``dsa_kernel_backend``):

* ``unfused`` (``none``, Megatron's ``TransformerConfig`` default, what Megatron-Bridge's Hopper recipes
  run): ``csa.py`` ``unfused_compressed_sparse_attn`` gathers ``kv_full`` (``[n_kv, d]``) through an
  ``expand`` to ``[T, K, d]`` and keeps it in fp32 with the fp32 score chain; the gather's backward
  (``GatherBackward``: ``new_zeros`` of the *expanded* size) allocates ``[T, n_kv, d]`` bf16, which is
  quadratic in ``T`` and is what decides feasibility on Hopper. The naive indexer (``dsa.py``
  ``fwd/bwd_fused_indexer_loss_naive``, run on single-rank THD even at loss coefficient 0) adds
  ``[T, n_I, T/4]`` fp32 scores, smaller than the gather's.
* ``fused`` (``cudnn``: FlashMLA's sparse forward, cuDNN-frontend's sparse backward, SM90 and SM100):
  keeps ``q``, ``kv``, ``out``, ``lse``, the top-k ids and the indexer's precomputed gradients; its only
  ``T x S`` term is the indexer's ``[T, S/4]`` fp32 scores (one copy; 4 with the dense indexer loss),
  transient. No quadratic backward.
* ``linear`` (``none`` with the engine's ``sparse_attention: linear``, recipe knob ``ds4.sparse_attention``):
  Megatron's unfused layers with verl-ds4's row-chunked core (:mod:`verl_ds4.kernels.sparse_attention`)
  in place of ``unfused_compressed_sparse_attn``, and the indexer's top-k scoring and dense loss chunked
  over query rows. The core keeps for backward the bf16 query ``[T, n_h, d]``, the ids ``[T, K]`` int32 and
  the fp32 log-sum-exp ``[T, n_h]`` (``kv_full`` is the layer's own input, counted once as the fused path
  does); its backward allocates ``grad_q`` (bf16), an fp32 gradient of ``kv_full`` and one chunk of query
  rows' work space (at most :data:`CHUNK_BYTES`). Every term is linear in ``T``; the layer's other terms
  are the unfused path's. Not yet measured on a GPU: +-25% on the attention terms (docs/memory.md).
* ``reference``: this project's pure-PyTorch DS4 attention (the CPU model), used only to calibrate the
  model against a GPU (``memory_calibration.py``); its terms were counted from autograd's saved tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl_ds4 import ds4_facts
from verl_ds4.memory.terms import CHUNK_BYTES, logits_step_bytes

__all__ = [
    "ATTENTION_PATHS", "CHUNK_BYTES", "DEFAULT_HEADROOM", "DSA_BACKENDS", "SPARSE_ATTENTION_OF_PATH", "path_of", "check_headroom", "PATH_OF_BACKEND", "CALIBRATION_LOGITS_BYTES", "LOGITS_KERNELS", "MARGIN_FIXED_GIB", "MARGIN_FRACTION",
    "RECOMPUTE_MODULES", "StepShape", "StepPeak", "Term", "layer_kept", "layer_backward", "layer_forward", "step_peak",
]

GIB = float(1 << 30)

#: Attention kernel paths of Megatron-LM dev a recipe can run, and their ``dsa_kernel_backend``.
ATTENTION_PATHS = ("unfused", "fused", "linear")
#: Megatron's two backends (``linear`` runs ``none`` with verl-ds4's core: :data:`SPARSE_ATTENTION_OF_PATH`).
DSA_BACKENDS = {"unfused": "none", "fused": "cudnn"}
PATH_OF_BACKEND = {v: k for k, v in DSA_BACKENDS.items()}
#: The engine's ``sparse_attention`` (recipe knob ``ds4.sparse_attention``) each path runs with.
SPARSE_ATTENTION_OF_PATH = {"unfused": "megatron", "fused": "megatron", "linear": "linear"}
#: ``recompute_modules`` entries whose effect the model knows (Megatron's names; ``core_attn`` is refused by DS4).
RECOMPUTE_MODULES = ("moe_act", "mhc", "mla_up_proj", "layernorm", "moe", "shared_experts", "mlp")

#: The logits' loss buffers per pass and kernel (``sft``, ``actor``, ``logprob``, ``ref``, ``value``; unfused or
#: fused): :func:`verl_ds4.memory.terms.logits_step_bytes`. ``calibration``: memory_calibration.py's cross entropy
#: (bf16 logits, fp32 log-softmax output, the fp32 gradients of the NLL and log-softmax), bytes per ``[T, V]`` entry.
CALIBRATION_LOGITS_BYTES = 14
#: What computes the logits step (``RoleInput.logits_kernel``): verl's non-fused path or its fused Triton kernel.
LOGITS_KERNELS = ("unfused", "fused")

#: The allocator margin: CUDA context, NCCL communicators and cuBLAS workspaces (fixed) plus the caching
#: allocator's fragmentation (a fraction of what the step allocates on top of the states).
MARGIN_FIXED_GIB = 2.0
MARGIN_FRACTION = 0.05
#: The one headroom rule of the start-up check and ``plan --fit``: a role fits when its peak (the
#: allocator margin included) is at most ``(1 - headroom)`` of the GPU. It covers the model's own
#: uncertainty (docs/memory.md, "Calibration"). ``ds4.memory_headroom`` / ``--headroom`` change it.
DEFAULT_HEADROOM = 0.10


def path_of(backend, sparse_attention) -> str:
    """The attention path of Megatron's ``dsa_kernel_backend`` and the engine's ``sparse_attention`` (an unknown
    backend is the unfused default; the validator refuses it, and ``linear`` with ``cudnn``, before this counts)."""
    path = PATH_OF_BACKEND.get(str(backend or "none"), "unfused")
    return "linear" if path == "unfused" and str(sparse_attention or "megatron") == "linear" else path


def check_headroom(value: float) -> float:
    """``value`` if it is a fraction in [0, 1); else ``ValueError`` saying so."""
    if not 0.0 <= value < 1.0:
        raise ValueError(f"headroom is {value}; expected a fraction in [0, 1) of the GPU kept free (default {DEFAULT_HEADROOM}).")
    return value


#: Rows per chunk of Megatron's unfused indexer under CP (``csa_utils/cp_utils.py``: 128 query rows).
_CP_INDEXER_CHUNK = 128


@dataclass(frozen=True)
class Term:
    """One tensor kept or allocated by a step, in bytes per token of the micro-batch."""

    name: str
    bytes_per_token: float


@dataclass(frozen=True)
class StepShape:
    """What one micro-batch looks like to one GPU."""

    tokens: int  # T: rows per GPU (after CP)
    cp: int = 1
    max_seq_len: int | None = None  # S; default T x cp
    window: int = 128

    @property
    def seq(self) -> int:
        return self.max_seq_len or self.tokens * self.cp

    def keys(self, s, ratio: int) -> int:
        """K: keys one query attends to in a layer of ``ratio``."""
        if not ratio:
            return self.window
        if ratio == ds4_facts.CSA_RATIO or ratio < ds4_facts.CSA_RATIO:  # V4's CSA; V4.1's ratio 1 / 2 top-k layers
            return self.window + min(s.index_topk, self.seq // ratio)
        return self.window + self.seq // ratio

    def kv_rows(self, ratio: int) -> float:
        """n_kv: rows of one rank's packed key buffer (window KV + the gathered compressed KV)."""
        compressed = 0.0 if not ratio else self.cp * self.tokens / ratio
        return self.tokens + compressed + (self.window if self.cp > 1 else 0)


def _common(s, recompute: frozenset[str], path: str) -> list[Term]:
    """Kept outside the core attention: projections, norms, both mHC sites, the router and experts."""
    h, n, nh, d, k, inter = s.hidden_size, s.hc_mult, s.num_attention_heads, s.head_dim, s.num_experts_per_tok, s.moe_intermediate_size
    if path == "reference":  # this project's CPU model, counted from autograd's saved tensors (see the module doc)
        mhc = 2 * (2 * n * h + 41 * (n * n + n) + 3 * n)
        return [
            Term("mHC streams, their RMS and the Sinkhorn iterates, both sites", 2 * mhc),
            Term("norms: input, normalised, sub-layer output, mixed input, both sites [T, h]", 2 * 8 * h),
            Term("q down-projection and its norm [T, r_q]; KV and its norm [T, d]; grouped output [T, g r_o]",
                 2 * (3 * s.q_lora_rank + 2 * d + s.o_groups * s.o_lora_rank)),
            Term("queries after the RMS and RoPE [T, n_h, d]; the grouped output's copy", 2 * 3 * nh * d),
            Term("routed experts: dispatched rows, fc1 output, SwiGLU and output per top-k row", 2 * k * (3 * h + 6 * inter + 1)),
            Term("shared expert; router scores and top-k", 2 * (6 * inter * s.n_shared_experts + 3 * s.n_routed_experts + k + 3)),
        ]
    act = 0 if "moe_act" in recompute else inter
    terms = [
        Term("attention projections: q down + norm [T, r_q], KV + norm [T, d], output-group input [T, g r_o], "
             "attention output [T, n_h d]", 2 * (3 * s.q_lora_rank + 2 * d + s.o_groups * s.o_lora_rank + nh * d)),
        Term("q up-projection and its per-head RMS [T, n_h, d] (mla_up_proj recomputes them)",
             0 if "mla_up_proj" in recompute else 2 * 2 * nh * d),
        Term("layer norms' inputs [T, h] (layernorm recomputes them)", 0 if "layernorm" in recompute else 2 * 2 * h),
        Term("mHC streams of both sites [T, n, h]" + (" (mixing recomputed: mhc)" if "mhc" in recompute else " and their mixing"),
             2 * 2 * n * h * (1 if "mhc" in recompute else 2)),
    ]
    if "moe" in recompute or "mlp" in recompute:
        terms.append(Term("MoE block input [T, h] (moe recomputes the block)", 2 * h))
    else:
        terms.append(Term("routed experts per top-k row: permuted input [h], fc1 output [2I], SwiGLU output [I] (moe_act drops it)",
                          2 * k * (h + 2 * inter + act)))
        terms.append(Term("router logits and probabilities [T, E] fp32", 2 * 4 * s.n_routed_experts))
        if "shared_experts" not in recompute:
            terms.append(Term("shared expert: fc1 output [2I], SwiGLU output [I]", 2 * s.n_shared_experts * (2 * inter + act)))
    return terms


def _v41_extra(s, layer: int | None) -> list[Term]:
    """V4.1's Engram layers: the gathered table rows and their projected key / value."""
    if layer is None or layer not in getattr(s, "engram_layers", ()):
        return []
    width = (s.engram_max_ngram_size - 1) * s.engram_n_heads * s.engram_head_dim
    return [Term("Engram: gathered n-gram rows and projected key / value", 2 * 3 * width)]


def layer_kept(s, ratio: int, path: str, shape: StepShape, recompute: frozenset[str] = frozenset(), layer: int | None = None) -> list[Term]:
    """What one decoder layer of ``ratio`` keeps for backward on ``path`` (per token)."""
    nh, d, w = s.num_attention_heads, s.head_dim, shape.window
    terms = _common(s, recompute, path) + _v41_extra(s, layer)
    if ratio:
        pool = 2 if ratio == ds4_facts.CSA_RATIO else 1
        terms.append(Term("compressor: pooled values and gate softmax", 2 * 2 * pool * d))
    if path == "reference":
        nb = 0.0 if not ratio else shape.cp * shape.tokens / ratio
        return terms + [
            Term("window keys, the einsum's [T, d, W] copy", 2 * d * w),
            Term("softmax output [T, n_h, W + NB + 1] and the visible mask [T, NB]", 2 * nh * (w + nb + 1) + nb),
            Term("RoPE tables, per-head rsqrt", 2 * (3 * 32 + nh + 4)),
        ]
    k = shape.keys(s, ratio)
    if path == "unfused":
        return terms + [
            Term("gathered keys kv_g [T, K, d] fp32 (unfused_compressed_sparse_attn)", 4 * k * d),
            Term("score chain: scores, masked, exp, attention weights [T, n_h, K] fp32", 4 * 4 * nh * k),
            Term("fp32 queries q_f [T, n_h, d]", 4 * nh * d),
            Term("gather indices [T, K] int64", 8 * k),
        ]
    if path == "linear":
        terms += [
            Term("linear core: query [T, n_h, d] bf16, top-k ids [T, K] int32, log-sum-exp [T, n_h] fp32", 2 * nh * d + 4 * k + 4 * nh),
            Term("kv_full [T + n_comp, d] bf16", 2 * d * shape.kv_rows(ratio) / shape.tokens),
        ]
        if _has_indexer(s, ratio, shape):
            terms.append(Term("chunked indexer loss: indexer query [T, n_I, d_I] and weights [T, n_I] bf16",
                              2 * (s.index_n_heads * s.index_head_dim + s.index_n_heads)))
        return terms
    if path == "fused":
        kpad = -(-k // 128) * 128
        terms += [
            Term("q and out [T, n_h, d] bf16, lse [T, n_h] fp32 (CSASparseAttnFunc)", 2 * 2 * nh * d + 4 * nh),
            Term("kv_full [T + n_comp, d] bf16", 2 * d * shape.kv_rows(ratio) / shape.tokens),
            Term("top-k ids [T, K padded to 128] int32", 4 * kpad),
        ]
        if ratio and k > w and ratio <= ds4_facts.CSA_RATIO:
            ni, di = s.index_n_heads, s.index_head_dim
            terms.append(Term("indexer's precomputed gradients d q_I [T, n_I, d_I], d w [T, n_I] fp32", 4 * (ni * di + ni)))
        return terms
    raise ValueError(f"unknown attention path {path!r}; expected one of {ATTENTION_PATHS}.")  # error-catalogue: internal: the validator refused unknown paths before


def _indexer_rows(shape: StepShape) -> float:
    """Query rows the unfused indexer scores at once: the whole buffer on one rank, 128-row chunks under CP."""
    return shape.tokens if shape.cp == 1 else min(shape.tokens, _CP_INDEXER_CHUNK)


def _has_indexer(s, ratio: int, shape: StepShape) -> bool:
    """A layer whose keys come from the indexer's top-k (V4's CSA, V4.1's ratio 1 / 2 / 4 top-k layers)."""
    return 0 < ratio <= ds4_facts.CSA_RATIO and shape.keys(s, ratio) > shape.window


def _chunk_per_token(row_bytes: float, shape: StepShape) -> float:
    """One chunk's work space per token: ``min(CHUNK_BYTES, T x row bytes) / T`` (a chunk never exceeds T rows)."""
    return min(CHUNK_BYTES / shape.tokens, row_bytes)


def _linear_indexer_chunk(s, ratio: int, shape: StepShape) -> float:
    """The chunked indexer's work space per token: rows x the global compressed keys x (3 n_I + 8) fp32, at most a chunk."""
    keys = shape.cp * shape.tokens / ratio
    return _chunk_per_token(4 * (3 * s.index_n_heads + 8) * keys, shape)


def layer_backward(s, ratio: int, path: str, shape: StepShape) -> list[Term]:
    """The transients one layer's backward allocates on ``path``, each at its own moment (the peak takes the largest)."""
    nh, d, w = s.num_attention_heads, s.head_dim, shape.window
    k = shape.keys(s, ratio)
    if path == "reference":
        nb = 0.0 if not ratio else shape.cp * shape.tokens / ratio
        return [Term("softmax gradient [T, n_h, W + NB + 1] and the window keys' gradient [T, W, d]", 2 * nh * (w + nb + 1) + 2 * d * w)]
    if path == "unfused":
        terms = [Term("GatherBackward: new_zeros of the expanded kv [T, n_kv, d] bf16, the [T, K, d] gradient, dq fp32",
                      2 * d * shape.kv_rows(ratio) + 2 * k * d + 4 * nh * d)]
        if ratio == ds4_facts.CSA_RATIO:  # the naive dense indexer loss's backward: scores, their gradient, relu mask
            terms.append(Term("naive indexer loss backward: ~5 x [T, n_I, T/4] fp32",
                              5 * 4 * s.index_n_heads * shape.cp * _indexer_rows(shape) / ratio))
        return terms
    if path == "fused":
        return [Term("dq [T, n_h, d] fp32, dkv [n_kv, d]", 4 * nh * d + 4 * d * shape.kv_rows(ratio) / shape.tokens)]
    if path == "linear":
        row = 4 * (2 * k * d + 4 * nh * k + 3 * nh * d)  # a query row's gathered keys, their gradient, 4 score tensors
        terms = [Term("linear core backward: grad_q [T, n_h, d] bf16, grad kv_full [n_kv, d] fp32 and its bf16 cast, "
                      "one chunk of rows (<= 256 MiB)",
                      2 * nh * d + 6 * d * shape.kv_rows(ratio) / shape.tokens + _chunk_per_token(row, shape))]
        if _has_indexer(s, ratio, shape):
            ni, di = s.index_n_heads, s.index_head_dim
            terms.append(Term("chunked indexer loss backward: grads of q_I [T, n_I, d_I], w [T, n_I] fp32, one chunk (<= 256 MiB)",
                              4 * (ni * di + ni) + _linear_indexer_chunk(s, ratio, shape)))
        return terms
    raise ValueError(f"unknown attention path {path!r}; expected one of {ATTENTION_PATHS}.")  # error-catalogue: internal: the validator refused unknown paths before


def layer_forward(s, ratio: int, path: str, shape: StepShape, dense_indexer_loss: bool = False) -> list[Term]:
    """One layer's live tensors in a forward-only pass (nothing kept across layers)."""
    nh, d = s.num_attention_heads, s.head_dim
    k = shape.keys(s, ratio)
    terms = [Term("the layer's activations while it runs", sum(t.bytes_per_token for t in _common(s, frozenset(), path)))]
    if path == "unfused":
        terms.append(Term("gathered keys [T, K, d] bf16 + fp32 copy, scores [T, n_h, K] fp32 x 2", 6 * k * d + 2 * 4 * nh * k))
        if ratio == ds4_facts.CSA_RATIO:
            terms.append(Term("naive indexer top-k scores [T, n_I, T/4] fp32 x 2", 2 * 4 * s.index_n_heads * shape.cp * _indexer_rows(shape) / ratio))
    elif path == "linear":
        row = 4 * (k * d + 2 * nh * k + nh * d)  # a query row's gathered keys, scores and their exp, the output
        terms.append(Term("q, out [T, n_h, d] bf16, lse fp32, one chunk of rows (<= 256 MiB)",
                          2 * 2 * nh * d + 4 * nh + _chunk_per_token(row, shape)))
        if _has_indexer(s, ratio, shape):
            terms.append(Term("chunked indexer top-k scores (<= 256 MiB)", _linear_indexer_chunk(s, ratio, shape)))
    elif path == "fused":
        terms.append(Term("q, out [T, n_h, d] bf16", 2 * 2 * nh * d))
        if ratio and ratio <= ds4_facts.CSA_RATIO:
            terms.append(Term("indexer scores [T, S/4] fp32", 4 * shape.seq / ratio * (4 if dense_indexer_loss else 1)))
    else:
        terms += layer_kept(s, ratio, path, shape)
    return terms


def _bytes(terms: list[Term]) -> float:
    return sum(t.bytes_per_token for t in terms)


@dataclass(frozen=True)
class StepPeak:
    """The dynamic part of one stage's peak (GiB per GPU)."""

    activations_gib: float  # kept for backward by the other micro-batches in flight (and the layers before the peak)
    transient_gib: float  # what the peak moment adds: a layer's backward (or forward), or the loss buffers
    logits_gib: float  # the loss buffers of the last stage's logits
    a2a_gib: float  # expert-parallel all-to-all buffers of one layer
    margin_gib: float  # allocator margin
    detail: str = ""  # which moment decides

    @property
    def dynamic_gib(self) -> float:
        return self.activations_gib + self.transient_gib + self.a2a_gib + self.margin_gib


def step_peak(
    s,
    ratios: list[int],
    *,
    path: str,
    shape: StepShape,
    in_flight: float = 1,
    training: bool = True,
    recompute: frozenset[str] | None = frozenset(),
    logits: str | None = None,
    logits_kernel: str = "unfused",
    mtp_depths: int = 0,
    ep: int = 1,
    tp: int = 1,
    layer_ids: list[int | None] | None = None,
    dense_indexer_loss: bool = False,
    margin: bool = True,
) -> StepPeak:
    """Activations + transients of one stage holding layers of ``ratios`` (``recompute=None``: full recompute).

    ``logits``: the pass whose loss buffers the stage holds (the last stage: ``sft``, ``actor``, ``logprob``, ``ref``,
    ``value``, or ``calibration``; None: none), computed by ``logits_kernel`` (:data:`LOGITS_KERNELS`) over this
    rank's ``V / tp`` vocabulary rows (:func:`verl_ds4.memory.terms.logits_step_bytes`)."""
    t = shape.tokens
    layer_ids = layer_ids or [None] * len(ratios)
    head, head_fixed = _logits(s, logits, logits_kernel, mtp_depths if training else 0, tp)
    a2a = 0.0 if ep <= 1 else 2 * 2 * s.num_experts_per_tok * s.hidden_size  # dispatch + combine buffers, bf16
    if not training:
        fwd = max((_bytes(layer_forward(s, r, path, shape, dense_indexer_loss)) for r in ratios), default=0.0)
        kept_all, moment, detail = 0.0, fwd + head + head_fixed / t, f"one layer's forward and the {logits_kernel} logits"
    else:
        rec = frozenset() if recompute is None else recompute
        kept = [_bytes(layer_kept(s, r, path, shape, rec, i)) for r, i in zip(ratios, layer_ids)]
        if recompute is None:  # full recompute: each layer keeps its input streams; its backward recomputes it first
            stored = [2.0 * s.hc_mult * s.hidden_size] * len(kept)
        else:
            stored = kept
        kept_all = sum(stored)
        moment, detail, before = 0.0, "", 0.0
        for j, r in enumerate(ratios):
            largest = max(term.bytes_per_token for term in layer_backward(s, r, path, shape))
            here = before + largest + (kept[j] if recompute is None else 0.0)
            if here > moment:
                moment, detail = here, f"layer {j if layer_ids[j] is None else layer_ids[j]}'s backward"
            before += stored[j]
        if kept_all + head + head_fixed / t > moment:
            moment, detail = kept_all + head + head_fixed / t, f"the loss buffers of the {logits_kernel} logits"
        kept_all *= max(in_flight - 1, 0)
    activations, transient = kept_all * t / GIB, moment * t / GIB
    a2a_gib = a2a * t / GIB
    margin_gib = (MARGIN_FIXED_GIB + MARGIN_FRACTION * (activations + transient + a2a_gib)) if margin else 0.0
    return StepPeak(activations, transient, (head * t + head_fixed) / GIB, a2a_gib, margin_gib, detail)


def _logits(s, logits: str | None, kernel: str, mtp_depths: int, tp: int) -> tuple[float, int]:
    """(bytes per token, fixed bytes) of the logits step of pass ``logits`` on ``kernel`` (none: (0, 0))."""
    if logits is None:
        return 0.0, 0
    if logits == "calibration":
        return float(CALIBRATION_LOGITS_BYTES * s.vocab_size), 0
    if kernel not in LOGITS_KERNELS:
        raise ValueError(f"logits kernel {kernel!r}; expected one of {LOGITS_KERNELS}.")  # error-catalogue: internal: memory_inputs reads only these
    step = logits_step_bytes(logits, vocab=-(-s.vocab_size // max(tp, 1)), hidden=s.hidden_size, kind=kernel, mtp_depths=mtp_depths)
    return step.per_token, step.fixed
