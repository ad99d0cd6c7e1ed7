"""What the Train tab shows of a run besides its plots: the default run directory names, the iteration
count it was started for, its status and tracking lines and the table of its llama.cpp workers."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Optional

from homerlhf.app import monitor, runs
from homerlhf.app.common import md_text
from homerlhf.errors import UserError

_DEFAULT_NAME = re.compile(r"^app-\d{8}-\d{6}(-\d+)?$")


def default_run_dir(root: str = "runs") -> str:
    """A fresh ``ROOT/app-<now>`` (``-2``, ``-3`` ... when two Starts fall in the same second)."""
    base = Path(root) / time.strftime("app-%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return str(path)


def is_default_run_dir(run_dir: str, root: str) -> bool:
    """A name :func:`default_run_dir` made (not one the user typed): a Start replaces it by a fresh one
    once it holds a run."""
    path = Path(run_dir)
    return path.parent == Path(root) and bool(_DEFAULT_NAME.match(path.name))


def holds_run(path: Path) -> bool:
    return any((path / name).exists() for name in ("config.yaml", runs.METRICS_FILE, runs.CHECKPOINTS_DIR))


def total_iterations(run_dir: Path, argv: list[str]) -> Optional[int]:
    """``ppo.iterations`` of the run: from its resolved config, else from the command's overrides."""
    cfg = runs.run_config(run_dir)
    if cfg is not None:
        return cfg.ppo.iterations
    try:
        from homerlhf.config import load_config

        preset = argv[argv.index("--preset") + 1] if "--preset" in argv else "cpu-tiny"
        sets = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--set"]
        return load_config(preset, None, sets).ppo.iterations
    except (UserError, ValueError, IndexError):
        return None


def worker_table(run_dir: Path, status: runs.RunStatus) -> list[list]:
    cfg = runs.run_config(run_dir)
    rows = []
    for role, url in runs.worker_urls(run_dir).items():
        backend = getattr(cfg, role).backend if cfg is not None and role in ("ref", "reward") else "?"
        if not url:
            rows.append([role, backend, "(in the trainer process)", "-", None])
        elif not status.running:
            rows.append([role, backend, url, "run not running", None])
        elif url.startswith("("):  # no address announced yet: the worker is still loading
            rows.append([role, backend, "-", "starting", None])
        else:
            up, latency, detail = monitor.check_worker(url, token=_worker_token(cfg, run_dir, role))
            rows.append([role, backend, url, "up" if up else f"down ({detail})",
                         None if latency is None else round(latency, 1)])
    return rows


def _worker_token(cfg, run_dir, role: str) -> Optional[str]:
    """The run's own worker's token (a 0600 file beside its log), else the configured one, if any."""
    from homerlhf.workers.tokens import client_token, read_token_file

    try:
        own = Path(run_dir) / "workers" / f"{role}.log.token"
        if own.exists():
            return read_token_file(own)
        rc = getattr(cfg, role, None) if cfg is not None else None
        return client_token(role, rc.token, rc.token_file) if rc is not None else None
    except UserError:  # unreadable, or redacted with nothing to restore it: the check shows the 401
        return None


def status_markdown(status: runs.RunStatus) -> str:
    text = f"**Run:** `{status.run_dir}` — {md_text(status.message())}"
    tracking = tracking_markdown(Path(status.run_dir))
    if tracking:
        text += f"\n\n{tracking}"
    if status.state == "crashed":
        text += "\n\nThe log below shows why. Fix the setting it names and start again."
    return text


def tracking_markdown(run_dir: Path) -> str:
    """Where the run is tracked (``logging.report_to``): each tracker, its local dir or URL, how to look."""
    from homerlhf.tracking.session import run_tracking_line

    cfg = runs.run_config(run_dir)
    line = run_tracking_line(run_dir, cfg.logging if cfg is not None else None)
    return f"**Tracking:** {line.removeprefix('tracking: ')}" if line else ""
