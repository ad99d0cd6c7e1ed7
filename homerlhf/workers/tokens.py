"""Bearer tokens of the workers: handed over by environment or a 0600 file, never on a command line.

A command line is visible to every user of the machine (``ps``, ``/proc/PID/cmdline``); a process's
environment and a 0600 file are visible to its owner only. The run's config holds a token only in
memory: ``config.yaml`` and checkpoints say ``<redacted>`` (:data:`homerlhf.config.REDACTED`), and
``--resume`` reads the token again from the environment or a file, or asks for it.

- worker side: ``HOMERLHF_WORKER_TOKEN`` or ``homerlhf worker --token-file PATH``;
- trainer side, per role: ``HOMERLHF_REF_TOKEN`` / ``HOMERLHF_REWARD_TOKEN``, ``<role>.token_file``,
  or ``<role>.token`` in a config of your own.

The trainer's own local workers get a fresh random token each, in a 0600 file beside their log
(:class:`homerlhf.workers.process.WorkerProcess`), where the app's monitor finds it too.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable, Optional

from homerlhf.config import REDACTED
from homerlhf.errors import UserError

WORKER_TOKEN_ENV = "HOMERLHF_WORKER_TOKEN"


def role_token_env(role: str) -> str:
    """The environment variable a trainer reads the ``role`` worker's token from."""
    return f"HOMERLHF_{role.upper()}_TOKEN"


def read_token_file(path: str | Path) -> str:
    """The token in ``path``, refused in one line unless only its owner can read it."""
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as exc:
        raise UserError(f"cannot read token file {path}: {exc.strerror}; give a file holding the token") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UserError(f"token file {path} is readable by others (mode {stat.S_IMODE(mode):04o}); "
                        f"run `chmod 600 {path}`")
    if not text:
        raise UserError(f"token file {path} is empty; write the token into it")
    return text


def write_token_file(path: Path, token: str) -> None:
    """``token`` into ``path``, readable by its owner only from the first byte on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token)


def worker_token(token_file: Optional[str | Path]) -> Optional[str]:
    """The token a worker requires: from ``--token-file``, else ``HOMERLHF_WORKER_TOKEN``, else none."""
    if token_file is not None:
        return read_token_file(token_file)
    return os.environ.get(WORKER_TOKEN_ENV) or None


def client_token(role: str, token: Optional[str], token_file: Optional[str]) -> Optional[str]:
    """The token a trainer sends to the ``role`` worker: environment, then ``token_file``, then
    ``token``. A ``token`` redacted from a saved config, with neither of the others, is an error."""
    from_env = os.environ.get(role_token_env(role))
    if from_env:
        return from_env
    if token_file:
        return read_token_file(token_file)
    if token == REDACTED:
        raise UserError(f"{role}.token is not saved with a run; set {role_token_env(role)}, "
                        f"set {role}.token_file to a 0600 file, or pass --set {role}.token=...")
    return token


def restore_redacted_tokens(cfg, ask: Optional[Callable[[str], str]] = None):
    """``cfg`` with each ``<redacted>`` token the environment or ``token_file`` does not cover asked
    for (``ask(prompt)``, e.g. getpass on a terminal); left redacted when there is no ``ask``."""
    updates = {}
    for role in ("ref", "reward"):
        rc = getattr(cfg, role)
        if rc.token != REDACTED or os.environ.get(role_token_env(role)) or rc.token_file or ask is None:
            continue
        updates[role] = rc.model_copy(update={"token": ask(f"bearer token of the {role} worker at {rc.url}: ")})
    return cfg.model_copy(update=updates) if updates else cfg
