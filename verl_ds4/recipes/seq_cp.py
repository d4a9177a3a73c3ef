"""The CP size ``ds4.max_seq_len`` derives: the one of the mesh's sizes that holds the longest sequence at peak.

With ``ds4.max_seq_len=N`` set and no CP of the user's (``ds4.mesh.cp``, launcher ``CP``, or an engine's
``context_parallel_size``), :func:`derive` judges the mesh's own CP first: the lengths and budgets
:mod:`verl_ds4.recipes.seq_len` derives for it, then the start-up check (:func:`verl_ds4.recipes.validate.validate_recipe`
and its memory check, the same code the launchers run) on the result. When it *holds* N (every budget x CP >= N,
every role's peak and every colocated training phase at most the GPU less ``ds4.memory_headroom``), nothing changes.
Otherwise the smallest other CP the mesh allows (a power of two dividing GPUs / (TP x PP)) that holds N is derived:
``ds4.mesh.cp=C`` leads the derived overrides (the dry-run's note, the launchers' ``DS4_DERIVED_OVERRIDES``), the
lengths and budgets follow it. When none holds, the mesh's CP stays and the run is refused naming the lowest peak.

A CP the user set is kept; if it cannot hold N at peak the run is refused naming the CP sizes of the mesh that
would (``ds4.memory_check=off`` skips both: no peak, nothing to judge).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from verl_ds4.recipes.roles import Problem
from verl_ds4.recipes.seq_len import KNOB, derived_overrides, explicit_keys

CP_KEY = "ds4.mesh.cp"


@dataclass
class Derivation:
    """What ``ds4.max_seq_len`` derives for one recipe + override list.

    ``overrides``: appended to the user's (``ds4.mesh.cp=C`` first when the CP is derived); ``cp``: the CP the run
    uses; ``mesh_cp``: the composed one (the mesh's or the user's); ``explicit``: the user's CP key or None;
    ``peaks``: CP -> the highest peak (GiB per GPU) at N of the sizes judged (None: its budgets cannot hold N);
    ``limit_gib``: what a peak may reach; ``problems``: refusals for the start-up check."""

    n: int | None = None
    overrides: list[str] = field(default_factory=list)
    cp: int | None = None
    mesh_cp: int | None = None
    explicit: str | None = None
    allowed: tuple[int, ...] = ()
    peaks: dict[int, float | None] = field(default_factory=dict)
    limit_gib: float | None = None
    problems: list[Problem] = field(default_factory=list)

    @property
    def derived_cp(self) -> bool:
        return self.cp is not None and self.cp != self.mesh_cp

    def holding(self) -> list[int]:
        """The judged CP sizes that hold N at peak."""
        return sorted(c for c, p in self.peaks.items() if p is not None and self.limit_gib is not None and p <= self.limit_gib)

    def _peaks_text(self) -> str:
        return ", ".join(f"CP {c}: " + ("budget x CP < N" if p is None else f"{p:.1f} GiB") for c, p in sorted(self.peaks.items()))

    def describe(self) -> str | None:
        """The dry-run's note on the CP (None when ``ds4.max_seq_len`` is unset or the peak was not judged)."""
        if self.n is None or self.cp is None or not self.peaks:
            return None
        limit = f"limit {self.limit_gib:.1f} GiB" if self.limit_gib is not None else "no limit"
        if self.explicit:
            how = f"yours ({self.explicit})"
        elif self.derived_cp:
            how = f"derived (the mesh's CP {self.mesh_cp} does not hold it)"
        else:
            how = "the mesh's"
        return f"{CP_KEY}={self.cp} for {KNOB}={self.n}: {how}; peak at N per CP size judged ({limit}): {self._peaks_text()}"

    def as_dict(self) -> dict[str, Any]:
        return {"max_seq_len": self.n, "overrides": list(self.overrides), "cp": self.cp, "mesh_cp": self.mesh_cp,
                "cp_derived": self.derived_cp, "cp_explicit": self.explicit, "cp_allowed": list(self.allowed),
                "peak_gib_per_cp": {str(c): (None if p is None else round(p, 2)) for c, p in sorted(self.peaks.items())},
                "limit_gib": None if self.limit_gib is None else round(self.limit_gib, 2)}


def _cp_keys(user: set[str]) -> list[str]:
    return sorted(k for k in user if k == CP_KEY or k.endswith(".context_parallel_size"))


def allowed_cps(world: int, tp: int, pp: int) -> tuple[int, ...]:
    """The CP sizes a mesh of ``world`` GPUs with ``tp`` x ``pp`` allows: powers of two dividing world / (TP x PP)."""
    if tp < 1 or pp < 1 or world % (tp * pp):
        return ()
    rest, out, c = world // (tp * pp), [], 1
    while c <= rest:
        if rest % c == 0:
            out.append(c)
        c *= 2
    return tuple(out)


def _judge(base: DictConfig, kind: str, overrides: list[str], cp: int, cp_keys: list[str], n: int) -> tuple[list[str], float | None, float | None]:
    """(the length overrides at ``cp``, the highest peak at N or None when a budget x CP is short, the limit)."""
    from verl_ds4.recipes.validate import validate_recipe

    cfg = copy.deepcopy(base)
    OmegaConf.set_struct(cfg, False)
    for key in [CP_KEY, *cp_keys]:
        OmegaConf.update(cfg, key, cp, merge=False)
    lengths = derived_overrides(OmegaConf.to_container(cfg, resolve=True), kind, overrides)
    for o in lengths:
        key, value = o.split("=", 1)
        OmegaConf.update(cfg, key, int(value), merge=False)
    OmegaConf.resolve(cfg)
    report = validate_recipe(cfg, kind, dry_run=True, raise_on_error=False)
    memory = report.memory
    if memory is None or memory.skipped or not memory.roles:
        return lengths, None, None
    if any(b.tokens_per_gpu * r.cp < n for r in report.roles for b in r.budgets):
        return lengths, None, memory.limit_gib
    peaks = [rm.peak_gib for rm in memory.roles] + [gib for name, gib in memory.phases if name != "rollout"]
    return lengths, max(peaks), memory.limit_gib


def derive(base: DictConfig, kind: str, overrides: list[str] | tuple[str, ...]) -> Derivation:
    """The CP and the lengths ``ds4.max_seq_len`` derives for the composed, unresolved ``base`` (see the module doc).

    ``kind``: ``"sft"`` or ``"ppo"``; ``overrides``: the user's (their keys are never replaced)."""
    overrides = list(overrides)
    n = OmegaConf.select(base, KNOB)
    if n is None:
        return Derivation()
    n = int(n)
    container = OmegaConf.to_container(base, resolve=True)
    lengths = derived_overrides(container, kind, overrides)
    mesh = container.get("ds4", {}).get("mesh") or {}
    mesh_cp = int(mesh.get("cp") or 1)
    out = Derivation(n=n, overrides=lengths, cp=mesh_cp, mesh_cp=mesh_cp)
    if n < 1 or str(OmegaConf.select(base, "ds4.memory_check", default="error")) == "off":
        return out
    user_cp = _cp_keys(explicit_keys(overrides))
    out.explicit = user_cp[0] if user_cp else None
    trainer = container.get("trainer", {})
    world = int(trainer.get("nnodes") or 1) * int(trainer.get("n_gpus_per_node") or 1)
    out.allowed = allowed_cps(world, int(mesh.get("tp") or 1), int(mesh.get("pp") or 1))
    engine_keys = [k for k in user_cp if k != CP_KEY]
    _, out.peaks[mesh_cp], out.limit_gib = _judge(base, kind, overrides, mesh_cp, engine_keys, n)
    if out.limit_gib is None or mesh_cp in out.holding():
        return out
    chosen = None
    for cp in (c for c in out.allowed if c != mesh_cp):
        lengths_at, out.peaks[cp], _ = _judge(base, kind, overrides, cp, engine_keys, n)
        if cp in out.holding() and chosen is None:
            chosen = (cp, lengths_at)
            if not out.explicit:
                break
    if out.explicit:
        holding = out.holding()
        out.problems.append(Problem(
            out.explicit,
            f"is {mesh_cp}, which cannot hold {KNOB}={n} at peak ({_peak_of(out, mesh_cp)}; the limit is {out.limit_gib:.1f} GiB).",
            (f"set {CP_KEY}={holding[0]} (CP sizes of this mesh that hold it: {holding}), or drop {out.explicit} and it is derived"
             if holding else f"no CP size of this mesh ({list(out.allowed)}) holds it: {out._peaks_text()}; "
             f"see the memory levers, more GPUs, or a lower {KNOB}") + " (launcher CP / MAX_SEQ_LEN).",
        ))
    elif chosen is not None:
        out.cp = chosen[0]
        out.overrides = [f"{CP_KEY}={chosen[0]}", *chosen[1]]
    else:
        out.problems.append(Problem(
            KNOB,
            f"is {n}: no CP size of this mesh ({list(out.allowed)}, GPUs / (TP x PP)) holds it at peak within "
            f"{out.limit_gib:.1f} GiB ({out._peaks_text()}).",
            f"lower {KNOB} (launcher MAX_SEQ_LEN), or a mesh with more GPUs or another kernel path: the memory levers "
            f"below, `verl-ds4 plan --fit --max-seq-len {n}`.",
        ))
    return out


def _peak_of(out: Derivation, cp: int) -> str:
    p = out.peaks.get(cp)
    return "its budget x CP is shorter than N" if p is None else f"{p:.1f} GiB per GPU"
