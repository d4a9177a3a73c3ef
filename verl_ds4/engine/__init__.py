"""verl engine layer: verl-ds4's Megatron engines and the verl plugin that registers them.

* :mod:`verl_ds4.engine.megatron`: ``DS4MegatronEngineWithLMHead`` / ``DS4MegatronEngineWithValueHead``
  (subclasses of verl's Megatron engines that take the CP layout and padding of every data path
  from one resolved object, :class:`verl_ds4.mcore.resolver.ResolvedCPLayout`).
* :mod:`verl_ds4.engine.plugin`: the ``verl.plugins`` entry point; ``register_engines()``.
* :mod:`verl_ds4.engine.doctor_cli`: ``verl-ds4 doctor``.

Importing this package is cheap (verl's plugin loader imports it in every process); the engine
classes are imported on first attribute access.
"""

_LAZY = {
    "DS4MegatronEngineWithLMHead": "verl_ds4.engine.megatron",
    "DS4MegatronEngineWithValueHead": "verl_ds4.engine.megatron",
    "register_engines": "verl_ds4.engine.plugin",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
