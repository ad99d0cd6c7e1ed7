"""``homerlhf sft`` and ``homerlhf reward`` with ``logging.report_to`` naming all four trackers, through
the real CLI and TRL's trainers: each tracker holds the stage's training loss, the number the stage's
summary reports, read back from the tracker's own files under OUT (offline, no login)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tracker_readback import mlflow_values, tensorboard_values, trackio_values

STEPS = 3  # logging_steps is min(10, max_steps): the loss is logged at step 3
ROWS = [{"prompt": "Tell me about tea.", "completion": "Happy to help! Tea is made from leaves."},
        {"prompt": "Share a fact about cats.", "completion": "Gladly! Cats sleep for most of the day."}] * 4
PAIRS = [{"prompt": "Tell me about tea.", "chosen": "Happy to help! Tea is made from leaves.",
          "rejected": "Ugh, figure it out yourself."},
         {"prompt": "Tell me about maps.", "chosen": "Of course. A map shows places from above.",
          "rejected": "That is a stupid question."}] * 4


def _stage(command: str, data: list[dict], tmp_path: Path, base: Path, section: str) -> tuple[Path, dict]:
    data_file = tmp_path / f"{command}.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in data))
    out = tmp_path / command
    sets = [f"{section}.method=full", f"{section}.max_steps={STEPS}", f"{section}.batch_size=4",
            "logging.progress=false", "logging.report_to=[tensorboard,trackio,wandb,mlflow]", "rm.export_gguf=false"]
    argv = [sys.executable, "-m", "homerlhf.cli", command, "--data", str(data_file), "--out", str(out),
            "--model", str(base)] + [x for s in sets for x in ("--set", s)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"wandb: offline, {out}/wandb" in proc.stdout
    return out, json.loads((out / f"{'sft' if command == 'sft' else 'reward'}_run.json").read_text())


def _losses(out: Path) -> dict[str, list[tuple[int, float]]]:
    """tracker -> [(global step, loss)] of the stage's one run. W&B and Trackio count steps of their
    own (one per log call) and carry the trainer's step as ``train/global_step``."""
    from mlflow import MlflowClient

    from homerlhf.tracking.wandb_log import run_history

    (wandb_dir,) = out.glob("wandb/offline-run-*")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("homerlhf").experiment_id])
    trackio = trackio_values(out / "trackio")
    return {
        "tensorboard": [(step, v) for step, values in tensorboard_values(out / "tensorboard")["train/loss"].items()
                        for v in values],
        "trackio": [(int(trackio["train/global_step"][step][0]), v)
                    for step, values in trackio["train/loss"].items() for v in values],
        "wandb": [(row["train/global_step"], row["train/loss"])
                  for _, row in run_history(out / "wandb", wandb_dir.name.rsplit("-", 1)[1]) if "train/loss" in row],
        "mlflow": [(step, v) for step, values in mlflow_values((out / "mlruns").as_uri(), run.info.run_id)["loss"].items()
                   for v in values],
    }


@pytest.mark.parametrize("command", ["sft", "reward"])
def test_a_trl_stage_writes_its_loss_to_every_tracker(command, tiny_llama_dir, tmp_path, offline_trackers):
    data, section = (ROWS, "sft") if command == "sft" else (PAIRS, "rm")
    out, summary = _stage(command, data, tmp_path, tiny_llama_dir, section)
    assert summary["steps"] == STEPS
    for tracker, logged in _losses(out).items():
        # TensorBoard keeps TRL's scalars in float32
        expected = float(np.float32(summary["train_loss"])) if tracker == "tensorboard" else summary["train_loss"]
        assert logged == [(STEPS, expected)], tracker
    assert not any(p.name == "trainer" for p in out.iterdir())  # TRL's own output dir is gone, the trackers' stay
