"""Lifecycle of a local worker process: spawn, wait until ready, stop, and never leave an orphan.

A worker is ``python -m homerlhf.cli worker ... --parent-pid <ours>``. Three guards keep it from
outliving its owner: :meth:`WorkerProcess.stop` (called by the backend's ``close``), an ``atexit``
hook for every worker still running at interpreter exit (normal exit, Ctrl-C, an uncaught error),
and the worker's own parent watch, which covers ``kill -9`` of the owner where no Python code runs.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Optional

from homerlhf.errors import UserError
from homerlhf.workers.server import READY_PREFIX

_LIVE: "weakref.WeakSet[WorkerProcess]" = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def _stop_all() -> None:
    with _LIVE_LOCK:
        workers = list(_LIVE)
    for worker in workers:
        worker.stop()


atexit.register(_stop_all)


class WorkerProcess:
    """One local worker subprocess; :meth:`start` may be called again after it died (a restart)."""

    def __init__(self, role: str, model: str | Path, *, threads: int = 0, ctx: int = 2048,
                 f32_kv_cache: bool = False, log_path: Optional[str | Path] = None,
                 startup_timeout: float = 180.0, batch_tokens: int = 0):
        self.role = role
        self.model = Path(model)
        self.threads = threads
        self.ctx = ctx
        self.f32_kv_cache = f32_kv_cache
        self.batch_tokens = batch_tokens
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else None
        self._proc: Optional[subprocess.Popen] = None
        self._log_file = None
        self.url: Optional[str] = None
        self.starts = 0

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "homerlhf.cli", "worker", "--role", self.role, "--model", str(self.model),
               "--port", "0", "--ctx", str(self.ctx), "--threads", str(self.threads),
               "--parent-pid", str(os.getpid())]
        if self.f32_kv_cache:
            cmd.append("--f32-kv-cache")
        if self.batch_tokens:
            cmd += ["--batch-tokens", str(self.batch_tokens)]
        return cmd

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> str:
        """Spawns the worker, waits for its ready line; returns its URL. Raises UserError on failure."""
        self.stop()
        if self.log_path is None:
            import tempfile

            fd, name = tempfile.mkstemp(prefix=f"homerlhf-{self.role}-worker-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._log_file = open(self.log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # Own session: a Ctrl-C in the terminal reaches the trainer, which then stops us in order.
        self._proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=self._log_file,
                                      stderr=subprocess.STDOUT, env=env, start_new_session=True)
        with _LIVE_LOCK:
            _LIVE.add(self)
        self.starts += 1
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            match = re.search(rf"{READY_PREFIX} .*?url=(\S+)", self._read_log(offset))
            if match:
                self.url = match.group(1)
                return self.url
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self.stop()
                raise UserError(f"the {self.role} worker exited with code {code} before it was ready; its last lines:\n{self.tail()}")
            time.sleep(0.05)
        self.stop()
        raise UserError(f"the {self.role} worker was not ready after {self.startup_timeout:.0f} s; its last lines:\n{self.tail()}")

    def _read_log(self, offset: int) -> str:
        with open(self.log_path, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode("utf-8", "replace")

    def tail(self, lines: int = 15) -> str:
        """The last lines of the worker's log (stdout and stderr)."""
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        with open(self.log_path, "rb") as fh:
            fh.seek(max(0, self.log_path.stat().st_size - 8192))
            text = fh.read().decode("utf-8", "replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate (then kill) the worker and reap it. Safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            else:
                proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        self.url = None
