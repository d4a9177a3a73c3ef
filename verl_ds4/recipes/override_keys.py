"""Refuse override keys that nothing reads, with the closest known name (typos fail in seconds).

Hydra refuses ``engine.context_paralel_size=2`` (the key is not in the config) but suggests
``+engine.context_paralel_size=2``, and with the ``+`` the key is added and then read by nobody: the
typo passes validation silently, or fails half a minute later when verl builds its config dataclass.
This module checks the keys a user *adds* (``+key=value`` / ``++key=value``) against the ones that are
known, and explains Hydra's refusal of an unknown key (:func:`explain_compose_error`).

What "known" means, walking the key from the config's root, one name at a time:

* a node with a ``_target_`` (verl's config dataclasses: ``engine``/``...megatron`` ->
  ``McoreEngineConfig`` or verl-ds4's subclass, ``actor`` -> ``McoreActorConfig``, ``rollout`` ->
  ``RolloutConfig``, ``critic``, ``optim``, ``model``, ``algorithm``, ``checkpoint``, ...): the fields of
  that dataclass (whether or not verl's YAML lists them); a field typed as a dict
  (``override_transformer_config``, ``override_optimizer_config``, ...) or ``Any`` takes any key below it;
* a plain node (``trainer``, ``data``, ``ds4``, ``ray_kwargs``, ...): the keys verl's composed YAML (with the
  recipe) has there before the user's additions; an empty or null node takes any key (a free-form mapping);
* under ``ds4``, also the knobs the validator reads with a default (:data:`DS4_DEFAULTED_KEYS`).

A key under a plain node that is meant (your own code reads it) is said explicitly:
``+ds4.allow_unknown_keys=[trainer.my_key]`` lets that key (and any key below it) through; the check then
notes it. Under a dataclass node it cannot help: verl builds the dataclass from the block
(``hydra.utils.instantiate``) and stops on any key that is not a field, so the refusal says to subclass
the dataclass and name the subclass in ``_target_`` (as ``verl_ds4.engine.config.DS4McoreEngineConfig`` does). Config-group selections (``+recipe=...``, ``ds4_mesh=...``) and ``hydra.*`` are not keys and are
not checked here (Hydra refuses an unknown group itself).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from typing import Any, Callable, Sequence

from omegaconf import DictConfig, OmegaConf

from verl_ds4.recipes.roles import Problem

__all__ = [
    "ALLOW_KEY",
    "DS4_DEFAULTED_KEYS",
    "AddedKey",
    "added_keys",
    "check_added_keys",
    "compose_named",
    "compose_without_added",
    "explain_compose_error",
    "precheck",
]

ALLOW_KEY = "ds4.allow_unknown_keys"
_DS4_BLOCK = "the recipe's ds4 block"
#: ``ds4.*`` knobs the recipe validator reads with a default, so a recipe need not list them
#: (tests/test_override_keys_on_cpu.py checks that every ``_get(cfg, "ds4.X", default)`` in verl_ds4/ is here).
DS4_DEFAULTED_KEYS = ("memory_check", "memory_headroom", "check_paths", "recipe", "allow_unknown_keys")


@dataclasses.dataclass(frozen=True)
class AddedKey:
    """One ``+key=value`` / ``++key=value`` override of a config value (not a group)."""

    text: str  # the override as written
    key: str  # the dotted key, without the + signs
    value: str  # the value as written


def _is_group(key: str, group_roots: Sequence[Any]) -> bool:
    if "/" in key:
        return True
    if "." in key:
        return False
    return any((root / key).is_dir() for root in group_roots)


def _group_roots() -> list[Any]:
    """The config folders Hydra searches for groups: verl's and verl-ds4's (recipes, meshes, models)."""
    from importlib.resources import files
    from pathlib import Path

    from verl_ds4.recipes.compose import verl_config_dir

    roots: list[Any] = [Path(verl_config_dir())]
    for pkg in ("verl_ds4.recipes_data", "verl_ds4.configs_data"):
        roots.append(files(pkg))
    return roots


def added_keys(overrides: Sequence[str], group_roots: Sequence[Any] | None = None) -> list[AddedKey]:
    """The overrides that add a config key (``+a.b=v``, ``++a.b=v``); groups and ``hydra.*`` left out."""
    roots = _group_roots() if group_roots is None else group_roots
    out = []
    for text in overrides:
        m = re.match(r"^(\+\+?)([^=~+][^=]*?)(@[^=]*)?=(.*)$", text, re.S)
        if not m:
            continue
        key = m.group(2).strip()
        if key.startswith("hydra.") or key == "hydra" or _is_group(key, roots):
            continue
        out.append(AddedKey(text, key, m.group(4)))
    return out


def _dict_like(tp: Any) -> bool:
    """Whether a dataclass field of type ``tp`` is a free-form mapping (any key below it is read as data)."""
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        return any(_dict_like(a) for a in typing.get_args(tp) if a is not type(None))
    return tp in (dict, typing.Dict) or origin in (dict, typing.Dict) or (isinstance(origin, type) and issubclass(origin, dict))


def _dataclass_of(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return tp
    if typing.get_origin(tp) is typing.Union:
        for a in typing.get_args(tp):
            if dataclasses.is_dataclass(a) and isinstance(a, type):
                return a
    return None


def _fields(cls: type) -> dict[str, Any]:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve: names only
        hints = {}
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}


def _class_of(node: Any) -> type | None:
    target = node.get("_target_") if isinstance(node, DictConfig) else None
    if not target:
        return None
    from hydra.utils import get_class

    try:
        cls = get_class(str(target))
    except Exception:
        return None
    return cls if dataclasses.is_dataclass(cls) else None


def _unknown_at(base: DictConfig, key: str) -> tuple[str, str, list[str], str] | None:
    """Where ``key`` leaves the known settings: (parent path, name, known names there, parent's kind); None if known."""
    if key == ALLOW_KEY or key.startswith(ALLOW_KEY + "."):
        return None  # the escape hatch itself, with or without a recipe's ds4 block
    if ".env_vars." in f".{key}":  # below an env_vars mapping (Ray's runtime_env): names of the user's choosing
        head = f".{key}".split(".env_vars.", 1)[0][1:]
        return _unknown_at(base, head) if head else None  # the path down to it must still be known
    node: Any = base
    cls: type | None = None
    parts = key.split(".")
    for i, name in enumerate(parts):
        parent = ".".join(parts[:i])
        if parent == "ds4" and name in DS4_DEFAULTED_KEYS:
            return None
        node_cls = _class_of(node) or cls
        if node_cls is not None:
            fields = _fields(node_cls)
            if name not in fields:
                if isinstance(node, DictConfig) and name in node:  # a YAML key the dataclass does not declare
                    cls, node = None, node.get(name)
                    continue
                in_yaml = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
                return parent, name, sorted(set(fields) | set(in_yaml)), node_cls.__name__
            tp = fields[name]
            if _dict_like(tp):
                return None
            cls = _dataclass_of(tp)
            node = node.get(name) if isinstance(node, DictConfig) else None
            if cls is None and not isinstance(node, DictConfig):
                return None  # a scalar field: Hydra itself refuses keys below it
            continue
        cls = None
        if node is None or (isinstance(node, DictConfig) and len(node) == 0):
            return None  # a null or empty mapping: free-form
        if not isinstance(node, DictConfig):
            return None  # below a scalar or a list: Hydra refuses it itself
        if name not in node:
            known = [str(k) for k in node.keys()] + (list(DS4_DEFAULTED_KEYS) if parent == "ds4" else [])
            return parent, name, sorted(set(known)), _DS4_BLOCK if parent == "ds4" else ""
        node = node.get(name)
    return None


def _closest(name: str, known: Sequence[str]) -> str | None:
    match = difflib.get_close_matches(name, [k for k in known if not k.startswith("_")], n=1, cutoff=0.6)
    return match[0] if match else None


def _allowed(key: str, allow: Sequence[str]) -> str | None:
    for entry in allow:
        entry = str(entry).lstrip("+")
        if key == entry or key.startswith(entry + "."):
            return entry
    return None


def check_added_keys(base: DictConfig, full: DictConfig, overrides: Sequence[str],
                     group_roots: Sequence[Any] | None = None) -> tuple[list[Problem], list[str]]:
    """Problems for every added key nothing reads, and notes for those let through by :data:`ALLOW_KEY`.

    Args:
        base: the config composed with the overrides *except* the added keys (what verl's YAML and the
            recipe define); :func:`compose_without_added` builds it.
        full: the config composed with every override (it carries ``ds4.allow_unknown_keys``).
        overrides: the Hydra overrides as on the trainer's command line.
    """
    allow = OmegaConf.select(full, ALLOW_KEY, default=None) or []
    if isinstance(allow, str):
        allow = [allow]
    problems, notes = [], []
    for added in added_keys(overrides, group_roots):
        where = _unknown_at(base, added.key)
        if where is None:
            continue
        parent, name, known, kind = where
        owner = f"{parent} ({kind})" if parent and kind else (parent or "the config's top level")
        near = _closest(name, known)
        full_near = f"{parent}.{near}" if parent and near else near
        fix = (f"did you mean {full_near}? Set {full_near}={added.value} (no '+': the key exists). " if near
               else f"check the spelling: {owner} has no setting close to {name!r}. ")
        entry = _allowed(added.key, list(allow))
        if kind and kind != _DS4_BLOCK:
            # verl builds this dataclass from the block (hydra.utils.instantiate) and stops on any other key.
            problems.append(Problem(
                added.text,
                f"adds {added.key}, which nothing reads: {owner} has no setting {name!r}, and verl would stop "
                f"when it builds {kind} from {parent}" + (f" ({ALLOW_KEY} cannot let it through)." if entry else "."),
                fix + f"A new setting there needs a subclass of {kind} with that field, named by {parent}._target_.",
            ))
            continue
        if entry is not None:
            notes.append(f"{added.key} is not a setting verl or verl-ds4 reads; added on purpose ({ALLOW_KEY} lists {entry}).")
            continue
        problems.append(Problem(
            added.text,
            f"adds {added.key}, which nothing reads: {owner} has no setting {name!r}.",
            fix + f"If your own code reads it, say so: +{ALLOW_KEY}=[{added.key}].",
        ))
    return problems, notes


def compose_without_added(compose: Callable[[list[str]], DictConfig], overrides: Sequence[str],
                          full: DictConfig, group_roots: Sequence[Any] | None = None) -> DictConfig:
    """The config without the user's added keys (``compose`` is called again; ``full`` when nothing was added)."""
    added = {a.text for a in added_keys(overrides, group_roots)}
    if not added:
        return full
    try:
        return compose([o for o in overrides if o not in added])
    except Exception:  # another override needs an added key: judge against the full config
        return full


_NOT_IN_STRUCT = re.compile(r"Could not override '([^']+)'")


def explain_compose_error(error: BaseException, compose: Callable[[list[str]], DictConfig],
                          overrides: Sequence[str]) -> str | None:
    """A line after Hydra's "Could not override 'a.b'" refusal: the closest known key, and what '+' would do.

    ``compose`` composes an override list (the same config); it is called once without the refused
    override to find the names known there. None when the error is not Hydra's unknown-key refusal.
    """
    m = _NOT_IN_STRUCT.search(str(error))
    if not m:
        return None
    key = m.group(1)
    if re.fullmatch(r"[A-Z][A-Z0-9_]*", key):
        return (f"{key} looks like a launcher's environment variable, not a config key: set it before the "
                f"command ({key}=... bash scripts/...), not after it.")
    rest = [o for o in overrides if o.split("=", 1)[0].lstrip("~") != key]
    value = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == key and "=" in o), "...")
    try:
        base = compose(rest)
    except Exception:
        return None
    where = _unknown_at(base, key)
    if where is None:
        return None
    parent, name, known, kind = where
    near = _closest(name, known)
    full_near = f"{parent}.{near}" if parent and near else near
    owner = f"{parent} ({kind})" if parent and kind else (parent or "the config's top level")
    guess = f"did you mean {full_near}={value}?" if near else f"{owner} has no setting like it."
    if kind and kind != _DS4_BLOCK:
        return (f"{key} is not a setting verl or verl-ds4 reads: {guess} (With '+' Hydra would add it, and verl "
                f"would stop when it builds {kind} from {parent}.)")
    return (f"{key} is not a setting verl or verl-ds4 reads: {guess} (With '+' Hydra would add it, and nothing "
            f"would read it; if your own code reads it: +{key}={value} +{ALLOW_KEY}=[{key}].)")


# ------------------------------------------------------------------ the launchers' pre-check (CLI)


def compose_named(config_name: str, overrides: Sequence[str]) -> DictConfig:
    """Compose verl's primary config ``config_name`` (``sft_trainer_engine``, ``ppo_trainer``) with ``overrides``,
    as the trainer's ``@hydra.main`` does (the overrides may add verl-ds4's search path and a recipe)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from verl_ds4.recipes.compose import verl_config_dir

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=verl_config_dir(), version_base=None):
            return compose(config_name=config_name, overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()


PREFIX = "[verl-ds4]"


def precheck(config_name: str, overrides: Sequence[str], before: str = "the trainer started") -> tuple[int, list[str]]:
    """Compose ``config_name`` with ``overrides`` and check the added keys: (exit status, console lines).

    Status 0: the overrides compose and add nothing unread (the lines are notes, if any); 2: Hydra's error
    first, then what we know about it, or every added key nothing reads.
    """
    import contextlib
    import io
    import logging
    import warnings

    def compose(ovs: list[str]) -> DictConfig:
        return compose_named(config_name, ovs)

    # Third-party warnings and prints (verl's imports when a dataclass is looked up) stay off the console.
    sink = io.StringIO()
    # Until the check is done only (it also runs inside other processes, e.g. pytest's): the level before.
    disabled_before = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            try:
                full = compose(list(overrides))
            except Exception as e:
                lines = [f"{PREFIX} FAILED: the overrides do not compose with verl's {config_name} config (Hydra's error; "  # error-catalogue: the head line of a Hydra error, which it quotes
                         f"checked before {before}):"]
                lines += ["    " + line for line in str(e).splitlines()]
                hint = explain_compose_error(e, compose, list(overrides))
                if hint:
                    lines.append(f"{PREFIX} {hint}")
                return 2, lines
            problems, notes = check_added_keys(compose_without_added(compose, list(overrides), full), full,
                                               list(overrides))
    finally:
        logging.disable(disabled_before)
    if problems:
        lines = [f"{PREFIX} FAILED: {len(problems)} override(s) add a key that nothing reads (checked before {before}):"]
        return 2, lines + [f"{PREFIX}   {p}" for p in problems]
    return 0, [f"{PREFIX} note: {n}" for n in notes]


def main(argv: list[str] | None = None) -> int:
    """``python -m verl_ds4.recipes.override_keys CONFIG_NAME [--before WHAT] -- OVERRIDES...`` (the CPU launchers)."""
    import argparse
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    overrides: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, overrides = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description="Compose verl's config with a launcher's overrides and refuse "
                                                 "added keys nothing reads, before the trainer starts.")
    parser.add_argument("config_name", help="verl's primary config: sft_trainer_engine or ppo_trainer")
    parser.add_argument("--before", default="the trainer started", help="what has not started yet (for the message)")
    args = parser.parse_args(argv)
    status, lines = precheck(args.config_name, overrides, args.before)
    for line in lines:
        print(line, file=sys.stderr if status else sys.stdout)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
