"""Count device-to-host reads made while a block runs (for the one-transfer-per-micro-batch tests).

On a GPU every one of these is a synchronising device-to-host transfer; on the CPU nothing moves,
so the counter intercepts the *calls* that would transfer (a ``TorchFunctionMode``): ``.item()``,
``.tolist()``, ``.cpu()``, ``.numpy()``, ``.to(<cpu>)``, ``int()`` / ``float()`` / ``bool()`` /
``index`` of a tensor (``.to(x)`` counts when ``x`` is the string ``"cpu"``: on a CPU machine a
device object cannot tell a host read from a host-to-device copy), ``torch.equal`` (returns a host bool), ``nonzero`` / boolean-mask indexing
and ``repeat_interleave`` without ``output_size`` (their output size is read on the host).
``.to("cpu").numpy()`` on one line counts once (one transfer, then a host view).

Each event keeps the caller's ``file:line`` (first frame outside torch and this module), so a
failing count says where the extra read came from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostTransferCounter", "count_host_transfers", "cuda_sync_errors"]

_READS = {
    torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy", torch.Tensor.__int__: "int", torch.Tensor.__float__: "float",
    torch.Tensor.__bool__: "bool", torch.Tensor.__index__: "index", torch.equal: "equal",
    torch.Tensor.nonzero: "nonzero", torch.nonzero: "nonzero",
}  # fmt: skip
_HOST_VIEWS = ("numpy", "tolist", "item")


def _is_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/torch/" not in name and not name.endswith("host_transfers.py"):
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


@dataclasses.dataclass
class HostTransferCounter(TorchFunctionMode):
    events: list = dataclasses.field(default_factory=list)  # (kind, where)

    def __post_init__(self):
        super().__init__()
        self._last_to_host = None  # (result id, where) of the last .cpu()/.to(cpu)

    def _record(self, kind: str, where: str, tensor=None) -> None:
        if kind in _HOST_VIEWS and self._last_to_host == (id(tensor), where):
            return  # .to("cpu").numpy(): the transfer was counted
        self.events.append((kind, where))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _READS.get(func)
        if func is torch.Tensor.to:
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            # On a CPU machine every device is the host: only an explicit ``"cpu"`` target is a host
            # read (``.to(plan.device)`` is a host-to-device copy on a GPU and is not counted).
            if isinstance(target, str) and _is_cpu(target):
                kind = "to_cpu"
        elif func is torch.Tensor.__getitem__ and len(args) > 1:
            index = args[1]
            if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
                kind = "bool_mask_index"
        elif func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
                kind = "repeat_interleave"
        if func is torch.Tensor.nonzero or func is torch.nonzero:
            kind = "nonzero"
        with torch._C.DisableTorchFunction():
            result = func(*args, **kwargs)
        if kind is not None:
            where = _caller()
            self._record(kind, where, args[0] if args else None)
            if kind in ("cpu", "to_cpu"):
                self._last_to_host = (id(result), where)
        return result

    @property
    def count(self) -> int:
        return len(self.events)


@contextlib.contextmanager
def count_host_transfers():
    """``with count_host_transfers() as counter: ...``; then ``counter.count`` / ``counter.events``."""
    counter = HostTransferCounter()
    with counter:
        yield counter


@contextlib.contextmanager
def cuda_sync_errors():
    """On a GPU: every synchronising CUDA call in the block raises (``set_sync_debug_mode("error")``)."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
