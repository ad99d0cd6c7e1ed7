"""Capturing the static loop's decode step as a CUDA graph, and what every capture of a model shares.

A capture costs beyond the step; :class:`StepGraphs` keeps it to once per shape (one memory pool and
one side stream for every capture of a model) and refuses a step that would sync before a capture
begins (:class:`CaptureFailed`). The CUDA primitives are the four methods a CPU test replaces
(``new_stream``, ``new_pool``, ``on_stream``, ``capture_graph``): everything else, and the order of
it, is what runs on a GPU.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from homerlhf.models.host_sync import HostSync, no_host_sync

# Eager steps on the side stream before the first capture: lazy initialisations (cuBLAS workspaces,
# allocator blocks) must not happen inside a graph. The last one is the host-sync check, and later
# captures of the same model (the stream and its workspace already made) run only that one.
WARMUP_STEPS = 2


class CaptureFailed(RuntimeError):
    """The decode step could not be captured as a CUDA graph (the message says why)."""


class StepGraphs:
    """Captures decode steps of one model on ``device``: one side stream and one graph memory pool for
    all of them, each made on first use. ``graphs_made`` counts captures that began.

    - ``torch.cuda.graph`` synchronises the device and empties the allocator's cache on entry, and a
      graph's private pool stays reserved while any graph holds it. Every capture goes into one pool
      (``graph_pool_handle()``, made once), so the pool of a graph no longer replayed is reused by the next
      capture; and :class:`homerlhf.models.static_decode.StaticDecoder` keeps a captured step for the next
      call of the same shape, so a run captures once per (rows, cache length), not once per chunk.
    - cuBLAS keeps a workspace per (handle, stream): warm-up and capture run on one side stream made once
      for the model, so one workspace serves all.
    - A capture that fails in ``cudaStreamEndCapture`` leaves the allocator in capture mode for the rest
      of the process (no free-and-retry on an out-of-memory error). So the last warm-up step runs under
      :func:`homerlhf.models.host_sync.no_host_sync`, and a step that would sync raises
      :class:`CaptureFailed` from there, before any capture begins."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._stream = None
        self._pool = None
        self._warmed = False  # the first capture's lazy initialisations are done
        self.graphs_made = 0

    # -- the CUDA primitives -------------------------------------------------------------------
    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def new_pool(self):
        return torch.cuda.graph_pool_handle()

    @contextmanager
    def on_stream(self, stream) -> Iterator[None]:
        """Run the body on ``stream``, ordered after and before the current stream's work."""
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            yield
        current.wait_stream(stream)

    def capture_graph(self, step: Callable[[], None], stream, pool):
        """``step`` captured on ``stream`` into ``pool``; returns the graph (``.replay()`` runs it)."""
        graph, current = torch.cuda.CUDAGraph(), torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                step()
        finally:
            torch.cuda.set_stream(current)  # torch.cuda.graph leaves its stream current when capture_end raises
        return graph

    # -- what they are used for ----------------------------------------------------------------
    @property
    def stream(self):
        if self._stream is None:
            self._stream = self.new_stream()
        return self._stream

    @property
    def pool(self):
        if self._pool is None:
            self._pool = self.new_pool()
        return self._pool

    def release_pool(self) -> None:
        """Forget the pool once no graph holds it (the allocator then frees it; a later capture gets
        a new one: a pool whose graphs are all gone cannot be shared again)."""
        self._pool = None

    def capture(self, step: Callable[[], None], rewind: Callable[[], None]):
        """Warm ``step`` up (the last run under the host-sync guard), capture it and ``rewind()``
        the buffers the runs advanced. Raises :class:`CaptureFailed` (before any capture when the
        step syncs) or the out-of-memory error that ended a capture."""
        stream = self.stream
        try:
            with self.on_stream(stream):
                for _ in range(0 if self._warmed else WARMUP_STEPS - 1):
                    step()
                with no_host_sync(self.device):
                    step()
        except HostSync as exc:
            raise CaptureFailed(f"{exc} (declined before capturing)") from exc
        finally:
            rewind()
        self._warmed = True
        self.graphs_made += 1
        try:
            return self.capture_graph(step, stream, self.pool)
        except Exception as exc:  # noqa: BLE001 - whatever the op, the answer is HF generate; an OOM is an OOM
            for cause in (exc, exc.__context__):  # (capture_end's own error may hide the OOM that ended the capture)
                if isinstance(cause, torch.OutOfMemoryError):
                    raise cause from None
            raise CaptureFailed(f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}") from exc
        finally:
            rewind()
