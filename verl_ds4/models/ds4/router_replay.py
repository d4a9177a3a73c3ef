"""verl's router replay (R2 / R3) on the DS4 MoE: every MoE layer, hash layers included.

verl 0.9.1 records and replays routes through ``verl.utils.megatron.router_replay_patch.RouterReplay``
(one instance per MoE layer, kept in ``RouterReplay.router_instances`` in layer order; each holds a
``[rows, topk]`` route tensor) and finds a model's routers with
``router_replay_utils.iter_model_routers``: modules that are ``TopKRouter`` instances with a
``router_replay`` and a ``layer_number``. Our :class:`~.moe.DS4Router` is not Megatron's
``TopKRouter`` (DS4 scores, bias-for-choice-only and hash routing differ), so this module

* registers it as a virtual subclass of ``TopKRouter`` (``TopKRouter`` is an ``abc.ABC``; nothing
  of ``TopKRouter``'s code runs on it: only verl's ``isinstance`` walk sees it), and
* :func:`enable_router_replay` gives each decoder layer's router a verl ``RouterReplay`` and its
  ``layer_number``, in layer order, so verl's ``RouterReplay`` class methods
  (``set_global_router_replay_action``, ``get_recorded_data``, ``set_replay_data``) and its
  model walk (``set_model_router_replay_action``, ``set_router_replay_data(model=...)``) reach them.

The router then chooses through ``RouterReplay.get_replay_topk`` (see :mod:`.moe`). Routes are per
packed row of this rank: record them, unpack them with the micro-batch's THD plan, and pack them
with the plan of the micro-batch that replays them (``THDPlan.pack`` / ``unpack``); the engine's
hooks on ``router_replay_utils`` (``verl_ds4.engine.megatron``) do that for verl's own R3 path.
"""

from __future__ import annotations

from megatron.core.transformer.moe.router import TopKRouter

from .moe import DS4Router

__all__ = ["enable_router_replay", "disable_router_replay", "model_routers", "routing_replay_requested"]

TopKRouter.register(DS4Router)


def routing_replay_requested(config) -> bool:
    """True when a TransformerConfig asks for router replay (Megatron's or verl's flag)."""
    return bool(getattr(config, "moe_enable_routing_replay", False) or getattr(config, "enable_routing_replay", False))


def model_routers(model) -> list[tuple[int, DS4Router]]:
    """``(layer_number, router)`` of every DS4 decoder layer of ``model`` (unwrapping ``.module``)."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder.layers: expected a DS4Model (verl_ds4.models.ds4.model).")
    out = []
    for layer in layers:
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if isinstance(router, DS4Router):
            out.append((int(layer.layer_number), router))
    if not out:
        raise ValueError("The model has no DS4Router: router replay needs the DS4 MoE layers.")
    return out


def enable_router_replay(model):
    """Attach a verl ``RouterReplay`` to every DS4 router of ``model`` (layer order); returns them.

    Idempotent: a router that already has one keeps it.
    """
    from verl.utils.megatron.router_replay_patch import RouterReplay

    replays = []
    for layer_number, router in model_routers(model):
        router.layer_number = layer_number
        if router.router_replay is None:
            router.router_replay = RouterReplay()
        replays.append(router.router_replay)
    return replays


def disable_router_replay(model) -> None:
    """Detach the routers' ``RouterReplay`` instances (and drop them from verl's registry)."""
    from verl.utils.megatron.router_replay_patch import RouterReplay

    for _, router in model_routers(model):
        if router.router_replay is not None:
            RouterReplay.router_instances[:] = [r for r in RouterReplay.router_instances if r is not router.router_replay]
            router.router_replay = None
