"""A guard that raises where a step would make the host wait for the device: what breaks a CUDA graph.

A captured step must be a fixed sequence of kernels on static buffers. An op that reads a device value
on the host (``.item()``, ``bool(t)``, ``if t > 0:``), returns a shape that depends on the data
(``nonzero``, boolean indexing, ``unique``) or copies a host tensor to the device cannot be captured:
``cudaStreamEndCapture`` then fails, and by then the allocator is stuck in capture mode for the rest of
the process. :func:`no_host_sync` runs code so that such an op raises :class:`HostSync` first, on any
device (a ``TorchDispatchMode`` sees every aten op, so the check works on the CPU too), plus
``torch.cuda.set_sync_debug_mode("error")`` on CUDA for syncs no aten op shows.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode


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
    data-dependent shape, or copies a host tensor to a device."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        bool_index = packet in _INDEX and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []))
        if packet in _SYNCS or bool_index:
            raise HostSync(f"host sync in the decode step: {func}")
        if packet in _COPIES and _host_to_device(func, args, kwargs):
            raise HostSync(f"host-to-device copy in the decode step: {func}")
        return func(*args, **kwargs)


@contextmanager
def no_host_sync(device: torch.device | str) -> Iterator[None]:
    """Run the body under :class:`NoHostSync` (and, on CUDA, the sync debug mode "error", whose
    RuntimeError is re-raised as :class:`HostSync`)."""
    cuda = torch.device(device).type == "cuda"
    previous = torch.cuda.get_sync_debug_mode() if cuda else 0
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        with NoHostSync():
            yield
    except RuntimeError as exc:
        if isinstance(exc, HostSync) or not cuda or "synchroniz" not in str(exc):
            raise
        raise HostSync(f"host sync in the decode step: {str(exc).strip().splitlines()[0][:200]}") from exc
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(previous)
