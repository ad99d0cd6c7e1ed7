"""The GPU validation script: usable help everywhere, one clear line where there is no CUDA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "validate_memory_gpu.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_help():
    out = run("--help")
    assert out.returncode == 0, out.stderr
    assert "--cap-gib" in out.stdout and "--models" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_one_line_and_nonzero(tmp_path, capsys, monkeypatch):
    import runpy

    module = runpy.run_path(str(SCRIPT))  # defines main without running it (__name__ is not __main__)
    with pytest.raises(SystemExit) as info:
        module["main"](["--cap-gib", "24", "--out", str(tmp_path / "x.json")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "needs a CUDA GPU" in err and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()
