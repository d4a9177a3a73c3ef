"""The full DeepSeek-V4 as a Megatron-Core ``GPTModel``: embedding, DS4 decoder, LM (or value) head.

    from verl_ds4.models.ds4.model import build_ds4_model
    model = build_ds4_model(hf_config, dtype=torch.float64)       # hf_config: object, dict or path
    logits = model(ids, None, None, packed_seq_params=params)     # ids [1, rows], logits [1, rows, vocab]

:class:`DS4Model` is a ``GPTModel`` whose ``decoder`` is :class:`~.block.DS4TransformerBlock`
(mHC streams, DS4 attention, DS4 MoE, HC head, final norm), so Megatron's embedding, output layer,
loss path, ``sharded_state_dict`` (dist-checkpointing) and verl's engine code keep working. Hash
routing needs the token id of every row: :meth:`DS4Model.forward` passes its ``input_ids`` (this
rank's packed rows) to the decoder as ``hash_token_ids``; pass ``hash_token_ids`` explicitly only
where the ids are not the embedded rows (``decoder_input`` given).

With ``mtp_num_layers`` (HF ``num_nextn_predict_layers``) the model owns ``model.mtp``
(:class:`~.mtp.DS4MTPBlock`): a forward with autograd on computes the MTP loss from the decoder's
residual streams and attaches it to the LM rows' gradient (Megatron-Core's ``MTPLossAutoScaler``);
the logits are the LM logits, unchanged; :func:`~.mtp.mtp_loss_report` reads the loss.

Megatron's parallel state must be initialised first (tensor and pipeline parallel size 1, any CP
size); CP > 1 needs THD ``PackedSeqParams`` with the contiguous split (see
docs/ds4-context-parallel.md section 1).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from .block import DS4TransformerBlock
from .device import building_on, device_fields, device_overrides, megatron_layers_on, resolve_device
from .model_config import DS4TransformerConfig, ds4_transformer_config, hf_config_object
from .proxy import ValueHead

__all__ = ["DS4Model", "build_ds4_model", "init_ds4_weights"]


class DS4Model(GPTModel):
    """A ``GPTModel`` with the DS4 decoder; ``vocab_size`` / ``max_sequence_length`` as GPTModel's."""

    def __init__(
        self,
        config: DS4TransformerConfig,
        vocab_size: int,
        max_sequence_length: int = 1 << 20,
        pre_process: bool = True,
        post_process: bool = True,
        share_embeddings_and_output_weights: bool = False,
        pg_collection=None,
    ):
        if not isinstance(config, DS4TransformerConfig):
            raise TypeError(f"DS4Model needs a DS4TransformerConfig, got {type(config).__name__}.")
        # GPTModel builds a TransformerBlock from the spec; give it no layers, then put the DS4 block there.
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        with megatron_layers_on(config):  # every tensor on the config's device (device.py)
            super().__init__(
                config=config,
                transformer_layer_spec=TransformerBlockSubmodules(layer_specs=[], layer_norm=WrappedTorchNorm),
                vocab_size=vocab_size,
                max_sequence_length=max_sequence_length,
                pre_process=pre_process,
                post_process=post_process,
                parallel_output=True,
                share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                position_embedding_type="none",
                pg_collection=pg_collection,
            )
        with building_on(config):
            self.decoder = DS4TransformerBlock(config, pre_process=pre_process, post_process=post_process, pg_collection=pg_collection)
            # ``model.mtp`` exists only with MTP: Megatron's schedule walks ``model.mtp.layers`` whenever
            # the attribute exists (set_current_microbatch), as GPTModel builds it only with MTP too.
            if config.mtp_num_layers:
                from .mtp import DS4MTPBlock

                self.mtp = DS4MTPBlock(config, pg_collection=pg_collection)
        for param in self.parameters():  # Megatron's torch fallbacks ignore params_dtype
            param.data = param.data.to(config.params_dtype)

    @property
    def mtp_block(self):
        """The MTP block (``model.mtp``), or ``None`` for a model without MTP."""
        return getattr(self, "mtp", None)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        decoder_input: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inference_context=None,
        packed_seq_params=None,
        extra_block_kwargs: dict | None = None,
        runtime_gather_output: bool | None = None,
        *,
        hash_token_ids: torch.Tensor | None = None,
        **kwargs,
    ):
        """GPTModel's forward; ``input_ids [b, s]`` also route the hash layers unless ``hash_token_ids [b, s]``
        is given. Returns logits ``[b, s, vocab]`` (or the loss when ``labels`` are given)."""
        ids = hash_token_ids if hash_token_ids is not None else input_ids
        block_kwargs = dict(extra_block_kwargs or {})
        if ids is not None:
            block_kwargs["hash_token_ids"] = ids.transpose(0, 1)  # [s, b] like the hidden rows
        if self.mtp_block is not None:
            return self._forward_with_mtp(
                input_ids, decoder_input, labels, inference_context, packed_seq_params, block_kwargs,
                runtime_gather_output, kwargs.pop("loss_mask", None), kwargs,
            )
        return super().forward(
            input_ids,
            position_ids,
            attention_mask,
            decoder_input=decoder_input,
            labels=labels,
            inference_context=inference_context,
            packed_seq_params=packed_seq_params,
            extra_block_kwargs=block_kwargs,
            runtime_gather_output=runtime_gather_output,
            **kwargs,
        )

    def _forward_with_mtp(self, input_ids, decoder_input, labels, inference_context, packed_seq_params, block_kwargs,
                          runtime_gather_output, loss_mask, unused):
        """GPTModel's embedding -> decoder -> output layer (-> LM loss), with the MTP loss attached to the
        LM rows when autograd is on (MTP's input is the decoder's streams, so GPTModel's own path cannot
        carry it)."""
        if inference_context is not None:
            raise NotImplementedError("The CPU DS4 model scores and trains only (no KV cache / inference context).")
        # verl's engine passes the router padding mask of MoE models; GPTModel hands it to Megatron's
        # router for its auxiliary losses. This model's MoE has none (DS4 balances with the selection
        # bias), so the mask changes nothing here, with or without MTP: accepted and not used.
        unused.pop("padding_mask", None)
        bad = sorted(k for k, v in unused.items() if v is not None)
        if bad:
            raise TypeError(f"DS4Model.forward with MTP does not take {bad}; drop them (or build without MTP).")
        if decoder_input is None:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=None)
        hidden, streams = self.decoder(decoder_input, packed_seq_params=packed_seq_params, return_streams=True, **block_kwargs)
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if torch.is_grad_enabled():
            hidden = self.mtp.attach_loss(
                hidden, streams, input_ids, labels, loss_mask, packed_seq_params,
                embedding=self.embedding, output_layer=self.output_layer, output_weight=output_weight,
            )
        logits, _ = self.output_layer(hidden, weight=output_weight, runtime_gather_output=runtime_gather_output)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)


def init_ds4_weights(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Deterministic weights in parameter-name order (norm scales ``1``, mHC ``alpha`` ``1``, biases,
    sinks and ``ape`` ``0``, matrices ``N(0, std)``) and zero routing buffers, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name or leaf.startswith("alpha_") or leaf == "scale":
                param.fill_(1.0)
            elif param.dim() >= 2 and leaf != "ape":
                param.copy_((std * torch.randn(param.shape, generator=gen, dtype=torch.float64)).to(param.dtype))
            else:
                param.zero_()
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias") or name.endswith("tid2eid"):
                buf.zero_()


def build_ds4_model(
    hf_config: Any,
    dtype: torch.dtype = torch.float32,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    value_head: bool = False,
    seed: int = 1234,
    cp_size: int | None = None,
    allow_mtp_skip: bool = False,
    config_overrides: dict | None = None,
    device=None,
) -> DS4Model:
    """A :class:`DS4Model` for an HF DeepSeek-V4 config (object, ``config.json`` dict or folder).

    Weights are :func:`init_ds4_weights` (seeded; load real ones with
    :func:`verl_ds4.models.ds4.hf_checkpoint.load_hf_checkpoint`). ``value_head=True`` swaps the LM
    output layer for a hidden -> 1 :class:`~.proxy.ValueHead` (verl's critic). A config with
    ``num_nextn_predict_layers > 0`` builds the MTP block (``model.mtp``) unless ``allow_mtp_skip=True``
    (which drops it, as transformers does). ``device`` (``None``: the CPU; ``"cuda[:N]"``, ``"meta"``): where
    every parameter and buffer is created (:mod:`.device`; ``meta``: shapes only, no weights written).
    """
    hf = hf_config_object(hf_config)
    dev = resolve_device(device)
    # device=None: the CPU unless config_overrides say otherwise; an explicit device refuses a contradicting override
    overrides = {**device_overrides(dev), **(config_overrides or {})} if device is None else device_fields(dev, config_overrides)
    config = ds4_transformer_config(hf, dtype=dtype, cp_size=cp_size, allow_mtp_skip=allow_mtp_skip, **overrides)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        model = _build(config, hf, pre_process, post_process, value_head)
    if dev.type != "meta":
        init_ds4_weights(model, seed=seed, std=float(hf.initializer_range))
    return model


def _build(config, hf, pre_process: bool, post_process: bool, value_head: bool) -> DS4Model:
    model = DS4Model(
        config,
        vocab_size=hf.vocab_size,
        max_sequence_length=hf.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=bool(hf.tie_word_embeddings),
    )
    if value_head:
        if model.mtp_block is not None:
            raise ValueError(
                "value_head=True with num_nextn_predict_layers > 0: a critic has no next-token head for MTP; "
                "pass allow_mtp_skip=True to build the critic without the MTP block."
            )
        with building_on(config):
            model.output_layer = ValueHead(config.hidden_size, config.params_dtype)
    return model
