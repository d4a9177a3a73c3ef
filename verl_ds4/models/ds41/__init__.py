"""DeepSeek-V4.1 model pieces (beside V4's in ``models/ds4``; see ``docs/ds41-model.md``).

* :mod:`.engram`: the tokenizer-normalisation table, the n-gram hasher (with the CP halo), the Engram layer;
* :mod:`.hyper_connection`: single-pass mHC (V4's coefficient module, V4.1's hand-over schedule).
"""
