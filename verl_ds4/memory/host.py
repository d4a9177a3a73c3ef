"""Host RAM per node: what a DS4 run keeps in a node's memory, against the node's RAM (pure Python).

Per node (``gpus_per_node`` GPUs), :func:`host_memory` adds:

* **offloaded states**: verl's ``param_offload`` (weights + gradient buffers) and ``optimizer_offload``
  (optimizer states) keep a role's states on the host between its phases, and Megatron's CPU
  optimizer offload keeps its share there for good (with an fp32 gradient copy);
* **checkpoint conversion**: saving or converting a checkpoint (Megatron distributed checkpoint, the
  HF export) stages one bf16 copy of each GPU's weights on the host;
* **the training processes**: :data:`PROCESS_GIB_PER_GPU` per GPU (one worker's Python, torch, Megatron
  and CUDA host state, and the rollout engine's host side when colocated);
* **the data loader**: :data:`LOADER_GIB_PER_GPU` per GPU (workers, prefetched batches, tokenizer);
* **Ray's object store** when ``ray_kwargs.ray_init.object_store_memory`` sets it (otherwise Ray reserves
  shared memory that it fills on demand with the step's batches, which are small next to the states).

A node's RAM comes from ``ds4.mesh.host_memory_gib`` or, by the mesh's ``hardware``, from
:data:`HOST_MEMORY_GIB` (the vendors' reference systems: DGX H100 / H200 / B200 with 2 TB; a GB200 /
GB300 NVL72 compute tray of 4 GPUs and two Grace CPUs with 480 GB LPDDR5X each). The check is
``ds4.memory_check``'s: an error (or a warning with ``warn``) when the total exceeds the RAM.
"""

from __future__ import annotations

from verl_ds4.memory.types import Finding, MemoryInputs

__all__ = ["HOST_MEMORY_GIB", "LOADER_GIB_PER_GPU", "PROCESS_GIB_PER_GPU", "host_memory_gib", "host_memory", "host_findings"]

GB = 1e9 / float(1 << 30)  # GiB per GB

#: RAM of one node (GiB) of each GPU type's reference system; ``ds4.mesh.host_memory_gib`` wins.
HOST_MEMORY_GIB = {
    "H100-80GB": 2000 * GB,
    "H200": 2000 * GB,
    "B200": 2000 * GB,
    "GB200": 960 * GB,
    "GB300": 960 * GB,
}
LOADER_GIB_PER_GPU = 2.0
PROCESS_GIB_PER_GPU = 8.0


def host_memory_gib(hardware: str | None, explicit) -> float | None:
    """A node's RAM: ``explicit`` (``ds4.mesh.host_memory_gib``) wins, else the table by name, else None."""
    if explicit is not None:
        value = float(explicit)
        if value <= 0:
            raise ValueError(f"ds4.mesh.host_memory_gib is {explicit!r}; expected a positive number of GiB.")
        return value
    return HOST_MEMORY_GIB.get(hardware or "")


def host_memory(memory, gpus_per_node: int, object_store_memory=None) -> dict[str, float]:
    """GiB per node by what holds it (see the module doc); ``object_store_memory``: Ray's, in bytes (None: not set)."""
    per_gpu_offload = sum(rm.offloaded_host_gib for rm in memory.roles)
    weights = max((rm.worst.weights_gib for rm in memory.roles), default=0.0)
    out = {
        "offloaded states": gpus_per_node * per_gpu_offload,
        "checkpoint staging": gpus_per_node * weights,
        "processes": gpus_per_node * PROCESS_GIB_PER_GPU,
        "data loader": gpus_per_node * LOADER_GIB_PER_GPU,
    }
    if object_store_memory is not None:
        out["Ray object store"] = float(object_store_memory) / float(1 << 30)
    return out


def host_findings(inputs: MemoryInputs, memory) -> tuple[list[Finding], list[Finding]]:
    """(problems, warnings) of the host RAM check (fills ``memory.host`` and ``memory.host_capacity_gib``). A node
    whose RAM is not known (hardware outside the table, no ``ds4.mesh.host_memory_gib``) is a warning: nothing to compare."""
    try:
        capacity = host_memory_gib(memory.hardware, inputs.host_memory_gib)
    except ValueError as e:
        return [Finding("ds4.mesh.host_memory_gib", str(e), "give the RAM of one node in GiB, e.g. ds4.mesh.host_memory_gib=1800.")], []
    memory.host = host_memory(memory, inputs.gpus_per_node, inputs.object_store_memory)
    memory.host_capacity_gib = capacity
    if capacity is None:
        return [], [Finding(
            "ds4.mesh.host_memory_gib",
            f"host RAM per node is not known for hardware {memory.hardware!r} (known: {sorted(HOST_MEMORY_GIB)}), so the "
            f"{sum(memory.host.values()):.0f} GiB per node this run needs on the host were not checked.",
            "set ds4.mesh.host_memory_gib=<GiB of RAM per node>.",
        )]
    total = sum(memory.host.values())
    if total <= capacity:
        return [], []
    parts = ", ".join(f"{k} {v:.0f}" for k, v in memory.host.items() if v)
    return [Finding(
        "host memory",
        f"a node needs {total:.0f} GiB of RAM ({parts}) but has {capacity:.0f} GiB ({memory.hardware} node; ds4.mesh.host_memory_gib).",
        "turn off verl's offload for a role (ds4.offload.param=false / ds4.offload.optimizer=false) where the GPU has room, "
        "lower Megatron's optimizer_offload_fraction, use more nodes, or set ds4.mesh.host_memory_gib if the nodes have more RAM.",
    )], []
