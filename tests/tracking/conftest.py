"""The trackers' environment for the tests here: no login, nothing of the user's."""

from __future__ import annotations

import pytest


@pytest.fixture
def offline_trackers(monkeypatch, tmp_path):
    """No login, no tracker settings of the user's: the defaults (offline, under the run dir)."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_BASE_URL", "MLFLOW_TRACKING_URI",
                 "TRACKIO_DIR", "TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "WANDB_PROJECT", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    monkeypatch.setenv("WANDB_SILENT", "true")
