"""DeepSeek-V4 pieces that run on CPU: a pure-PyTorch DS4 hybrid attention and the tiny DS4 proxy.

* :mod:`.attention`: :class:`DS4HybridAttention` (sliding window, CSA with indexer top-k, HCA,
  sink, partial interleaved RoPE, grouped output projection) on packed THD rows, with DS4's
  contiguous context-parallel contract (:mod:`.cp_comm`: left-halo exchange and all-gather of
  compressed KV / indexer keys, both with their backward). Declares
  ``required_cp_partition_mode = "contiguous"`` and ``min_local_rows`` for the engine's layout resolver.
* :mod:`.rope`: DS4's RoPE / YaRN conventions.
* :mod:`.mcore_attention`: the Megatron-Core layer-spec module and ``DS4ProxyTransformerConfig``.
* :mod:`.proxy` + ``configs/tiny_proxy.json``: a real Megatron-Core ``GPTModel`` with DS4 attention
  (LM head or value head), fp32 / fp64.
* :mod:`.hf_mapping`, :mod:`.hf_reference`: weight mapping to / from transformers'
  ``DeepseekV4Attention`` and helpers to run it as an fp64 reference.
* :mod:`.parity` + :mod:`.verify_cli`: the CP parity harness behind ``verl-ds4 verify --cp N``.

Submodules import Megatron-Core lazily (only :mod:`.mcore_attention`, :mod:`.proxy` and the parity
harness need it); :mod:`.attention` needs torch only.
"""
