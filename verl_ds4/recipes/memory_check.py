"""The start-up memory check of a composed DS4 recipe: a table per role, and a refusal when it cannot fit.

:func:`check_memory` reads the recipe once into the memory model's inputs
(:func:`verl_ds4.recipes.memory_inputs.read_memory_inputs`: meshes, optimizer settings, offload flags, token
budgets, the rollout, host RAM), runs the model (:func:`verl_ds4.memory.roles.evaluate`) and adds its findings
to the validation report:

* as **errors** with ``ds4.memory_check=error`` (the default): a role's peak over the GPU less the headroom,
  roles that do not fit beside each other, the rollout's weights over vLLM's share, a node's host RAM short
  (each with the smallest changes that fit; :mod:`verl_ds4.memory.roles` says what is compared);
* as **warnings** with ``ds4.memory_check=warn`` (and a line saying so), nothing with ``off`` (and a line
  saying the check is off).
"""

from __future__ import annotations

from omegaconf import DictConfig

from verl_ds4.memory.roles import MemoryReport, evaluate
from verl_ds4.recipes.memory_inputs import read_memory_inputs
from verl_ds4.recipes.roles import Problem

__all__ = ["check_memory"]


def check_memory(cfg: DictConfig, report) -> MemoryReport:
    """Add the memory findings of the composed recipe to ``report`` (a ``ValidationReport``)."""
    inputs = read_memory_inputs(cfg, report)
    memory, found, warnings, notes = evaluate(inputs)
    report.warnings.extend(warnings)
    if inputs.mode == "warn" and found:
        report.warnings.extend(Problem(p.setting, p.message + " (ds4.memory_check=warn: not refused)", p.fix) for p in found)
        report.notes.append(f"ds4.memory_check=warn: {len(found)} memory finding(s) reported as warnings; the run is NOT refused.")
    else:
        report.errors.extend(found)
    report.notes.extend(notes)
    return memory
