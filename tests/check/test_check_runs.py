"""homerlhf/check/runs.py, what `homerlhf check` and the GPU scripts share: a card's memory cap on a GPU
that reports a little less than the card's nominal size, and where random checkpoints go (a disk:
``$HOMERLHF_GPU_MODELS``, the session's gitignored ``.gpu-models``, else the homerlhf cache)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


@pytest.fixture
def gpu_runs():
    from homerlhf.check import runs

    return runs


def test_a_cap_at_the_cards_nominal_size_is_the_whole_card(gpu_runs, monkeypatch):
    """An RTX 4090 reports 23.99 GiB (24,564 MiB): the 4090 preset's 24 GiB cap is its whole memory,
    not an error before every 4090 case; a cap well over the GPU is one."""
    fractions = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=24_564 * 2**20))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: fractions.append(f))
    assert gpu_runs.cap_memory(24.0) == pytest.approx(23.99, abs=0.005)
    assert gpu_runs.cap_memory(15.0) == pytest.approx(23.99, abs=0.005)
    gpu_runs.cap_memory(None)
    assert fractions == [1.0, pytest.approx(15.0 / (24_564 / 1024)), 1.0]
    with pytest.raises(ValueError, match="a cap of 80 GiB must be in"):
        gpu_runs.cap_memory(80.0)
    with pytest.raises(ValueError, match="a cap of 0 GiB"):
        gpu_runs.cap_memory(0.0)
    assert len(fractions) == 3  # a refused cap sets nothing


def test_gpu_checkpoints_go_to_a_gitignored_folder_of_the_checkout(gpu_runs, monkeypatch, tmp_path):
    import subprocess

    from homerlhf.memory.shapes import builtin_shape

    shape = builtin_shape("Qwen/Qwen2.5-7B")
    monkeypatch.setenv("HOMERLHF_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HOMERLHF_GPU_MODELS", raising=False)  # a user's `homerlhf check`: the homerlhf cache
    assert gpu_runs.checkpoint_dir(shape, tmp_path / "x") == tmp_path / "cache" / "check-models" / "Qwen--Qwen2.5-7B-seed0"
    session = (ROOT / "scripts" / "gpu_session.sh").read_text()  # our GPU session's: .gpu-models of the checkout
    assert 'export HOMERLHF_GPU_MODELS="${HOMERLHF_GPU_MODELS:-$PWD/.gpu-models}"' in session
    monkeypatch.setenv("HOMERLHF_GPU_MODELS", str(ROOT / ".gpu-models"))
    where = gpu_runs.checkpoint_dir(shape, tmp_path / "x")
    assert where == ROOT / ".gpu-models" / "Qwen--Qwen2.5-7B-seed0"
    ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", str(where / "scratch")], cwd=ROOT)
    assert ignored.returncode == 0  # never committed, never sent to the device machine
    monkeypatch.setenv("HOMERLHF_GPU_MODELS", str(tmp_path / "models"))
    assert gpu_runs.checkpoint_dir(shape, tmp_path / "x").parent == tmp_path / "models"
    assert gpu_runs.checkpoint_dir(shape, tmp_path / "x", device="cpu") == tmp_path / "x"  # the CPU smoke's tiny ones
