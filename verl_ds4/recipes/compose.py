"""Compose a DS4 recipe through verl's real config tree, exactly as verl's entry points do.

A recipe is a Hydra config group (``recipe/<name>.yaml`` in ``verl_ds4.recipes_data``) applied on
top of verl's own primary config (``sft_trainer_engine`` for SFT, ``ppo_trainer`` for PPO/GRPO)
through ``hydra.searchpath``. The launchers pass the same override list to ``torchrun -m
verl.trainer.sft_trainer`` / ``python -m verl.trainer.main_ppo`` and to :func:`compose_recipe`,
so the dry-run sees the configuration the trainer will see.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

SEARCHPATH_OVERRIDE = "hydra.searchpath=[pkg://verl_ds4.recipes_data,pkg://verl_ds4.configs_data]"


@dataclass(frozen=True)
class Trainer:
    """One verl entry point a recipe runs on.

    Attributes:
        kind: ``"sft"`` or ``"ppo"`` (PPO and GRPO share verl's ``main_ppo``).
        config_name: verl's primary config (in ``verl.trainer.config``).
        module: the ``python -m`` module that trains.
        default_recipe: recipe selected when the overrides name none.
    """

    kind: str
    config_name: str
    module: str
    default_recipe: str


TRAINERS: dict[str, Trainer] = {
    "sft": Trainer("sft", "sft_trainer_engine", "verl.trainer.sft_trainer", "deepseek_v4_sft"),
    "ppo": Trainer("ppo", "ppo_trainer", "verl.trainer.main_ppo", "deepseek_v4_ppo"),
    "grpo": Trainer("ppo", "ppo_trainer", "verl.trainer.main_ppo", "deepseek_v4_grpo"),
    # DeepSeek-V4.1 (ds4_model=v41_flash): the V4 recipes with V4.1's model file and mesh.
    "deepseek_v41_sft": Trainer("sft", "sft_trainer_engine", "verl.trainer.sft_trainer", "deepseek_v41_sft"),
    "deepseek_v41_grpo": Trainer("ppo", "ppo_trainer", "verl.trainer.main_ppo", "deepseek_v41_grpo"),
}


def verl_config_dir() -> str:
    """verl's ``trainer/config`` folder, found without importing verl (which pulls in torch).

    It is the folder verl's own ``@hydra.main(config_path="config")`` entry points read.
    """
    import importlib.util
    import os

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.origin:
        raise ImportError("verl is not installed; install verl==0.9.1 (pip install -e .).")
    path = os.path.join(os.path.dirname(spec.origin), "trainer", "config")
    if not os.path.isfile(os.path.join(path, "ppo_trainer.yaml")):
        raise FileNotFoundError(f"verl's config folder {path} has no ppo_trainer.yaml; is verl installed correctly?")
    return path


def recipe_overrides(name: str, overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Overrides that select recipe ``name``, followed by ``overrides``.

    The search path and ``+recipe=`` entries are only added when ``overrides`` does not already
    carry them (the launchers pass them explicitly so the trainer command line is complete).
    """
    overrides = list(overrides)
    head: list[str] = []
    if not any(o.startswith("hydra.searchpath=") for o in overrides):
        head.append(SEARCHPATH_OVERRIDE)
    if not any(o.startswith(("+recipe=", "recipe=", "++recipe=")) for o in overrides):
        head.append(f"+recipe={name}")
    return head + overrides


def compose_recipe(recipe: str, overrides: list[str] | tuple[str, ...] = (), resolve: bool = True) -> DictConfig:
    """Compose ``recipe`` (a key of :data:`TRAINERS`) with Hydra overrides; no GPU, no Ray.

    Args:
        recipe: ``"sft"``, ``"ppo"`` or ``"grpo"``.
        overrides: Hydra overrides as on the trainer's command line.
        resolve: resolve interpolations in place (as verl's trainers do first thing).

    Returns:
        The composed config (struct mode off, like verl's ``main`` receives it).
    """
    if recipe not in TRAINERS:
        raise ValueError(f"Unknown recipe kind {recipe!r}; expected one of {sorted(TRAINERS)}.")
    trainer = TRAINERS[recipe]
    all_overrides = recipe_overrides(trainer.default_recipe, overrides)
    cfg = _compose(trainer, all_overrides)
    derived = derivation(recipe, overrides, base=cfg).overrides
    if derived:  # ds4.max_seq_len is set: the CP and lengths it derives (recipes.seq_cp, recipes.seq_len), then the config again
        cfg = _compose(trainer, all_overrides + derived)
    OmegaConf.set_struct(cfg, False)
    if resolve:
        OmegaConf.resolve(cfg)
    return cfg


def _compose(trainer: Trainer, overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=verl_config_dir(), version_base=None):
            return compose(config_name=trainer.config_name, overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


_DERIVATIONS: dict[tuple[str, tuple[str, ...]], "Derivation"] = {}


def derivation(recipe: str, overrides: list[str] | tuple[str, ...] = (), base: DictConfig | None = None) -> "Derivation":
    """What ``ds4.max_seq_len`` derives for recipe ``recipe`` and the user's ``overrides``: the CP
    (:mod:`verl_ds4.recipes.seq_cp`, judged at peak by the start-up check), the lengths and budgets
    (:mod:`verl_ds4.recipes.seq_len`), and the refusals of a CP that cannot hold it. ``base``: the config composed
    from ``overrides`` alone (composed here when not given). Cached per (recipe, overrides) for one process."""
    from verl_ds4.recipes.seq_cp import Derivation, derive

    key = (recipe, tuple(overrides))
    if key not in _DERIVATIONS:
        if base is None:
            trainer = TRAINERS[recipe]
            base = _compose(trainer, recipe_overrides(trainer.default_recipe, overrides))
        if OmegaConf.select(base, "ds4.max_seq_len") is None:
            return Derivation()
        if len(_DERIVATIONS) > 64:
            _DERIVATIONS.clear()
        _DERIVATIONS[key] = derive(base, TRAINERS[recipe].kind, list(overrides))
    return _DERIVATIONS[key]


def derived_length_overrides(recipe: str, overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """What :func:`compose_recipe` appends to ``overrides`` for recipe ``recipe``'s ``ds4.max_seq_len`` (the
    launchers pass the same to the trainer: ``verl-ds4 recipe KIND --shell-env`` prints them): ``ds4.mesh.cp``
    when it is derived, then the lengths and budgets."""
    return list(derivation(recipe, overrides).overrides)
