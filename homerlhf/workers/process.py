"""Lifecycle of a local worker process: spawn, wait until ready, stop, and never leave an orphan.

A worker is ``python -m homerlhf.cli worker ... --token-file <log>.token --parent-pid <ours>``: its
bearer token (fresh and random per worker) is in a 0600 file beside its log while it runs (the app's
monitor reads it from there too), never on its command line. Three guards keep it from
outliving its owner: :meth:`WorkerProcess.stop` (called by the backend's ``close``), an ``atexit``
hook for every worker still running at interpreter exit (normal exit, Ctrl-C, an uncaught error),
and the worker's own parent watch, which covers ``kill -9`` of the owner where no Python code runs.

A worker killed by a signal is described in one line (:func:`signal_death`): which signal, what it
means for a llama.cpp process, and what to do. Crash signals (SIGILL, SIGSEGV, ...) come from the
code on this CPU and come back on every start, so the client does not restart such a worker.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from homerlhf.errors import UserError
from homerlhf.workers.server import READY_PREFIX
from homerlhf.workers.tokens import write_token_file

_LIVE: "weakref.WeakSet[WorkerProcess]" = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def _stop_all() -> None:
    with _LIVE_LOCK:
        workers = list(_LIVE)
    for worker in workers:
        worker.stop()


atexit.register(_stop_all)

# llama.cpp for any x86-64 CPU with AVX2/FMA/F16C (Intel since 2013, AMD since 2015), not only the
# one it was compiled on.
# .ci/run builds with exactly these flags; README shows the same command.
PORTABLE_CMAKE_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"


def portable_reinstall_command() -> str:
    """The pip command that replaces the installed llama-cpp-python by a portable build of its version.

    ``--no-cache-dir`` and ``--no-binary``: pip must compile, never reuse a wheel built for another CPU."""
    try:
        pin = f"llama-cpp-python=={importlib.metadata.version('llama-cpp-python')}"
    except importlib.metadata.PackageNotFoundError:
        pin = "llama-cpp-python"
    return (f'CMAKE_ARGS="{PORTABLE_CMAKE_ARGS}" pip install --force-reinstall --no-deps --no-cache-dir '
            f"--no-binary llama-cpp-python {pin}")


@dataclass(frozen=True)
class SignalDeath:
    """How a llama.cpp process killed by ``signum`` is explained, and whether a fresh start can help."""

    signum: int
    meaning: str
    fix: str
    restartable: bool

    @property
    def name(self) -> str:
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"


# Crash signals are raised by llama.cpp's own code on this CPU: the same start crashes the same way.
_REINSTALL = "reinstall the portable llama.cpp build: {cmd}"
_CHECK_THEN_REINSTALL = "run `homerlhf doctor`; if its llama.cpp decode checks fail too, " + _REINSTALL
_DEATHS = {
    signal.SIGILL: ("illegal instruction: the llama.cpp build uses CPU instructions this machine lacks",
                    _REINSTALL, False),
    signal.SIGSEGV: ("llama.cpp crashed (invalid memory access)", _CHECK_THEN_REINSTALL, False),
    signal.SIGBUS: ("llama.cpp crashed (bus error; a model file rewritten while mapped causes it too)",
                    _CHECK_THEN_REINSTALL, False),
    signal.SIGFPE: ("llama.cpp crashed (arithmetic fault)", _CHECK_THEN_REINSTALL, False),
    signal.SIGABRT: ("llama.cpp aborted on a failed check", "its log says which", False),
    signal.SIGKILL: ("killed from outside, often by the kernel's out-of-memory killer (`dmesg` says)",
                     "free memory or lower the worker's ctx/threads", True),
    signal.SIGTERM: ("stopped from outside, by a user or a supervisor", "start the run again", True),
}


def signal_death(returncode: Optional[int]) -> Optional[SignalDeath]:
    """The explanation of a process that ended with ``returncode`` by a signal (< 0), else None."""
    if returncode is None or returncode >= 0:
        return None
    signum = -returncode
    meaning, fix, restartable = _DEATHS.get(signum, ("killed by a signal", "see its log", True))
    return SignalDeath(signum, meaning, fix.format(cmd=portable_reinstall_command()), restartable)


class WorkerProcess:
    """One local worker subprocess; :meth:`start` may be called again after it died (a restart)."""

    def __init__(self, role: str, model: str | Path, *, threads: int = 0, ctx: int = 2048,
                 f32_kv_cache: bool = False, log_path: Optional[str | Path] = None,
                 startup_timeout: float = 180.0, batch_tokens: int = 0, token: Optional[str] = None):
        self.role = role
        # In a 0600 file beside the log, never in argv: any user of the machine can read command lines.
        self.token = token or secrets.token_urlsafe(24)
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
        self._exit_code: Optional[int] = None  # of the last process, once it ended by itself

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "homerlhf.cli", "worker", "--role", self.role, "--model", str(self.model),
               "--port", "0", "--ctx", str(self.ctx), "--threads", str(self.threads),
               "--token-file", str(self.token_path), "--parent-pid", str(os.getpid())]
        if self.f32_kv_cache:
            cmd.append("--f32-kv-cache")
        if self.batch_tokens:
            cmd += ["--batch-tokens", str(self.batch_tokens)]
        return cmd

    def _log(self) -> Path:
        """The worker's log file: the one given, else a temporary file made once."""
        if self.log_path is None:
            import tempfile

            fd, name = tempfile.mkstemp(prefix=f"homerlhf-{self.role}-worker-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        return self.log_path

    @property
    def token_path(self) -> Path:
        """The 0600 file the worker reads its token from: ``<log>.token`` (removed by :meth:`stop`)."""
        return self._log().with_name(self._log().name + ".token")

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def exit_code(self) -> Optional[int]:
        """How the last worker process ended by itself (negative: by that signal); None while it runs
        and after :meth:`stop` ended it."""
        if self._proc is not None:
            return self._proc.poll()
        return self._exit_code

    def death(self) -> Optional[SignalDeath]:
        """Why the last worker process died, if a signal killed it."""
        return signal_death(self.exit_code)

    def death_line(self, death: SignalDeath) -> str:
        """One line for the user: the signal, what it means for a llama.cpp worker, what to do."""
        return f"the {self.role} worker died by {death.name} ({death.meaning}); {death.fix} (worker log: {self.log_path})"

    def start(self) -> str:
        """Spawns the worker, waits for its ready line; returns its URL. Raises UserError on failure."""
        self.stop()
        self._log().parent.mkdir(parents=True, exist_ok=True)
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._log_file = open(self.log_path, "ab")
        self._exit_code = None
        write_token_file(self.token_path, self.token)
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
                death = signal_death(code)
                if death is not None:
                    raise UserError(self.death_line(death), exit_code=1)
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
            self._exit_code = proc.poll()  # None: it was still running, the signal below is ours
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
        if self.log_path is not None:
            self.token_path.unlink(missing_ok=True)
        self.url = None
