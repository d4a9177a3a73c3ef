"""DeepSeek-V4 model pieces that run on CPU, inside Megatron-Core (``docs/ds4-model.md``).

The full DS4 (equal to transformers' ``DeepseekV4ForCausalLM`` at fp64, at any CP size):

* :mod:`.model`: ``DS4Model`` (a Megatron-Core ``GPTModel`` whose decoder is :mod:`.block`'s
  ``DS4TransformerBlock``) and ``build_ds4_model(hf_config, ...)``; :mod:`.model_config`:
  ``DS4TransformerConfig`` from an HF config, refusing values the CPU model does not implement.
* :mod:`.hyper_connection`: mHC (pre / post / res mixing with Sinkhorn, the HC head).
* :mod:`.moe`: routers (top-k over sqrt-softplus / sigmoid / softmax scores, hash routing by
  ``tid2eid``), clamped SwiGLU experts, shared experts, and ``stable_topk`` (the one tie rule).
* :mod:`.hf_names`, :mod:`.hf_checkpoint`: HF folder load / save (``save_pretrained`` names and
  DeepSeek's native names), with errors naming any missing, unexpected or mis-shaped tensor;
  :mod:`.checkpoint_format` (what a folder holds: bf16, the hub's FP8 / FP4, MTP or a DSpark
  drafter) and :mod:`.hf_dequant` (the hub's FP8 / FP4 dequantised on load).

DS4's attention and its CP contract:

* :mod:`.attention`: ``DS4HybridAttention`` (sliding window, CSA with indexer top-k, HCA, sink,
  partial interleaved RoPE, grouped output projection) on packed THD rows; :mod:`.cp_comm`: the
  left-halo exchange and the all-gather of compressed KV / indexer keys, with their backward.
* :mod:`.rope`: DS4's RoPE / YaRN conventions.
* :mod:`.mcore_attention`: the Megatron-Core layer-spec module and ``DS4ProxyTransformerConfig``;
  :mod:`.proxy` + ``configs/tiny_proxy.json``: the attention-only proxy (DS4 attention in a dense GPT).
* :mod:`.hf_mapping`, :mod:`.hf_reference`: mapping to / from transformers' modules and helpers to
  run them as an fp64 reference.

Around the model: :mod:`.chat` and :mod:`.sft_dataset` (DS4 chat encoding, ``DS4ChatSFTDataset``)
and :mod:`.provider` (the architecture numbers recipes validate against).

The public check, :func:`hf_logits` (:mod:`.hf_check`): per-sequence logits of our Megatron DS4
loaded from an HF folder, packed THD with the contiguous layout, at any CP size on gloo ranks.
``verl-ds4 verify`` (the CP parity table and ``--hf-checkpoint``) lives one floor up, in
:mod:`verl_ds4.cpu`.
"""

from .hf_check import hf_logits

__all__ = ["hf_logits"]
