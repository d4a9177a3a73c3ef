"""DS4 multi-token prediction (MTP), as Megatron-LM ``dev`` defines it with mHC, on packed CP rows.

``num_nextn_predict_layers = D`` depths. Depth ``k = 1..D`` (Megatron-LM dev's
``MultiTokenPredictionLayer`` with ``enable_hyper_connections``; DeepSeek's native ``mtp.{k-1}.*``)::

    ids_k   = roll(ids_{k-1})                     # token i + k at row i, per sequence (ids_0 = ids)
    x       = e_proj(enorm(embed(ids_k)))[:, None] + h_proj(hnorm(h_{k-1}))   # [T, n, h], per stream
    h_k     = DS4Layer_k(x)                        # one window-only (ratio 0) DS4 layer: mHC attn + mHC MoE
    logits  = output_layer(final_layernorm(hc_head_k(h_k)))   # shared output head (and embedding)

``h_0`` are the decoder's ``n`` residual streams *before* its HC head (dev's ``mhc_multistream``).
Labels ``y_0[i] = ids[i + 1]`` (from ``labels`` when the caller gives them, else rolled from the ids,
with the loss mask rolled in lockstep, as dev does) are rolled once more per depth, and so is the
mask; ``roll`` moves every row one step left **inside its sequence** and writes 0 at each sequence's
last row (and the mask 0 there), so nothing crosses a packed sequence boundary. Under the contiguous
CP split a rank's last row takes the next rank's first row (:func:`.cp_comm.next_rank_first_row`),
so CP = N rolls exactly as CP = 1.

Loss (dev: ``mtp_loss_scaling_factor / D`` times the per-depth token mean)::

    L_k   = sum_i m_k[i] * CE(logits_k[i], y_k[i]) / sum_i m_k[i]        (sums over the whole CP group)
    L_mtp = mtp_loss_scaling_factor / D * sum_k L_k

Each rank's share uses its own CE sum over the *global* token count (one all-reduce of a count), so
the shares sum to the CP = 1 loss and the CP-summed gradients equal CP = 1 (dev divides by the local
count instead, which is CP-exact only when every rank holds as many loss tokens).

How a trainer gets it: the share is attached to the LM hidden rows with Megatron-Core's own
``MTPLossAutoScaler`` (its gradient joins the LM loss's backward, times
``MTPLossAutoScaler.main_loss_backward_scale``, which Megatron's pipeline schedule sets), nothing is
added to the logits; :func:`mtp_loss_report` returns the last forward's detached values (global over
CP). MTP runs only where autograd is on (``torch.is_grad_enabled()``): scoring under ``no_grad``
skips it and returns the LM logits alone.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from megatron.core.transformer.module import MegatronModule

from .attention import _RMSNorm
from .block import DS4DecoderLayer
from .cp_comm import next_rank_first_row
from .device import building_on
from .hyper_connection import DS4HyperHead

__all__ = ["DS4MTPLayer", "DS4MTPBlock", "roll_packed_left", "mtp_loss_report"]

#: Test-only switch (a negative control): False lets a roll carry a row across a sequence boundary.
_RESPECT_SEQUENCE_BOUNDARIES = True


def roll_packed_left(x: torch.Tensor, cu_seqlens: torch.Tensor, cp_group=None) -> torch.Tensor:
    """One-row left roll of this rank's packed rows ``x [T, ...]`` inside each sequence.

    ``cu_seqlens``: the global padded offsets (identical on every rank); rank ``r`` holds global rows
    ``[r*T, (r+1)*T)``. Row ``i`` gets row ``i + 1`` when that row is in the same sequence, else 0.
    Not differentiable (ids, labels, masks).
    """
    rows = x.shape[0]
    rank = dist.get_rank(cp_group) if cp_group is not None else 0
    size = dist.get_world_size(cp_group) if cp_group is not None else 1
    cu = cu_seqlens.to(device=x.device, dtype=torch.long)
    if int(cu[-1]) != rows * size:
        raise ValueError(
            f"MTP roll: cu_seqlens[-1] ({int(cu[-1])}) must equal local rows * cp_size ({rows} * {size}); pass the "
            "global padded cu_seqlens of the contiguous split (identical on every rank)."
        )
    nxt = next_rank_first_row(x, cp_group) if size > 1 else x.new_zeros(x.shape[1:])
    out = torch.cat((x[1:].detach(), nxt.unsqueeze(0)), dim=0)
    if _RESPECT_SEQUENCE_BOUNDARIES:
        g = rank * rows + torch.arange(rows, device=x.device)
        seq_end = cu[1:][torch.bucketize(g, cu[1:], right=True).clamp(max=cu.numel() - 2)]
        last = (g + 1 >= seq_end).view(-1, *([1] * (x.dim() - 1)))
        out = torch.where(last, torch.zeros_like(out), out)
    return out


class DS4MTPLayer(MegatronModule):
    """One MTP depth: ``enorm``, ``hnorm``, ``e_proj``, ``h_proj``, ``mtp_model_layer`` (a ratio-0 DS4
    layer with mHC), its own ``hc_head`` and ``final_layernorm`` (dev's names; native ``mtp.N.*``)."""

    @property
    def transformer_layer(self):
        """The inner DS4 layer under the name Megatron's schedule uses (``set_current_microbatch``)."""
        return self.mtp_model_layer

    def __init__(self, config, depth: int, pg_collection=None):
        super().__init__(config=config)
        self.depth = depth
        dtype, h, eps = config.params_dtype, config.hidden_size, config.layernorm_epsilon
        self.enorm = _RMSNorm(h, eps, dtype=dtype)
        self.hnorm = _RMSNorm(h, eps, dtype=dtype)
        self.e_proj = torch.nn.Linear(h, h, bias=False, dtype=dtype)
        self.h_proj = torch.nn.Linear(h, h, bias=False, dtype=dtype)
        # The inner layer: a one-layer view of the config, window-only attention, a top-k MoE layer.
        layer_config = dataclasses.replace(
            config, num_layers=1, csa_compress_ratios=[0], ds4_mlp_layer_types=["moe"], mtp_num_layers=None
        )
        self.mtp_model_layer = DS4DecoderLayer(layer_config, 1, pg_collection=pg_collection)
        self.hc_head = DS4HyperHead(h, config.num_residual_streams, config.mhc_epsilon, eps, dtype=dtype)
        self.final_layernorm = _RMSNorm(h, eps, dtype=dtype)

    def forward(self, streams: torch.Tensor, next_embedding: torch.Tensor, packed_seq_params=None) -> torch.Tensor:
        """streams ``[s, b, n, h]`` (previous depth / decoder), next_embedding ``[s, b, h]`` -> streams."""
        x = self.e_proj(self.enorm(next_embedding)).unsqueeze(-2) + self.h_proj(self.hnorm(streams))
        return self.mtp_model_layer(x, packed_seq_params=packed_seq_params)

    def contract(self, streams: torch.Tensor) -> torch.Tensor:
        """``final_layernorm(hc_head(streams))``: the rows for the shared output head."""
        return self.final_layernorm(self.hc_head(streams))


def _token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits ``[s, b, v]``, labels ``[s, b]`` -> per-token cross entropy ``[s, b]``."""
    return -torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


class DS4MTPBlock(MegatronModule):
    """``model.mtp``: ``layers`` of :class:`DS4MTPLayer` (dev's ``MultiTokenPredictionBlock`` layout)."""

    def __init__(self, config, pg_collection=None):
        super().__init__(config=config)
        depth = int(config.mtp_num_layers or 0)
        if depth < 1:
            raise ValueError(f"DS4MTPBlock needs mtp_num_layers >= 1, got {config.mtp_num_layers!r}.")
        with building_on(config):  # the config's device (device.py)
            self.layers = torch.nn.ModuleList(DS4MTPLayer(config, k + 1, pg_collection=pg_collection) for k in range(depth))
        self.last_losses: torch.Tensor | None = None  # [D] per-depth token-mean CE, global over CP, detached
        self.last_scaled_loss: torch.Tensor | None = None  # mtp_loss_scaling_factor / D * sum

    def _cp_group(self, packed_seq_params):
        return self.layers[0].mtp_model_layer.self_attention._cp_group(packed_seq_params)

    def attach_loss(self, hidden, streams, input_ids, labels, loss_mask, packed_seq_params, embedding, output_layer, output_weight):
        """Compute the MTP loss and attach this rank's share to ``hidden [s, b, h]`` (``MTPLossAutoScaler``)."""
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        if input_ids is None:
            raise ValueError("MTP needs the input_ids of this rank's rows (got decoder_input without input_ids).")
        s, b = hidden.shape[:2]
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            group = self._cp_group(packed_seq_params)
        else:  # BSHD at CP = 1: every batch column is one sequence
            cu, group = torch.arange(b + 1, device=hidden.device) * s, self._cp_group(None)
            if group is not None:
                raise ValueError("DS4 MTP with context parallelism needs packed THD input (qkv_format='thd').")

        def to_rows(t):  # [b, s] -> [s*b] in the hidden rows' order ([s, b] flattened)
            return t.transpose(0, 1).reshape(-1)

        def to_sb(t):
            return t.view(s, b)

        ids = to_rows(input_ids)
        if labels is None:  # dev: labels = ids rolled left, the mask rolled in lockstep
            y = roll_packed_left(ids, cu, group)
            m = torch.ones_like(ids, dtype=hidden.dtype) if loss_mask is None else to_rows(loss_mask).to(hidden.dtype)
            m = roll_packed_left(m, cu, group)
        else:
            y = to_rows(labels)
            m = torch.ones_like(y, dtype=hidden.dtype) if loss_mask is None else to_rows(loss_mask).to(hidden.dtype)
        scale = float(self.config.mtp_loss_scaling_factor) / len(self.layers)
        share = hidden.new_zeros(())
        reports = []
        for layer in self.layers:
            ids = roll_packed_left(ids, cu, group)
            y, m = roll_packed_left(y, cu, group), roll_packed_left(m, cu, group)
            streams = layer(streams, embedding(input_ids=to_sb(ids).transpose(0, 1), position_ids=None), packed_seq_params)
            logits, _ = output_layer(layer.contract(streams), weight=output_weight)
            ce_sum = (_token_ce(logits, to_sb(y)) * to_sb(m)).sum()
            count = m.sum().detach()
            if group is not None:
                dist.all_reduce(count, group=group)
            local = ce_sum / count.clamp(min=1)
            share = share + scale * local
            reports.append(local.detach().clone())
        report = torch.stack(reports)
        if group is not None:
            dist.all_reduce(report, group=group)
        self.last_losses, self.last_scaled_loss = report, scale * report.sum()
        return MTPLossAutoScaler.apply(hidden, share)


def mtp_loss_report(model) -> dict[str, float]:
    """The last forward's MTP losses (global over CP): ``{"mtp_1 loss": .., "mtp loss (scaled)": ..}``.

    Empty when the model has no MTP or no forward with autograd has run yet.
    """
    mtp = getattr(model, "mtp", None)
    if mtp is None or mtp.last_losses is None:
        return {}
    out = {f"mtp_{k + 1} loss": float(v) for k, v in enumerate(mtp.last_losses)}
    out["mtp loss (scaled)"] = float(mtp.last_scaled_loss)
    return out
