"""DeepSeek-V4.1 model pieces (beside V4's in ``models/ds4``; see ``docs/ds41-model.md``).

* :mod:`.engram`: the tokenizer-normalisation table, the n-gram hasher (with the CP halo), the Engram layer;
* :mod:`.hyper_connection`: single-pass mHC (V4's coefficient module, V4.1's hand-over schedule);
* :mod:`.csa2`: CSA2 attention (Full / Reindex / Reuse, two-level indexer) on packed THD rows under contiguous CP;
* :mod:`.cache_qdq`: the released cache rounding (FP8 / MXFP4 / NVFP4), a switch;
* :mod:`.model`: the backbone in pure PyTorch; :mod:`.mcore_model`: the same as a Megatron-Core ``GPTModel``;
* :mod:`.dspark`: the DSpark drafter (``mtp.*``);
* :mod:`.folder`: a V4.1 folder in our names (save / load, every rule checked first);
* :mod:`.names`: our parameter names against NeMo Automodel's; :mod:`.reference` / :mod:`.reference_weights`:
  the NeMo Automodel reference driven in fp64 (tests and ``verl-ds4 verify --model ds41``).
"""
