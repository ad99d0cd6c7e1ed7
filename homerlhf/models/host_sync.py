"""A guard that raises where a step would make the host wait for the device: what breaks a CUDA graph.

A captured step must be a fixed sequence of kernels on static buffers. An op that reads a device value
on the host (``.item()``, ``bool(t)``, ``if t > 0:``), returns a shape that depends on the data
(``nonzero``, boolean indexing, ``unique``) or copies a host tensor to the device cannot be captured:
``cudaStreamEndCapture`` then fails, and by then the allocator is stuck in capture mode for the rest of
the process. :func:`no_host_sync` runs code so that such an op raises :class:`HostSync` first, on any
device (a ``TorchDispatchMode`` sees every aten op of the current thread, so the check works on the CPU
too). It sees aten ops only: a sync inside a custom kernel's host code would still reach the capture.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class HostSync(RuntimeError):
    """An op made (or would make, on a GPU) the host wait for the device; the message names it."""


_SYNCS = {torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero, torch.ops.aten.masked_select,
          torch.ops.aten.equal, torch.ops.aten._unique2, torch.ops.aten.unique_consecutive,
          torch.ops.aten.unique_dim}
_INDEX = (torch.ops.aten.index, torch.ops.aten.index_put_, torch.ops.aten.index_put)
_COPIES = (torch.ops.aten._to_copy, torch.ops.aten.copy_)


def _host_to_device(func, args, kwargs) -> bool:
    """A copy of a host tensor to a device (a pageable copy is not capturable)."""
    if func.overloadpacket is torch.ops.aten.copy_:
        dst, src = args[0], args[1]
        return isinstance(src, torch.Tensor) and src.device.type == "cpu" and dst.device.type != "cpu"
    device = kwargs.get("device")
    return args[0].device.type == "cpu" and device is not None and torch.device(device).type != "cpu"


class NoHostSync(TorchDispatchMode):
    """Raises :class:`HostSync` on every op that reads a device value on the host, gives a
    data-dependent shape, or copies a host tensor to a device. ``device_type``: only ops on tensors
    of that type count (a CUDA step may read a CPU tensor freely); None: every tensor (the CPU's own
    tests stand in for a device)."""

    def __init__(self, device_type: Optional[str] = None):
        super().__init__()
        self.device_type = device_type

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _COPIES and _host_to_device(func, args, kwargs):
            raise HostSync(f"host-to-device copy in the decode step: {func}")
        if self.device_type is not None and not any(
                isinstance(t, torch.Tensor) and t.device.type == self.device_type for t in tree_leaves((args, kwargs))):
            return func(*args, **kwargs)
        bool_index = packet in _INDEX and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []))
        if packet in _SYNCS or bool_index:
            raise HostSync(f"host sync in the decode step: {func}")
        return func(*args, **kwargs)


@contextmanager
def no_host_sync(device: torch.device | str) -> Iterator[None]:
    """Run the body under :class:`NoHostSync`, for tensors of ``device``'s type (on the CPU: all).

    Not ``torch.cuda.set_sync_debug_mode("error")``: that setting is process-wide, and a reward model
    scoring on the GPU in another thread meanwhile would fail on its own syncs; a dispatch mode is
    the current thread's only."""
    kind = torch.device(device).type
    with NoHostSync(None if kind == "cpu" else kind):
        yield
