"""Runnable DS4 recipes (Hydra), shipped as ``verl_ds4.recipes_data``.

Add ``pkg://verl_ds4.recipes_data`` to ``hydra.searchpath`` of verl's ``sft_trainer_engine`` or
``ppo_trainer`` config and select one with ``+recipe=<name>``. This file only marks the folder
as a package so the YAML is installed with ``pip install .``; there is no Python here.
"""
