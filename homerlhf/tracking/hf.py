"""The SFT and reward stages' trackers: TRL's trainers (the HF Trainer's integrations) report to
``logging.report_to``, in the same places a PPO run's trackers use, under the stage's OUT dir.

The integrations take their places from environment variables, so :func:`hf_trackers` sets them for
the stage only: ``TENSORBOARD_LOGGING_DIR``, ``WANDB_DIR`` / ``WANDB_MODE`` / ``WANDB_PROJECT``,
``MLFLOW_TRACKING_URI`` / ``MLFLOW_EXPERIMENT_NAME``, ``TRACKIO_DIR`` (a tracking URI, a Trackio
directory or a W&B mode the user set stands). Trackio goes through a callback of ours rather than
``report_to``: the integration's ``trackio.init`` starts a dashboard server inside a notebook (a
public share link on Colab).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Iterator

from homerlhf.tracking import settings
from homerlhf.tracking.backends import scoped_env


def run_name(cfg, out: Path) -> str:
    return cfg.logging.run_name or f"{Path(out).resolve().name}-{time.strftime('%Y%m%d-%H%M%S')}"


def trainer_args(cfg, out: Path) -> dict[str, Any]:
    """``report_to``, ``run_name`` and ``project`` for TRL's ``SFTConfig`` / ``RewardConfig``."""
    names = [name for name in settings.report_to(cfg.logging) if name != "trackio"]
    return {"report_to": names or "none", "run_name": run_name(cfg, out), "project": cfg.logging.project}


def _environment(cfg, out: Path, names: tuple[str, ...]) -> dict[str, str | None]:
    env: dict[str, str | None] = {}
    if "tensorboard" in names:
        env["TENSORBOARD_LOGGING_DIR"] = str(out / "tensorboard")
    if "wandb" in names:
        env.update(WANDB_DIR=str(out), WANDB_MODE=settings.wandb_mode(), WANDB_PROJECT=cfg.logging.project,
                   WANDB__DISABLE_META="true")  # no command line (a --set token) in the run's files
    if "mlflow" in names:
        uri = settings.mlflow_uri(out)
        env.update(MLFLOW_TRACKING_URI=uri, MLFLOW_ALLOW_FILE_STORE="true" if uri.startswith("file:") else None,
                   MLFLOW_EXPERIMENT_NAME=cfg.logging.project)
    if "trackio" in names:
        env["TRACKIO_DIR"] = str(settings.trackio_dir(out))
    return env


class _TrackioWithoutDashboard:
    """The trackio module, with ``init`` always local-only: no dashboard, no system-metrics threads."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name: str):
        return getattr(self._module, name)

    def init(self, *args, **kwargs):
        return self._module.init(*args, **{**kwargs, "embed": False, "auto_log_cpu": False, "auto_log_gpu": False})


def _trackio_callback():
    from transformers.integrations import TrackioCallback

    callback = TrackioCallback()
    callback._trackio = _TrackioWithoutDashboard(callback._trackio)
    return callback


@contextlib.contextmanager
def hf_trackers(cfg, out: Path) -> Iterator[list]:
    """The stage's tracker environment for the block (building and training the trainer); yields
    the callbacks to add to the trainer. On the way out every run is finished (W&B: also its
    service process), so a later stage in the same process starts runs of its own."""
    out = Path(out)
    names = settings.report_to(cfg.logging)
    with scoped_env(**_environment(cfg, out, names)):
        if "mlflow" in names:  # a URI set earlier in this process would win over the environment
            import mlflow

            mlflow.set_tracking_uri(settings.mlflow_uri(out))
        try:
            yield [_trackio_callback()] if "trackio" in names else []
        finally:
            if "wandb" in names:
                import wandb

                if wandb.run is not None:
                    wandb.finish()
                wandb.teardown()
