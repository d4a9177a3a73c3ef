"""verl-ds4: DeepSeek-V4 post-training with verl on Megatron.

Floors: each package imports only packages on lower floors (``tests/test_package_boundaries_on_cpu.py``
checks it, imports inside functions included; ``docs/architecture.md`` says what each owns).

0. ``verl_ds4.ds4_facts``  DS4 facts and start-up rules (standard library only); ``verl_ds4.ckpt_manifest`` checkpoint manifests (standard library only)
1. ``verl_ds4.layout``, ``verl_ds4.kernels``, ``verl_ds4.ds41_facts``, ``verl_ds4.substitutes``  context-parallel
   layouts as data (PyTorch + NumPy); the memory-linear DS4 sparse attention and indexer (PyTorch only); DeepSeek-V4.1
   config facts and start-up rules (standard library + ``ds4_facts``); the CPU substitutes of the production path
   (Megatron-LM dev's DS4 on a CPU) and its dev tree
2. ``verl_ds4.mcore``      Megatron-Core glue: THD pre/post-processing, forwards, the layout resolver
3. ``verl_ds4.engine``     verl engine subclasses and the plugin that registers them
4. ``verl_ds4.models``     DS4 model pieces (CPU attention, proxy, chat encoding, provider facts)
5. ``verl_ds4.cpu``, ``verl_ds4.memory``  the CPU jobs; the memory model (each GPU's peak per role, pass and
   stage, and the meshes that fit: a function of typed inputs, no config reading)
6. ``verl_ds4.recipes``, ``verl_ds4.verify``  recipe compose / validate / plan (reads the memory model's inputs);
   ``verl-ds4 verify`` (CP parity on CPU or GPU, HF / NeMo comparisons, the production model's builder)
7. ``verl_ds4.rollout``, ``verl_ds4.cli``  the CPU rollout for verl's RL trainers, the rollout/actor mismatch gate (the
   production rollout builds verify's production model); the ``verl-ds4`` command
8. ``verl_ds4.testing``    helpers for tests and benchmarks only (the product never imports it)
"""

__version__ = "0.1.0"
