"""verl-ds4: DeepSeek-V4 post-training with verl on Megatron.

Layers (each imports only those below it):

1. ``verl_ds4.layout``  context-parallel layouts as data (pure PyTorch)
2. ``verl_ds4.mcore``   Megatron-Core glue (THD pre/post-processing, forward functions)
3. ``verl_ds4.engine``  verl engine subclasses and the plugin that registers them
4. ``verl_ds4.models``  DS4-specific pieces (provider settings, chat encoding, CPU proxy)
5. ``verl_ds4.cli``     the ``verl-ds4`` command
"""

__version__ = "0.1.0"
