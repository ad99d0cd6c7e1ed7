"""Which trackers a run reports to, the one-line refusal of one that is not installed (before any
weight loads), offline unless the user logged in or said otherwise, the places under the run dir,
and the run config as parameters with its tokens redacted."""

from __future__ import annotations

import pytest

from homerlhf.config import load_config
from homerlhf.errors import UserError
from homerlhf.tracking import settings


def _logging(*sets: str):
    return load_config("4090", overrides=list(sets)).logging


def test_report_to_as_given_none_and_the_old_tensorboard_switch(monkeypatch):
    assert settings.report_to(_logging("logging.report_to=wandb,mlflow,wandb")) == ("wandb", "mlflow")
    assert settings.report_to(_logging("logging.report_to=none")) == ()
    assert settings.report_to(_logging("logging.tensorboard=false")) == ()  # an old config: no TensorBoard
    # report_to, once set, decides alone (the cpu-tiny preset says tensorboard: false)
    assert settings.report_to(load_config("cpu-tiny", overrides=["logging.report_to=[tensorboard]"]).logging) == (
        "tensorboard",)
    assert settings.report_to(_logging()) == ("tensorboard",)  # the default: TensorBoard, installed here
    monkeypatch.setitem(settings._MODULES, "tensorboard", "homerlhf_no_such_module")
    assert settings.report_to(_logging()) == ()  # ... and nothing where it is not
    assert settings.report_to(_logging("logging.tensorboard=true")) == ()


def test_a_tracker_not_installed_is_one_line_with_the_pip_command(monkeypatch):
    monkeypatch.setitem(settings._MODULES, "wandb", "homerlhf_no_such_module")
    with pytest.raises(UserError) as err:
        settings.check_installed(_logging("logging.report_to=[tensorboard,wandb]"))
    assert str(err.value) == ("logging.report_to names wandb, which is not installed here; pip install "
                              "'homerlhf[trackers]' (or pip install wandb), or drop wandb from logging.report_to")
    assert settings.check_installed(_logging("logging.report_to=[tensorboard,mlflow]")) == ("tensorboard", "mlflow")


def test_run_ppo_refuses_a_missing_tracker_before_loading_anything(monkeypatch, tmp_path):
    from homerlhf.stages.ppo import run_ppo

    monkeypatch.setitem(settings._MODULES, "mlflow", "homerlhf_no_such_module")
    cfg = load_config("cpu-tiny", overrides=["logging.report_to=mlflow", "model.name_or_path=/nonexistent/model"])
    with pytest.raises(UserError, match=r"names mlflow, which is not installed here; pip install 'homerlhf\[trackers\]'"):
        run_ppo(cfg, out_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_wandb_is_offline_unless_logged_in_or_told(monkeypatch, tmp_path):
    netrc = tmp_path / "netrc"
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(netrc))
    assert settings.wandb_mode() == "offline"  # no netrc file at all
    netrc.write_text("machine api.example.org\n  login user\n  password api.wandb.ai\n")
    assert settings.wandb_mode() == "offline"  # the W&B host only as a password is no login
    netrc.write_text("machine api.example.org login user password x\nmachine api.wandb.ai\n  login user\n  password k\n")
    assert settings.wandb_logged_in() and settings.wandb_mode() is None  # wandb's own choice: online
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.mycompany.internal")
    assert settings.wandb_mode() == "offline"  # logged in to another host than the one in use
    monkeypatch.setenv("WANDB_API_KEY", "k")
    assert settings.wandb_mode() is None
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert settings.wandb_mode() is None  # the user's WANDB_MODE stands


def test_the_tracking_line_names_each_place_under_the_run_dir(monkeypatch, tmp_path):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "MLFLOW_TRACKING_URI", "TRACKIO_DIR", "TRACKIO_SPACE_ID",
                 "TRACKIO_SERVER_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.delitem(__import__("sys").modules, "trackio.utils", raising=False)
    run = tmp_path / "run"
    line = settings.tracking_line(_logging("logging.report_to=tensorboard,trackio,wandb,mlflow"), run)
    assert line == (
        f"tracking: tensorboard: {run}/tensorboard (view: tensorboard --logdir {run}/tensorboard); "
        f"trackio: {run}/trackio (view: TRACKIO_DIR={run}/trackio trackio show --project homerlhf); "
        f"wandb: offline, {run}/wandb (view: wandb sync {run}/wandb/offline-run-*); "
        f"mlflow: file://{run}/mlruns (view: mlflow server --backend-store-uri file://{run}/mlruns (full mlflow))")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "shared"))
    assert settings.place("mlflow", run, "p").where == "http://127.0.0.1:5000"
    assert settings.place("trackio", run, "p").where == str(tmp_path / "shared")
    assert settings.tracking_line(_logging("logging.report_to=none"), run) == (
        "tracking: metrics.jsonl only (logging.report_to: none)")


def test_run_params_are_flat_with_every_token_redacted():
    cfg = load_config("cpu-tiny", overrides=[
        "ref.url=http://127.0.0.1:8001", "ref.token=secret-ref-token",
        "reward.components=[{backend: function, function: 'builtin:reverse', weight: 1.0, token: secret-c}]"])
    params = settings.run_params(cfg, "my-run")
    assert params["run_name"] == "my-run" and params["ppo.kl_coef"] == cfg.ppo.kl_coef
    assert params["ref.token"] == "<redacted>" and params["reward.components.0.token"] == "<redacted>"
    assert not any("secret" in str(value) for value in params.values())
    assert all(isinstance(v, (bool, int, float, str)) or v is None for v in params.values())
