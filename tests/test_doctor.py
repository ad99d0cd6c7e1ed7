"""`homerlhf doctor`: the all-good path through the real CLI, and misses reported as rows."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from homerlhf import doctor
from homerlhf.workers.process import portable_reinstall_command


def test_export_types_are_read_from_the_presets():
    # presets/*.yaml: cpu-tiny exports f32 (ref and reward); the seven GPU presets f16 (ref), q8_0 (reward).
    gpu = ["3060-12g", "3090", "4060ti-16g", "4080", "4090", "a100-80g", "t4-colab"]
    assert doctor.preset_export_types() == {"f16": gpu, "f32": ["cpu-tiny"], "q8_0": gpu}


def test_build_features_of_a_system_info_line():
    portable = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
    assert doctor.build_features(portable) == ["SSE3", "SSSE3", "AVX", "AVX2", "F16C", "FMA", "BMI2", "LLAMAFILE", "OPENMP", "REPACK"]
    native = "CPU : AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | AVX512_BF16 = 0 | "
    assert doctor.build_features(native) == ["AVX2", "AVX512", "AVX512_VNNI", "AMX_INT8"]


def test_a_child_killed_by_sigill_is_a_reported_miss():
    with pytest.raises(doctor.ChildFailed) as info:
        doctor.run_child("import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    assert info.value.detail.startswith("died by SIGILL (illegal instruction: the llama.cpp build uses CPU")
    assert info.value.fix == f"reinstall the portable llama.cpp build: {portable_reinstall_command()}"


def test_a_child_that_raises_reports_its_last_error_line():
    with pytest.raises(doctor.ChildFailed, match="^ModuleNotFoundError: No module named 'no_such_module'$"):
        doctor.run_child("import no_such_module")
    assert doctor.run_child("import json, sys; print('noise'); print(json.dumps({'x': sys.argv[1]}))", "7") == {"x": "7"}


def test_unwritable_cache_dir_fails(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("HOMERLHF_CACHE", str(blocker / "cache"))
    [row] = doctor.check_cache_dir()
    assert row.status == doctor.FAIL and row.fix == "set HOMERLHF_CACHE to a folder you can write"
    monkeypatch.setenv("HOMERLHF_CACHE", str(tmp_path / "cache"))
    assert doctor.check_cache_dir()[0].status == doctor.OK


@pytest.mark.slow
def test_doctor_all_good_through_the_cli(tmp_path):
    env = dict(os.environ, HOMERLHF_CACHE=str(tmp_path / "cache"), COLUMNS="400", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "homerlhf.cli", "doctor"], capture_output=True, text=True,
                          env=env, timeout=600)
    out = proc.stdout
    print(out)
    assert proc.returncode == 0, out + proc.stderr
    assert "Traceback" not in out + proc.stderr
    rows = {m.group(1).strip(): (m.group(2), m.group(3).strip()) for m in
            re.finditer(r"^│ (.+?)│ (ok|warn|FAIL) *│(.*?)│", out, re.M)}
    for name in ("python", "torch", "transformers", "peft", "trl", "bitsandbytes", "llama-cpp-python",
                 "llama.cpp build", "llama.cpp decode f32", "llama.cpp decode f16", "llama.cpp decode q8_0",
                 "bitsandbytes NF4 (cpu)",
                 "host", "cache dir"):
        assert rows[name][0] == "ok", (name, rows.get(name))
    assert rows["CUDA"][0] == "warn"  # CUDA_VISIBLE_DEVICES="": warned about, never a failure
    assert rows["chromium"][0] in ("ok", "warn")
    assert "matches HF to" in rows["llama.cpp decode q8_0"][1]
    assert out.rstrip().splitlines()[-1].startswith("ready: `homerlhf demo` will run")
