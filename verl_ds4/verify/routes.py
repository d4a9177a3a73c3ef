"""Expert choices of the DS4 routers in ``verl-ds4 verify``: record them, replay them, count differences.

A low-precision run may pick other experts than the fp64 reference where two scores nearly tie (a
different function, not an error of the data path). ``verify --device cuda`` therefore records every
router's choice in the fp64 CPU reference and, for ``bf16``, replays those routes on the device (the
direction of verl's R3: routes fixed by the run that produced them); it reports how many choices the
device would have made differently natively. fp32 runs natively and reports the same count.

:class:`RouteTape` is what :class:`~verl_ds4.models.ds4.moe.DS4Router` reads of verl's ``RouterReplay``
(``get_replay_topk``), without verl (the GPU machine has none): it always computes the native choice and
returns the target routes when it has them. Routes travel in original token order (``[T, k]`` per
router, padding rows dropped): :func:`attach` packs them with this micro-batch's THD plan,
:func:`collect` unpacks what the routers chose.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["RouteTape", "routers", "attach", "attach_for_run", "collect", "detach", "count_differences"]


class RouteTape:
    """One router's choice in one forward: ``native`` (what it would pick), ``used`` (what it used)."""

    def __init__(self, target: torch.Tensor | None = None):
        self.target = target  # [rows, k] packed routes to replay, or None (native)
        self.native: torch.Tensor | None = None
        self.used: torch.Tensor | None = None

    def get_replay_topk(self, scores, topk, default_compute_topk, **unused):
        _, native = default_compute_topk(scores, topk)
        self.native = native.detach()
        idx = native if self.target is None else self.target.to(device=scores.device, dtype=torch.long)
        self.used = idx.detach()
        return scores.gather(-1, idx), idx


def routers(model) -> dict[str, torch.nn.Module]:
    """Every DS4 router of ``model`` (decoder layers and MTP) by module name."""
    from verl_ds4.models.ds4.moe import DS4Router

    return {name: m for name, m in model.named_modules() if isinstance(m, DS4Router)}


def attach(model, plan, cp_rank: int, targets: dict[str, np.ndarray] | None = None) -> dict[str, RouteTape]:
    """A tape on every router; with ``targets`` (name -> ``[T, k]`` in token order) they replay those."""
    tapes = {}
    for name, router in routers(model).items():
        target = None
        if targets is not None:
            if name not in targets:
                raise ValueError(f"no routes to replay for router {name!r}; recorded: {sorted(targets)}")
            target = plan.pack(torch.as_tensor(targets[name], device=plan.device), cp_rank)
        tapes[name] = router.router_replay = RouteTape(target)
    return tapes


def collect(tapes: dict[str, RouteTape], plan, group) -> dict[str, dict[str, np.ndarray]]:
    """``{router: {"native": [T, k], "used": [T, k]}}`` in token order (gathered over CP; every rank calls it)."""
    out = {}
    for name, tape in tapes.items():
        if tape.native is None:
            raise RuntimeError(f"router {name!r} did not run in this forward")
        out[name] = {k: plan.unpack(getattr(tape, k), group=group).values().cpu().numpy() for k in ("native", "used")}
    return out


def detach(model) -> None:
    for router in routers(model).values():
        router.router_replay = None


def count_differences(ours: dict, reference: dict) -> tuple[int, int]:
    """``(rows whose native expert set differs from the reference's, rows)`` over every router."""
    differ = total = 0
    for name, ref in reference.items():
        a = np.sort(ours[name]["native"], axis=-1)
        b = np.sort(ref["native"], axis=-1)
        differ += int((a != b).any(axis=-1).sum())
        total += a.shape[0]
    return differ, total


def attach_for_run(opts, key, actor, critic, input_ids, min_rows: int, world: int, cp_rank: int):
    """``(plan, {"actor": tapes, "critic": tapes})`` when this run records or replays routes, else ``None``."""
    replay = (opts.replay or {}).get(key)
    if not (opts.record_routes or replay):
        return None
    from verl_ds4.layout import PlanOptions
    from verl_ds4.mcore.thd import make_plan

    plan = make_plan(input_ids, PlanOptions(layout="contiguous", cp_size=world, min_local_rows=min_rows))
    tapes = {role: attach(m, plan, cp_rank, (replay or {}).get(role)) for role, m in (("actor", actor), ("critic", critic))}
    return plan, tapes
