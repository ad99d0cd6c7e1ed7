"""`homerlhf doctor`: the all-good path through the real CLI, and misses reported as rows."""

from __future__ import annotations

import re

import pytest

from homerlhf import doctor
from homerlhf.workers.process import portable_reinstall_command


def test_export_types_are_read_from_the_presets():
    # homerlhf/presets/*.yaml: cpu-tiny exports f32 (ref and reward); the seven GPU presets f16 (ref), q8_0 (reward).
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
def test_doctor_all_good_through_the_cli(tmp_path, installed_wheel):
    """The installed wheel's `homerlhf doctor`, from outside the checkout (tests/wheel_venv.py)."""
    proc = installed_wheel.run("doctor", cwd=tmp_path, HOMERLHF_CACHE=str(tmp_path / "cache"), COLUMNS="400",
                               CUDA_VISIBLE_DEVICES="")
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


def _gpu_free_checks(monkeypatch, cuda_rows=None) -> dict:
    """The doctor's checks of llama.cpp and NF4 replaced by ok rows that record what they were asked
    (they build models and start workers: minutes); ``cuda_rows``: what ``check_cuda`` reports (None:
    the real one, here no CUDA device). Returns the record: GPU or not, per check."""
    asked = {"nf4": []}
    monkeypatch.setattr(doctor, "check_llama_build", lambda: [doctor.Check("llama.cpp build", doctor.OK, "portable")])

    def decodes(on_gpu, progress):
        asked["decodes_on_gpu"] = on_gpu
        return [doctor.Check("llama.cpp decode f32", doctor.OK, "matches HF")]

    def nf4(device):
        asked["nf4"].append(device)
        return doctor.Check(f"bitsandbytes NF4 ({device})", doctor.OK, "matches")

    monkeypatch.setattr(doctor, "check_decodes", decodes)
    monkeypatch.setattr(doctor, "check_nf4", nf4)
    if cuda_rows is not None:
        monkeypatch.setattr(doctor, "check_cuda", lambda: cuda_rows)
    return asked


def test_on_a_cuda_machine_the_doctor_names_homerlhf_check_as_the_next_step_once(monkeypatch, capsys, tmp_path):
    """A CUDA-reporting ``check_cuda`` (the function whose rows decide the GPU checks): the doctor asks the
    GPU-only checks for the GPU and ends with `homerlhf check` as the next step, named once."""
    monkeypatch.setenv("HOMERLHF_CACHE", str(tmp_path / "cache"))
    asked = _gpu_free_checks(monkeypatch, [doctor.Check("CUDA 0", doctor.OK, "NVIDIA GeForce RTX 4090: 23.1 of 24.0 GiB free")])
    assert doctor.run_doctor() == 0
    out = capsys.readouterr().out
    assert asked == {"decodes_on_gpu": True, "nf4": ["cpu", "cuda"]}
    assert out.count("homerlhf check") == 1
    ready, next_step = out.rstrip().splitlines()[-2:]
    assert ready.startswith("ready: `homerlhf demo` will run") and next_step == "next " + doctor.NEXT_ON_GPU
    assert next_step.startswith("next on this GPU: `homerlhf check` (a few minutes")


def test_without_cuda_the_doctor_names_no_gpu_check(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("HOMERLHF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    asked = _gpu_free_checks(monkeypatch)  # the real check_cuda: no device on this machine
    assert doctor.run_doctor() == 0
    out = capsys.readouterr().out
    assert asked == {"decodes_on_gpu": False, "nf4": ["cpu"]}
    assert "homerlhf check" not in out and out.rstrip().splitlines()[-1].startswith("ready: `homerlhf demo` will run")


def test_a_failing_cuda_machine_names_the_check_after_the_fixes():
    rows = [doctor.Check("CUDA 0", doctor.OK, "NVIDIA H200: 139.0 of 139.8 GiB free"),
            doctor.Check("bitsandbytes NF4 (cuda)", doctor.FAIL, "died by SIGSEGV", "pip install ...")]
    assert doctor.verdict_lines(rows) == [
        "not ready: 1 check(s) failed (bitsandbytes NF4 (cuda)); see 'what to do'",
        "once they are fixed, next " + doctor.NEXT_ON_GPU]
    assert doctor.verdict_lines([doctor.Check("CUDA", doctor.WARN, "no CUDA device visible")]) == ["ready: `homerlhf demo` will run (1 warning(s): CUDA)"]
