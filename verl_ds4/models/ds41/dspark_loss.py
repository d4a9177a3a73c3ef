"""DSpark training of the V4.1 drafter: target features, anchors, draft blocks and the three-term loss.

One step, per packed micro-batch (the target backbone frozen for the drafter)::

    with DSparkFeatureCapture(target) as capture:          # DS41Model or DS41MegatronModel
        logits = target(...)                                # the packed rows (no CP)
    features, last = capture.local()                        # [rows, L * h], [rows, h], detached
    features = split_sequences(features, lengths, cu)       # per sequence (likewise last)
    out = objective(drafter, target, sequences, features, last, loss_masks, generator=g)
    out.loss.backward()                                     # reaches the drafter only

:func:`megatron_target_features` does the first four lines for the Megatron model through verl-ds4's
THD plan (contiguous CP: each rank's rows captured, then gathered and unpacked on every rank).

**Target features.** For each ``dspark_target_layer_ids`` layer, the residual streams entering that
layer's attention mHC site (after its Engram update), averaged over the ``hc_mult`` streams; the
layers concatenated: ``[rows, L * h]``. Also the final-norm output ``[rows, h]`` (the input of the
target's output layer: its next-token distribution is the probability-distance teacher). Both are
detached when captured. Under contiguous CP each rank captures its own rows; the drafter reads the
whole sequence (:func:`megatron_target_features` all-gathers the rows in rank order), so every CP rank runs
the same drafter step on the same anchors and holds the same drafter gradient (a reduction that
sums over CP must divide by the CP size; one that averages gets CP 1's gradient).

**Anchors.** Position ``a`` of a sequence of ``S`` tokens can anchor a block when ``loss_mask[a]``
and ``loss_mask[a + 1]`` are on (``a < S - 1``). :func:`sample_anchors` draws ``num_anchors``
distinct candidates uniformly (one uniform key per candidate from the caller's ``torch.Generator``,
the smallest keys win), sorted; fewer candidates leave dropped blocks (``keep`` false, anchor 0).
Explicit anchors are accepted instead and checked (:func:`check_anchors`).

**Blocks.** Block ``j`` (anchor ``a``, ``B = dspark_block_size`` slots) predicts tokens
``a + 1 .. a + B``. Its inputs are the embedding of the anchor token (the noise token for a dropped
block) then ``B - 1`` noise-token embeddings (``dspark_noise_token_id``), through the target's
embedding; the Markov head reads the previous token of each slot (the anchor, then the labels).
Draft logits are ``output_layer(normed) + transition`` with the target's output layer. A slot counts
while its label is inside the sequence, its ``loss_mask`` is on and every earlier slot of the block
counts (a contiguous prefix), in a kept block; weights are that mask, times
``exp(-k / decay_gamma)`` at slot ``k`` when ``decay_gamma`` is set.

**Loss** (NeMo Automodel 0.7.0's DSpark contract; sums over every block of every sequence)::

    ce   = sum w * CE(draft logits, label)                       / (sum w + eps)
    l1   = sum w * |softmax(draft) - softmax(teacher)|_1         / (sum w + eps)
    conf = sum w * BCE(confidence logit, clamp(1 - l1_k / 2, 0, 1) detached) / (sum w + eps)
    loss = ce_alpha * ce + l1_alpha * l1 + confidence_alpha * conf

with the teacher ``output_layer(final-norm output at a + k)``. The target's embedding and output
layer are read with their weights detached (frozen for the drafter; the released ``mtp.*`` has no
copies of them), and the drafter gets the features detached, so the loss never reaches the
backbone. Logits and the loss are computed in at least float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from verl_ds4 import ds41_facts
from verl_ds4.ds4_facts import Violation

from .dspark import draft_positions, draft_visibility

__all__ = [
    "DSparkLossConfig",
    "DSparkObjective",
    "DSparkLossOutput",
    "DSparkFeatureCapture",
    "anchor_candidates",
    "check_anchors",
    "split_sequences",
    "megatron_target_features",
    "sample_anchors",
]


def _frozen(tensor: torch.Tensor) -> torch.Tensor:
    """What the drafter may read of the target: no gradient path back (features, embedding, head)."""
    return tensor.detach()


def _stream_average(streams: torch.Tensor) -> torch.Tensor:
    """``[rows, n, h]`` -> ``[rows, h]``: the mean over the mHC streams."""
    return streams.mean(dim=-2)


def _refuse(problems: list[Violation], what: str) -> None:
    if problems:
        raise ValueError(f"{what}:\n" + "\n".join(f"  {p.engine_message()}" for p in problems))


# ------------------------------------------------------------------------------------------ config


@dataclass(frozen=True)
class DSparkLossConfig:
    """The DSpark objective's settings (NeMo Automodel's ``train_dspark`` defaults: CE 0.1, probability
    distance 0.9, confidence 1.0, no decay). ``confidence_alpha = 0`` leaves the confidence head out;
    ``denominator_eps`` guards the normalisers (NeMo's 1e-6)."""

    num_anchors: int
    ce_alpha: float = 0.1
    l1_alpha: float = 0.9
    confidence_alpha: float = 1.0
    decay_gamma: float | None = None
    confidence_stop_gradient: bool = False
    denominator_eps: float = 1e-6

    def __post_init__(self):
        problems = []
        if type(self.num_anchors) is not int or self.num_anchors <= 0:
            problems.append(Violation("num_anchors", self.num_anchors, "each sequence needs a positive integer "
                                      "number of draft blocks", "Set num_anchors to a positive integer (e.g. 512)."))  # fmt: skip
        for key in ("ce_alpha", "l1_alpha", "confidence_alpha"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                problems.append(Violation(key, value, "a loss weight must be a finite number >= 0", f"Set {key} to a "
                                          "number >= 0 (0 drops the term)."))  # fmt: skip
        if all(isinstance(getattr(self, k), (int, float)) and getattr(self, k) == 0 for k in ("ce_alpha", "l1_alpha", "confidence_alpha")):
            problems.append(Violation("ce_alpha", self.ce_alpha, "with l1_alpha and confidence_alpha also 0 nothing "
                                      "trains the drafter", "Give at least one term a positive weight."))  # fmt: skip
        gamma = self.decay_gamma
        if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not math.isfinite(gamma) or gamma <= 0):
            problems.append(Violation("decay_gamma", gamma, "the slot weights exp(-k / decay_gamma) need a finite "
                                      "decay_gamma > 0", "Set decay_gamma > 0, or null for equal slot weights."))  # fmt: skip
        if not isinstance(self.denominator_eps, (int, float)) or not self.denominator_eps >= 0:
            problems.append(Violation("denominator_eps", self.denominator_eps, "the normaliser guard must be >= 0",
                                      "Leave denominator_eps at 1e-6."))  # fmt: skip
        _refuse(problems, "DSpark loss settings refused")


# ------------------------------------------------------------------------------------- features


def _facts_of(model) -> Any:
    facts = getattr(model, "facts", None) or getattr(getattr(model, "decoder", None), "facts", None)
    if facts is None:
        raise TypeError(f"{type(model).__name__} is not a V4.1 backbone (DS41Model or DS41MegatronModel): no decoder facts.")
    return facts


class DSparkFeatureCapture:
    """Hooks that record, during one forward of a V4.1 backbone (:class:`~.model.DS41Model` or
    :class:`~.mcore_model.DS41MegatronModel`), the streams entering each target layer's attention mHC
    site and the final-norm output. ``layer_ids`` defaults to the config's ``dspark_target_layer_ids``."""

    def __init__(self, model, layer_ids: Sequence[int] | None = None):
        facts = _facts_of(model)
        self.layers, self.norm = model.decoder.layers, model.decoder.final_layernorm
        ids = list(facts.dspark_targets if layer_ids is None else layer_ids)
        n = len(self.layers)
        if not ids or ids != sorted(set(ids)) or any(type(i) is not int or not 0 <= i < n for i in ids):
            _refuse([Violation("dspark_target_layer_ids", ids, f"DSpark reads distinct backbone layers in [0, {n}), "
                               "increasing", "Give the checkpoint's dspark_target_layer_ids.")], "DSpark feature capture refused")  # fmt: skip
        self.layer_ids = ids
        self._seen: dict[Any, torch.Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> DSparkFeatureCapture:
        self._seen.clear()
        for i in self.layer_ids:
            hook = lambda _m, args, i=i: self._seen.__setitem__(i, _stream_average(_frozen(args[0])))  # noqa: E731
            self._handles.append(self.layers[i].attn_hc.register_forward_pre_hook(hook))
        self._handles.append(self.norm.register_forward_hook(lambda _m, _a, out: self._seen.__setitem__("last", _frozen(out))))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def local(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features [rows, L * h], last [rows, h])`` of this rank's rows from the last forward."""
        missing = [i for i in [*self.layer_ids, "last"] if i not in self._seen]
        if missing:
            raise RuntimeError(f"DSpark feature capture saw no forward through {missing}: run the backbone inside the `with`.")
        features = torch.cat([self._seen[i] for i in self.layer_ids], dim=-1)
        return features, self._seen["last"].reshape(features.shape[0], -1)


def split_sequences(rows: torch.Tensor, lengths: Sequence[int], cu_seqlens_padded: torch.Tensor | None = None) -> list[torch.Tensor]:
    """A whole packed buffer's rows ``[total, ...]`` (no CP, or gathered) -> each sequence's rows.
    ``cu_seqlens_padded``: the packed sequence starts (default: the sequences back to back). Under CP
    use :func:`megatron_target_features`, which gathers the ranks' rows through the THD plan."""
    lengths = [int(n) for n in lengths]
    cu = torch.tensor([0, *lengths]).cumsum(0) if cu_seqlens_padded is None else cu_seqlens_padded.long().cpu()
    if len(cu) != len(lengths) + 1 or int(cu[-1]) != rows.shape[0] or any(int(cu[i]) + n > int(cu[i + 1]) for i, n in enumerate(lengths)):
        raise ValueError(f"split_sequences: {len(lengths)} sequences of lengths {lengths} do not fit cu_seqlens_padded="
                         f"{cu.tolist()} over {rows.shape[0]} rows; pass the whole packed buffer (gathered over CP) and "
                         "its global padded offsets.")  # fmt: skip
    return [rows[int(cu[i]) : int(cu[i]) + n] for i, n in enumerate(lengths)]


def megatron_target_features(model, sequences: Sequence[torch.Tensor], cp_rank: int = 0, cp_size: int = 1, cp_group=None,
                             layer_ids: Sequence[int] | None = None):  # fmt: skip
    """One packed forward of a :class:`~.mcore_model.DS41MegatronModel` through verl-ds4's THD plan
    (contiguous layout, the model's ``min_local_rows``) with the features captured:
    ``(features [L_i, L * h] per sequence, last [L_i, h] per sequence, logits)`` -- features gathered
    over CP and unpacked (every rank gets every sequence), ``logits`` this rank's ``[1, rows, V]``
    (with their graph: the backbone's own loss can use them)."""
    from ..ds4.hf_check import pack_sequences

    _, plan, params, ids = pack_sequences(model, sequences, cp_rank, cp_size)
    with DSparkFeatureCapture(model, layer_ids) as capture:
        logits = model(ids, None, None, packed_seq_params=params)
    features, last = capture.local()
    group = cp_group if cp_size > 1 else None
    unpacked = [plan.unpack(t, group=group, cp_rank=cp_rank).unbind() for t in (features, last)]
    return list(unpacked[0]), list(unpacked[1]), logits


# -------------------------------------------------------------------------------------- anchors


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Bool ``[S - 1]``: position ``a`` can anchor a block (``loss_mask`` on at ``a`` and ``a + 1``)."""
    on = loss_mask.reshape(-1) > 0.5
    return on[:-1] & on[1:]


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(anchors [A], keep [A])``: ``min(A, candidates)`` distinct candidates drawn uniformly with
    ``generator`` (one float32 uniform key per position ``0..S-2``, whatever the default dtype; the
    smallest keys among candidates win), sorted; the rest dropped blocks (anchor 0, ``keep`` false).
    Same generator state, same anchors."""
    valid = anchor_candidates(loss_mask)
    anchors = torch.zeros(num_anchors, dtype=torch.long)
    keep = torch.zeros(num_anchors, dtype=torch.bool)
    if valid.numel() == 0:
        return anchors.to(loss_mask.device), keep.to(loss_mask.device)
    keys = torch.rand(valid.shape[0], generator=generator, dtype=torch.float32).masked_fill(~valid.cpu(), 2.0)
    count = min(int(valid.sum()), num_anchors)
    anchors[:count] = keys.argsort(stable=True)[:count].sort().values
    keep[:count] = True
    return anchors.to(loss_mask.device), keep.to(loss_mask.device)


def check_anchors(anchors: torch.Tensor, keep: torch.Tensor, loss_mask: torch.Tensor, num_anchors: int, sequence: int = 0) -> None:
    """Refuse explicit anchors that the sampler could not have drawn (the field, what, the fix)."""
    valid = anchor_candidates(loss_mask)
    problems = []
    if anchors.shape != (num_anchors,) or keep.shape != (num_anchors,) or keep.dtype != torch.bool:
        problems.append(Violation(f"anchors[{sequence}]", (tuple(anchors.shape), tuple(keep.shape), keep.dtype),
                                  f"expected anchors [num_anchors={num_anchors}] long and keep [{num_anchors}] bool",
                                  "Pass one (anchors, keep) pair per sequence, as sample_anchors returns."))  # fmt: skip
    else:
        kept = anchors[keep].tolist()
        bad = [a for a in kept if not 0 <= a < valid.shape[0] or not bool(valid[a])]
        if bad or kept != sorted(set(kept)):
            problems.append(Violation(f"anchors[{sequence}]", kept, "kept anchors must be distinct, increasing positions "
                                      "a with loss_mask on at a and a + 1" + (f" (not: {bad})" if bad else ""),
                                      "Draw them with sample_anchors or choose from anchor_candidates(loss_mask)."))  # fmt: skip
    _refuse(problems, "DSpark anchors refused")


# ----------------------------------------------------------------------------------------- loss


@dataclass
class DSparkLossOutput:
    """``loss`` (backward through it) and the unreduced sums behind it: ``ce_num``, ``l1_num``,
    ``confidence_num``, ``weight`` (the shared denominator before ``eps``); ``ce`` / ``l1`` /
    ``confidence``: the normalised terms (detached); ``accept_rate``: mean of ``clamp(1 - l1_k/2)``
    over counted slots; ``anchors``: the ``(anchors, keep)`` of each sequence."""

    loss: torch.Tensor
    terms: dict[str, torch.Tensor] = field(default_factory=dict)
    anchors: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class DSparkObjective:
    """The DSpark loss of a V4.1 config (``text``: the text config; its ``dspark_*`` keys) with ``config``."""

    def __init__(self, text: Any, config: DSparkLossConfig):
        if not ds41_facts.has_dspark(text):
            raise ValueError("this V4.1 config has no DSpark drafter (num_nextn_predict_layers > 0 with dspark_* keys): "
                             "DSpark training needs the checkpoint's config.json with its dspark_* keys.")  # fmt: skip
        get = lambda key: ds41_facts.text_value(text, key)  # noqa: E731
        self.config = config
        self.block = int(get("dspark_block_size"))
        self.noise_id = int(get("dspark_noise_token_id"))
        self.window = int(get("sliding_window"))
        self.vocab = int(get("vocab_size"))
        self.hidden = int(get("hidden_size"))
        self.layer_ids = list(get("dspark_target_layer_ids"))
        if not 0 <= self.noise_id < self.vocab:
            _refuse([Violation("dspark_noise_token_id", self.noise_id, f"the noise token is embedded: it must be an id "
                               f"in [0, vocab_size={self.vocab})", "Give the checkpoint's dspark_noise_token_id.")],
                    "DSpark config refused")  # fmt: skip

    def _check(self, drafter, embed_weight, output_weight) -> None:
        width = drafter.mtp.layers[0].main_proj.in_features
        problems = []
        if width != len(self.layer_ids) * self.hidden:
            problems.append(Violation("dspark_target_layer_ids", self.layer_ids, f"the drafter's main_proj reads {width} "
                                      f"features, {len(self.layer_ids)} layers x hidden {self.hidden} give "
                                      f"{len(self.layer_ids) * self.hidden}", "Build the drafter from the same config."))  # fmt: skip
        for key, weight in (("embedding.word_embeddings.weight", embed_weight), ("output_layer.weight", output_weight)):
            if tuple(weight.shape) != (self.vocab, self.hidden):
                problems.append(Violation(key, tuple(weight.shape), f"the target's {key} must be [vocab_size={self.vocab}, "
                                          f"hidden_size={self.hidden}]", "Pass the target backbone of this config."))  # fmt: skip
        _refuse(problems, "DSpark loss inputs refused")

    def __call__(
        self,
        drafter,
        target,
        sequences: Sequence[torch.Tensor],
        features: Sequence[torch.Tensor],
        last: Sequence[torch.Tensor],
        loss_masks: Sequence[torch.Tensor],
        generator: torch.Generator | None = None,
        anchors: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> DSparkLossOutput:
        """The loss over ``sequences`` (token ids ``[S_i]``) with their features ``[S_i, L * h]``, final-norm
        rows ``[S_i, h]`` and loss masks ``[S_i]``; anchors drawn with ``generator``, or the explicit
        ``anchors``. ``target``: the backbone (its embedding and output layer are read, frozen)."""
        embed_weight = _frozen(target.embedding.word_embeddings.weight)
        output_weight = _frozen(target.output_layer.weight)
        self._check(drafter, embed_weight, output_weight)
        if not len(sequences) == len(features) == len(last) == len(loss_masks):
            raise ValueError(f"DSpark loss: {len(sequences)} sequences, {len(features)} features, {len(last)} final-norm "
                             f"rows and {len(loss_masks)} loss masks: pass one of each per sequence.")  # fmt: skip
        if (anchors is None) == (generator is None):
            raise ValueError("DSpark loss: pass either generator= (anchors drawn by sample_anchors) or anchors= (explicit), not both or neither.")
        if anchors is not None and len(anchors) != len(sequences):
            raise ValueError(f"DSpark loss: {len(anchors)} anchor sets for {len(sequences)} sequences; pass one per sequence.")
        sums: dict[str, torch.Tensor] = {}
        chosen = []
        for i, (ids, feats, rows, mask) in enumerate(zip(sequences, features, last, loss_masks)):
            if feats.shape != (ids.shape[0], len(self.layer_ids) * self.hidden) or rows.shape != (ids.shape[0], self.hidden):
                raise ValueError(f"DSpark loss: sequence {i} has {ids.shape[0]} tokens but features {tuple(feats.shape)} and "
                                 f"final-norm rows {tuple(rows.shape)}; expected [{ids.shape[0]}, {len(self.layer_ids) * self.hidden}] "
                                 f"and [{ids.shape[0]}, {self.hidden}] (gather the CP slices first).")  # fmt: skip
            if anchors is None:
                pair = sample_anchors(mask, self.config.num_anchors, generator)
            else:
                pair = anchors[i]
                check_anchors(pair[0], pair[1], mask, self.config.num_anchors, i)
            chosen.append(pair)
            for key, value in self._sequence(drafter, embed_weight, output_weight, ids, _frozen(feats), _frozen(rows), mask, *pair).items():
                sums[key] = sums[key] + value if key in sums else value
        cfg, eps = self.config, self.config.denominator_eps
        den = sums["weight"] + eps
        ce = sums["ce_num"] / den
        l1 = sums["l1_num"] / den if cfg.l1_alpha > 0 and float(sums["weight"]) > 0 else ce.new_zeros(())
        conf = sums["confidence_num"] / den if cfg.confidence_alpha > 0 else ce.new_zeros(())
        loss = cfg.ce_alpha * ce + cfg.l1_alpha * l1 + cfg.confidence_alpha * conf
        terms = dict(sums, ce=ce.detach(), l1=l1.detach(), confidence=conf.detach(),
                     accept_rate=(sums["accept_num"] / sums["count"].clamp(min=1)).detach())  # fmt: skip
        return DSparkLossOutput(loss=loss, terms=terms, anchors=chosen)

    def _sequence(self, drafter, embed_weight, output_weight, ids, feats, rows, mask, anchors, keep) -> dict[str, torch.Tensor]:
        cfg, block, length = self.config, self.block, ids.shape[0]
        dtype = torch.promote_types(feats.dtype, torch.float32)
        slot = torch.arange(block, device=ids.device)
        labels = anchors.unsqueeze(-1) + 1 + slot  # [A, B]: block j predicts a_j + 1 .. a_j + B
        safe = torch.where(keep.unsqueeze(-1), labels.clamp(max=length - 1), torch.zeros_like(labels))
        targets = ids[safe]
        previous = torch.cat([ids[anchors].unsqueeze(-1), targets[:, :-1]], dim=-1)
        noise_ids = torch.full_like(labels, self.noise_id)
        noise_ids[:, 0] = torch.where(keep, ids[anchors], noise_ids[:, 0])
        noise = F.embedding(noise_ids.reshape(-1), embed_weight)
        positions = draft_positions(anchors, length, block)
        visible = draft_visibility(anchors, keep, length, block, self.window)
        normed, transition, confidence = drafter(noise, feats, positions, visible, previous.reshape(-1),
                                                 confidence=cfg.confidence_alpha > 0,
                                                 confidence_stop_gradient=cfg.confidence_stop_gradient)  # fmt: skip
        draft = F.linear(normed.to(dtype), output_weight.to(dtype)) + transition.to(dtype)  # [A * B, V]
        counted = (labels < length) & (mask.reshape(-1)[safe] > 0.5) & keep.unsqueeze(-1)
        counted = counted.to(torch.int32).cumprod(dim=-1).bool().reshape(-1)
        weight = counted.to(dtype)
        if cfg.decay_gamma is not None:
            weight = weight * torch.exp(-slot.to(dtype) / cfg.decay_gamma).repeat(anchors.shape[0])
        out = {"weight": weight.sum(), "count": counted.sum().to(dtype)}
        out["ce_num"] = (F.cross_entropy(draft, targets.reshape(-1), reduction="none") * weight).sum()
        teacher = F.linear(rows[(safe - 1).clamp(min=0).reshape(-1)].to(dtype), output_weight.to(dtype))
        distance = (draft.softmax(dim=-1) - teacher.softmax(dim=-1)).abs().sum(dim=-1)
        accept = (1.0 - 0.5 * distance).clamp(0.0, 1.0).detach()
        out["l1_num"] = (distance * weight).sum()
        out["accept_num"] = (accept * counted.to(dtype)).sum()
        if confidence is not None:
            bce = F.binary_cross_entropy_with_logits(confidence.to(dtype), accept, reduction="none")
            out["confidence_num"] = (bce * weight).sum()
        else:
            out["confidence_num"] = weight.new_zeros(())
        return out
