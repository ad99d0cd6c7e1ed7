"""Training runs as detached processes: start, stop gracefully, attach, list.

A run started from the app is ``homerlhf train ...`` in its own session (``start_new_session``), so
closing the browser or the app never stops it. A small launcher (``python -m homerlhf.app.launcher``)
sits between the app and the trainer: it records the trainer's exit code, because once the app is
restarted it is no longer the trainer's parent and could not learn it otherwise.

Files the app keeps next to a run (all under ``RUN_DIR/app/``):
  ``launch.json``  pid, argv, start time of the launcher
  ``exit.json``    the trainer's return code and end time
  ``train.log``    the trainer's stdout and stderr
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

from homerlhf.errors import UserError

APP_DIR = "app"
LAUNCH_FILE = "launch.json"
EXIT_FILE = "exit.json"
LOG_FILE = "train.log"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
CHECKPOINTS_DIR = "checkpoints"


def train_argv(
    preset: str,
    out: str | Path,
    config_file: Optional[str | Path] = None,
    overrides: Iterable[str] = (),
    overwrite: bool = False,
) -> list[str]:
    """The ``homerlhf train`` arguments (without the program name) for these settings."""
    argv = ["train", "--preset", preset]
    if config_file:
        argv += ["--config", str(config_file)]
    for item in overrides:
        argv += ["--set", item]
    argv += ["--out", str(out)]
    if overwrite:
        argv.append("--overwrite")
    return argv


def format_command(argv: Sequence[str], multiline: bool = False) -> str:
    """What a user would type: ``homerlhf train --preset cpu-tiny ...``, shell-quoted; with
    ``multiline`` one option per line (backslash continuations) for reading."""
    text = shlex.join(["homerlhf", *argv])
    if not multiline:
        return text
    words = [shlex.quote(w) for w in ["homerlhf", *argv]]
    lines: list[str] = []
    for word in words:
        if word.startswith("--") or not lines:
            lines.append(word)
        else:
            lines[-1] += " " + word
    return " \\\n    ".join(lines)


@dataclass
class RunStatus:
    """What the app knows about a run directory."""

    run_dir: Path
    state: str  # "running", "finished", "stopped", "crashed", "not started", "unknown"
    pid: Optional[int] = None
    returncode: Optional[int] = None
    started_at: Optional[float] = None
    ended_at: Optional[float] = None
    argv: list[str] = field(default_factory=list)
    log_tail: str = ""
    forced: bool = False  # stopped by Force stop (killed: no checkpoint written at the stop)

    @property
    def running(self) -> bool:
        return self.state == "running"

    def message(self) -> str:
        """One line for the UI."""
        if self.state == "running":
            return f"running (pid {self.pid})"
        if self.state == "crashed":
            last = last_error_line(self.log_tail)
            return f"crashed (exit code {self.returncode})" + (f": {last}" if last else "")
        if self.state == "stopped":
            return "stopped by you" + (" with Force stop (no checkpoint at the stop)" if self.forced else "") \
                + "; " + resume_words(self.run_dir)
        if self.state == "finished":
            return "finished"
        if self.state == "unknown":
            return "started outside the app (no exit code known)"
        return "not started"


def resume_words(run_dir: Path) -> str:
    """Where a stopped run's last checkpoint is and what to do with it, or that there is none."""
    found = list_checkpoints(run_dir)
    if not found:
        return "it wrote no checkpoint, so there is nothing to resume: Start a new run"
    return f"its last checkpoint is {found[0]}: Resume continues from it"


def _read_json(path: Path) -> Optional[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def tail(path: Path, n_bytes: int = 4000) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - n_bytes))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def last_error_line(log: str) -> str:
    """The line that says what went wrong: ``error: ...`` from the CLI, else the last exception line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("error:"):
            return line
    for line in reversed(lines):
        if "Error" in line.split(":", 1)[0] or line.startswith("Traceback"):
            return line
    return lines[-1] if lines else ""


def _alive(pid: int, started_at: Optional[float]) -> bool:
    """Is ``pid`` still our launcher (and not a recycled pid)?"""
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        # create_time and time.time() agree to well under a few seconds for the same process.
        return started_at is None or abs(proc.create_time() - started_at) < 5.0
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def run_status(run_dir: str | Path) -> RunStatus:
    run_dir = Path(run_dir)
    app_dir = run_dir / APP_DIR
    launch = _read_json(app_dir / LAUNCH_FILE)
    log_tail = tail(app_dir / LOG_FILE)
    if launch is None:
        state = "unknown" if (run_dir / METRICS_FILE).exists() else "not started"
        return RunStatus(run_dir, state, log_tail=log_tail)
    status = RunStatus(
        run_dir,
        "running",
        pid=launch.get("pid"),
        started_at=launch.get("started_at"),
        argv=list(launch.get("argv", [])),
        log_tail=log_tail,
        forced=bool(launch.get("force")),
    )
    ended = _read_json(app_dir / EXIT_FILE)
    if ended is not None:
        status.returncode = ended.get("returncode")
        status.ended_at = ended.get("ended_at")
        if launch.get("stop_requested"):
            status.state = "stopped"  # the user asked; exit 0 (checkpointed) or 130 (interrupted)
        elif status.returncode == 0:
            status.state = "finished"
        else:
            status.state = "crashed"
    elif status.pid is None or not _alive(status.pid, launch.get("launcher_started_at")):
        # The launcher died without writing the exit code: killed by Force stop (asked), else crashed.
        status.state = "stopped" if launch.get("stop_requested") else "crashed"
    return status


def homerlhf_program() -> list[str]:
    """The ``homerlhf`` command as this interpreter runs it (works without the script on PATH)."""
    return [sys.executable, "-m", "homerlhf.cli"]


def start_run(
    run_dir: str | Path,
    argv: Sequence[str],
    env: Optional[dict] = None,
    program: Optional[Sequence[str]] = None,
) -> RunStatus:
    """Start ``homerlhf <argv>`` detached, logging to ``RUN_DIR/app/train.log``.

    ``argv`` is what follows the program name, e.g. from ``train_argv``; ``program`` replaces
    ``homerlhf`` (default ``homerlhf_program()``). Raises ``UserError`` if a run the app started is
    still running in ``run_dir``.
    """
    run_dir = Path(run_dir)
    current = run_status(run_dir)
    if current.running:
        raise UserError(f"a run is already going in {run_dir} (pid {current.pid}); stop it first or pick another dir")
    app_dir = run_dir / APP_DIR
    app_dir.mkdir(parents=True, exist_ok=True)
    (app_dir / EXIT_FILE).unlink(missing_ok=True)
    command = [*(program or homerlhf_program()), *argv]
    launcher = [sys.executable, "-m", "homerlhf.app.launcher", str(app_dir), "--", *command]
    with open(app_dir / LOG_FILE, "ab") as log:
        shown = format_command(argv) if program is None else shlex.join(command)
        log.write(f"\n$ {shown}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            launcher,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: browser/app closing never stops training
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
            cwd=os.getcwd(),
        )
    import psutil

    launch = {
        "pid": proc.pid,
        "argv": list(argv),
        "started_at": time.time(),
        "launcher_started_at": psutil.Process(proc.pid).create_time(),
    }
    _write_json_atomic(app_dir / LAUNCH_FILE, launch)
    _CHILDREN[str(run_dir.resolve())] = proc
    # The launcher is our child until it exits: wait for it in a thread, so it is reaped the moment
    # it ends instead of staying <defunct> until the app exits (nothing else may be polling it).
    threading.Thread(target=_reap, args=(str(run_dir.resolve()), proc), daemon=True,
                     name=f"reap-launcher-{proc.pid}").start()
    return run_status(run_dir)


_CHILDREN: dict[str, subprocess.Popen] = {}


def _reap(key: str, proc: subprocess.Popen) -> None:
    proc.wait()
    if _CHILDREN.get(key) is proc:
        del _CHILDREN[key]


def stop_run(run_dir: str | Path, force: bool = False) -> str:
    """Ask the run to stop: SIGINT to its process group (the trainer checkpoints, then exits).

    ``force`` sends SIGKILL instead, for a run that does not react. Returns a line for the UI.
    """
    run_dir = Path(run_dir)
    status = run_status(run_dir)
    if not status.running or status.pid is None:
        return f"nothing to stop: the run is {status.message()}"
    launch_path = run_dir / APP_DIR / LAUNCH_FILE
    launch = _read_json(launch_path) or {}
    again = "stop_requested" in launch
    launch["stop_requested"] = time.time()
    if force:
        launch["force"] = True
    _write_json_atomic(launch_path, launch)
    sig = signal.SIGKILL if force else signal.SIGINT
    try:
        os.killpg(status.pid, sig)  # the launcher leads its own group (start_new_session)
    except ProcessLookupError:
        return "the run had already ended"
    if force:
        return "Force stop: the run was killed at once, without a checkpoint at the stop"
    if again:
        return "asked again: the run aborts at once (resume from its last checkpoint)"
    return "asked the run to stop; it saves a checkpoint first (Stop again aborts at once)"


def wait_for(run_dir: str | Path, timeout: float) -> RunStatus:
    """Block until the run is no longer running or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        status = run_status(run_dir)
        if not status.running or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any(
        (path / name).exists() for name in (METRICS_FILE, APP_DIR, CHECKPOINTS_DIR, "config.yaml")
    )


def list_runs(root: str | Path) -> list[Path]:
    """Run directories directly under ``root`` (and ``root`` itself if it is one), newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if is_run_dir(p)]
    if is_run_dir(root):
        found.append(root)
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """``RUN_DIR/checkpoints/iter_XXXXXX`` folders, newest (highest iteration) first."""
    ckpt_root = Path(run_dir) / CHECKPOINTS_DIR
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith("iter_")]
    return sorted(found, key=lambda p: p.name, reverse=True)


def checkpoint_states(run_dir: str | Path, files: Sequence[str] = ()) -> list[tuple[Path, str]]:
    """The run's checkpoints newest first, each with why ``files`` (prefixes; () all) differ from its manifest, or ''."""
    from homerlhf.ppo.manifest import checkpoint_problem

    return [(p, checkpoint_problem(p, files) or "") for p in list_checkpoints(run_dir)]


def checkpoint_label(label: str, problem: str) -> str:
    """A checkpoint's entry in a list: as it is, or marked with why it cannot be used."""
    return f"{label} (not usable: {problem})" if problem else label


def checkpoint_entries(run_dir: str | Path, files: Sequence[str] = ()) -> list[tuple[str, Path]]:
    """(label, dir) of the run's checkpoints newest first, as every tab names them (``iter_000003``, marked)."""
    return [(checkpoint_label(p.name, why), p) for p, why in checkpoint_states(run_dir, files)] if run_dir else []


CONFIG_NAMES = ("config.yaml", "run_config.yaml", "resolved_config.yaml", "run.yaml")


def run_config(run_dir: str | Path):
    """The run's resolved ``RunConfig`` as the trainer wrote it, or None if there is none (yet)."""
    from homerlhf.config import from_yaml_file

    run_dir = Path(run_dir)
    candidates = [run_dir / name for name in CONFIG_NAMES]
    candidates += sorted(p for p in run_dir.glob("*.yaml") if p not in candidates)
    for path in candidates:
        if path.is_file():
            try:
                return from_yaml_file(path)
            except UserError:
                continue
    return None


# The line a llama.cpp worker prints when it listens (homerlhf.workers.server.READY_PREFIX).
_READY = re.compile(r"homerlhf worker ready .*?url=(\S+)")


def worker_urls(run_dir: str | Path) -> dict[str, str]:
    """Role -> URL of the run's ref/reward backends: ``''`` for in-process ones (adapter_off, hf),
    the configured ``url`` of a remote worker, else the last address its local worker announced
    in ``RUN_DIR/workers/<role>.log`` (a restarted worker announces again)."""
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    urls: dict[str, str] = {}
    for role in ("ref", "reward"):
        backend = getattr(cfg, role, None) if cfg is not None else None
        if backend is not None and backend.backend != "llamacpp":
            urls[role] = ""
            continue
        if backend is not None and backend.url:
            urls[role] = backend.url
            continue
        found = _READY.findall(tail(run_dir / "workers" / f"{role}.log", 20000))
        if found:
            urls[role] = found[-1]
        elif backend is not None:
            urls[role] = "(starting)"
    return urls
