"""The DS4 memory model: what one GPU holds at its peak, per role, pass and pipeline stage (pure Python).

A function of typed inputs: the recipe layer reads a composed config once into
:class:`~verl_ds4.memory.types.MemoryInputs` (:func:`verl_ds4.recipes.memory_inputs.read_memory_inputs`) and turns
the findings this package returns (:class:`~verl_ds4.memory.types.Finding`) into its validation problems. Nothing
here reads a config. Who owns what (imports run one way, top to bottom; no cycles):

* :mod:`.terms`: two terms that grow with the tokens, as pure functions: the logits step per pass and kernel
  (fused / unfused) and the rollout's KV cache.
* :mod:`.peak`: the step's activations, transients and logits per token (:class:`~.peak.Term`), per attention
  kernel path and recompute; the headroom rule.
* :mod:`.micro_batches`: micro-batches per pass and in flight per stage, rows of a fixed-size micro-batch.
* :mod:`.types`: the inputs (:class:`Mesh`, :class:`OptimizerSettings`, :class:`PassSetting`,
  :class:`KernelSettings`, :class:`RoleInput`, :class:`RolloutInput`, :class:`MemoryInputs`) and :class:`Finding`.
* :mod:`.stages`: states (weights, gradients, optimizer) + :mod:`.peak` per pipeline stage
  (:func:`~.stages.training_memory`); GPU capacities; rollout weights.
* :mod:`.kernels`: the kernel paths and recompute Megatron refuses, per GPU generation.
* :mod:`.host`: host RAM per node.
* :mod:`.rollout`: the rollout's KV cache for the recipe's lengths and concurrency against vLLM's share.
* :mod:`.fixes`: findings (peaks over the limit, colocated phases, the rollout, host RAM) and the smallest
  changes that fit.
* :mod:`.roles`: :class:`~.roles.RoleMemory` (a role's passes), :class:`~.roles.MemoryReport` and
  :func:`~.roles.evaluate` (inputs -> report + findings).
* :mod:`.table`: the memory table ``verl-ds4 recipe --dry-run`` prints.
* :mod:`.fit`: ``plan --fit``: every mesh of a GPU count, ranked by whether its roles' peaks fit.

docs/memory.md lists every term; its section "From a setting to its term" follows a config key to the
function that counts it.
"""

from .roles import MemoryReport, RoleMemory, evaluate, role_memory
from .stages import StageMemory, training_memory
from .types import Finding, KernelSettings, MemoryInputs, Mesh, OptimizerSettings, PassSetting, RoleInput, RolloutInput

__all__ = [
    "Finding", "KernelSettings", "MemoryInputs", "MemoryReport", "Mesh", "OptimizerSettings", "PassSetting", "RoleInput",
    "RoleMemory", "RolloutInput", "StageMemory", "evaluate", "role_memory", "training_memory",
]
