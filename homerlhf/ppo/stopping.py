"""Graceful stop: SIGINT / SIGTERM ask the training loop to stop at the next phase boundary.

The first signal only sets a flag (and says so on stderr); the loop looks at it between phases,
writes a checkpoint, closes its backends (which stops the llama.cpp workers) and returns, so the
command exits 0. A second signal aborts at once by raising ``KeyboardInterrupt`` wherever the
main thread is: ``finally`` blocks still close the backends, ``homerlhf.workers.process`` stops
any worker left at interpreter exit, and each worker's ``--parent-pid`` watch covers the rest, so
no worker outlives the trainer either way. Checkpoints are atomic, so an abort mid-save is safe.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Callable, Optional

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequested:
    """Context manager installing the stop handlers for the duration of a run.

    ``requested`` is True once a first signal arrived; ``reason`` names it. Handlers can only be
    installed from the main thread; elsewhere (the Gradio app runs the trainer in a subprocess
    anyway) this is a flag that only :meth:`request` sets.
    """

    def __init__(self, echo: Optional[Callable[[str], None]] = None):
        self.requested = False
        self.reason: Optional[str] = None
        self._echo = echo or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._previous: dict[int, object] = {}

    def request(self, reason: str = "stop requested") -> None:
        """Ask for a stop from code (tests, the non-finite guard's callers, an app button)."""
        self.requested = True
        self.reason = self.reason or reason

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            self._echo(f"{name} again: aborting now (workers are stopped; resume from the last checkpoint)")
            raise KeyboardInterrupt
        self.request(name)
        self._echo(f"{name}: stopping after the current phase and writing a checkpoint "
                   "(press Ctrl-C again to abort at once)")

    def __enter__(self) -> "StopRequested":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
