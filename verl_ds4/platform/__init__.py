"""verl platforms contributed by verl-ds4.

Only :mod:`verl_ds4.platform.cpu` exists: a CPU platform for running verl's own trainers
(SFT, PPO) on machines without an accelerator, selected with ``VERL_PLATFORM=cpu``.
"""
