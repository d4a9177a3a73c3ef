"""DS4 recipes: compose on verl's config tree, validate at start-up, print the parallel plan.

- :mod:`verl_ds4.recipes.compose`  compose a recipe exactly as verl's entry points would
- :mod:`verl_ds4.recipes.validate` start-up validation (errors name the setting and the fix)
- :mod:`verl_ds4.recipes.plan`     the resolved parallel plan ``--dry-run`` prints
- :mod:`verl_ds4.recipes.command`  ``verl-ds4 recipe {sft,ppo,grpo}`` used by the launchers
- :mod:`verl_ds4.recipes.gsm8k`    GSM8K -> SFT ``messages`` / RL parquet
- :mod:`verl_ds4.recipes.resume_check` the RL run record and the start-up refusal to resume another run's checkpoint

The YAML itself lives in the top-level ``recipes/`` and ``configs/`` folders, installed as
``verl_ds4.recipes_data`` and ``verl_ds4.configs_data``.
"""
