"""Which trackers a run reports to, whether they are installed, and where each one keeps its data.

``logging.report_to`` names them as the HF Trainer does. Nothing here imports a tracker: "installed"
is ``importlib.util.find_spec``, so a run that asks for none never pays for one. Every place is
local unless the user configured otherwise:

- TensorBoard: ``RUN_DIR/tensorboard``.
- Trackio: ``RUN_DIR/trackio``, unless ``TRACKIO_DIR`` is set (or trackio was imported earlier in
  this process: it reads its directory once, at import); a ``TRACKIO_SPACE_ID`` or
  ``TRACKIO_SERVER_URL`` the user set sends it there.
- W&B: ``RUN_DIR/wandb``, offline unless ``WANDB_MODE`` is set or the user is logged in
  (``WANDB_API_KEY``, or a ``.netrc`` entry for the W&B host: only its ``machine`` names are read).
- MLflow: the file store ``RUN_DIR/mlruns`` unless ``MLFLOW_TRACKING_URI`` is set.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from homerlhf.config.loader import redacted_dump
from homerlhf.errors import UserError

TRACKERS = ("tensorboard", "trackio", "wandb", "mlflow")
# The module each tracker needs (find_spec) and what to pip install for it alone.
_MODULES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb", "mlflow": "mlflow"}
_PACKAGES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb", "mlflow": "mlflow-skinny"}
EXTRA = "pip install 'homerlhf[trackers]'"
# What the trackers keep in a run dir (with the default places): removed with the run by --overwrite.
TRACKER_DIRS = ("tensorboard", "trackio", "wandb", "mlruns", "tracking.json")


def installed(name: str) -> bool:
    return importlib.util.find_spec(_MODULES[name]) is not None


def report_to(logging_cfg) -> tuple[str, ...]:
    """The trackers a run reports to: ``report_to`` as given ('none': none); unset, TensorBoard when it
    is installed, unless the old ``tensorboard: false`` says no tracker."""
    if logging_cfg.report_to is not None:
        return tuple(dict.fromkeys(name for name in logging_cfg.report_to if name != "none"))
    if logging_cfg.tensorboard is False:
        return ()
    return ("tensorboard",) if installed("tensorboard") else ()


def check_installed(logging_cfg) -> tuple[str, ...]:
    """``report_to(logging_cfg)``, or a one-line UserError naming the first tracker asked for that is
    not installed and the pip command that installs it. Imports nothing."""
    names = report_to(logging_cfg)
    for name in names:
        if not installed(name):
            raise UserError(f"logging.report_to names {name}, which is not installed here; {EXTRA} "
                            f"(or pip install {_PACKAGES[name]}), or drop {name} from logging.report_to")
    return names


# -- where each tracker keeps its data ----------------------------------------------------------
def wandb_logged_in() -> bool:
    """An API key in the environment, or a ``.netrc`` machine entry for the W&B host. The key itself
    is never read: only the ``machine`` names of the netrc file."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        words = netrc.read_text().split()
    except OSError:
        return False
    return any(word == "machine" and following == host for word, following in zip(words, words[1:]))


def wandb_mode() -> Optional[str]:
    """The mode to pass to ``wandb.init``: None (wandb's own choice) when the user set ``WANDB_MODE`` or
    is logged in, else 'offline'."""
    return None if os.environ.get("WANDB_MODE") or wandb_logged_in() else "offline"


def trackio_dir(run_dir: Path) -> Path:
    """Where trackio's database is (or will be): the directory trackio bound at import, if it is
    imported already; ``TRACKIO_DIR``; else ``RUN_DIR/trackio``."""
    if "trackio.utils" in sys.modules:
        return Path(sys.modules["trackio.utils"].TRACKIO_DIR)
    return Path(os.environ.get("TRACKIO_DIR") or Path(run_dir).resolve() / "trackio")


def trackio_remote() -> Optional[str]:
    return os.environ.get("TRACKIO_SPACE_ID") or os.environ.get("TRACKIO_SERVER_URL") or None


def mlflow_uri(run_dir: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or (Path(run_dir).resolve() / "mlruns").as_uri()


@dataclass(frozen=True)
class Place:
    """Where one tracker keeps a run, and how to look at it."""

    name: str
    where: str
    view: str

    def line(self) -> str:
        return f"{self.name}: {self.where} (view: {self.view})"


def place(name: str, run_dir: Path, project: str) -> Place:
    run_dir = Path(run_dir)
    if name == "tensorboard":
        return Place(name, str(run_dir / "tensorboard"), f"tensorboard --logdir {run_dir / 'tensorboard'}")
    if name == "trackio":
        remote = trackio_remote()
        if remote:
            return Place(name, f"{remote} (TRACKIO_SPACE_ID / TRACKIO_SERVER_URL)", remote)
        where = trackio_dir(run_dir)
        return Place(name, str(where), f"TRACKIO_DIR={where} trackio show --project {project}")
    if name == "wandb":
        mode = wandb_mode() or os.environ.get("WANDB_MODE") or "online (logged in)"
        if mode == "offline":
            return Place(name, f"offline, {run_dir / 'wandb'}", f"wandb sync {run_dir / 'wandb'}/offline-run-*")
        return Place(name, f"{mode}, project {project}; local copy {run_dir / 'wandb'}", "the W&B web app")
    uri = mlflow_uri(run_dir)
    local = uri.startswith("file:")
    return Place(name, uri, f"mlflow server --backend-store-uri {uri}" + (" (full mlflow)" if local else ""))


def places(logging_cfg, run_dir: Path) -> list[Place]:
    return [place(name, run_dir, logging_cfg.project) for name in report_to(logging_cfg)]


def tracking_line(logging_cfg, run_dir: Path) -> str:
    """One line saying where the run is tracked: each tracker, where it keeps the run, how to look."""
    found = places(logging_cfg, run_dir)
    if not found:
        return "tracking: metrics.jsonl only (logging.report_to: none)"
    return "tracking: " + "; ".join(p.line() for p in found)


# -- the run's parameters ---------------------------------------------------------------------------
def run_params(cfg, run_name: str) -> dict[str, object]:
    """The run config flattened to dotted keys (``ppo.kl_coef``), every ``token`` redacted as in
    ``config.yaml``, plus the run name. Values are scalars or strings."""
    flat: dict[str, object] = {"run_name": run_name}

    def walk(prefix: str, node) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)  # a list: reward.components.0. ...
        for key, value in items:
            dotted = f"{prefix}{key}"
            if isinstance(value, dict) and value or isinstance(value, list) and any(isinstance(v, dict) for v in value):
                walk(dotted + ".", value)
            elif key == "token" and value:
                flat[dotted] = "<redacted>"
            else:
                flat[dotted] = value if isinstance(value, (bool, int, float, str)) or value is None else str(value)

    walk("", redacted_dump(cfg))
    return flat
