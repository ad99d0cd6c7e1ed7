"""llama.cpp's own log in a process that runs it (the trainer's rollout engine, a worker): its warnings in
the run dir's log file, its errors on stderr too, everything on stderr with --verbose. llama.cpp runs in a
child process: its log callback is process-wide, and a build that dies (SIGILL) fails one test."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = r"""
import sys
from pathlib import Path
from homerlhf.workers import llama_log
from homerlhf.workers.engine import Engine

gguf, log, mode = sys.argv[1:4]
llama_log.set_verbose(mode == "verbose")
llama_log.log_to(Path(log) if mode != "terminal" else None)
# A context of 2048 tokens on a model trained on 512 positions: llama.cpp warns `n_ctx_seq > n_ctx_train`.
engine = Engine("ref", Path(gguf), ctx=2048)
import llama_cpp

bad = Path(log).parent / "not-an-adapter.gguf"
bad.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(16))  # a GGUF of no keys: llama.cpp logs an error loading it as a LoRA
llama_cpp.llama_adapter_lora_init(engine._model.model, str(bad).encode())
print("refused")
"""


def _run(gguf, tmp_path, mode: str):
    log = tmp_path / mode / "llama.log"
    log.parent.mkdir()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(gguf), str(log), mode], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused" in proc.stdout
    return proc.stderr, log.read_text() if log.exists() else ""


@pytest.mark.parametrize("mode", ["file", "verbose", "terminal"])
def test_warnings_go_to_the_run_log_and_errors_reach_the_terminal(llama_f32_gguf, tmp_path, mode):
    err, logged = _run(llama_f32_gguf, tmp_path, mode)
    warning, error = "n_ctx_seq (2048) > n_ctx_train (512)", "failed to apply lora adapter"
    if mode == "file":
        assert warning in logged and error in logged
        assert warning not in err and error in err  # the error is on the terminal as well
        assert [line for line in err.splitlines() if "llama_" in line and error not in line] == []  # nothing else
    else:  # --verbose, or no run dir named: the terminal, and no file
        assert warning in err and error in err and logged == ""
