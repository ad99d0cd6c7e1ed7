"""The built package holds everything and runs from outside the checkout: each command's import path
through the installed wheel (tests/wheel_venv.py), not the source tree. ``homerlhf demo --fast`` and
``homerlhf doctor`` run from the wheel in their own tests (tests/stages/test_demo.py, tests/test_doctor.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import tarfile
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from wheel_venv import ROOT

PRESETS = {"4090", "3090", "4080", "4060ti-16g", "3060-12g", "t4-colab", "a100-80g", "cpu-tiny"}


def source_files() -> set[str]:
    """Every module and preset of the source tree, as paths from the repository root."""
    package = ROOT / "homerlhf"
    found = {p for p in package.rglob("*") if p.suffix in (".py", ".yaml") and "__pycache__" not in p.parts}
    return {p.relative_to(ROOT).as_posix() for p in found}


def test_the_wheel_and_the_sdist_hold_every_module_and_preset(installed_wheel):
    wanted = source_files()
    assert {f"homerlhf/presets/{name}.yaml" for name in PRESETS} <= wanted
    assert {"homerlhf/check/main.py", "homerlhf/workers/gguf/registry.py", "homerlhf/presets/__init__.py"} <= wanted
    in_wheel = set(zipfile.ZipFile(installed_wheel.wheel).namelist())
    assert sorted(wanted - in_wheel) == []
    with tarfile.open(installed_wheel.sdist) as sdist:
        in_sdist = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert sorted(wanted - in_sdist) == []


def test_the_installed_package_is_the_wheel_and_lists_every_preset(installed_wheel, tmp_path):
    where = installed_wheel.python("import homerlhf, homerlhf.presets; print(homerlhf.__file__)", cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(installed_wheel.venv)  # not the checkout (editable or path)
    help_ = installed_wheel.run("--help", cwd=tmp_path)
    assert help_.returncode == 0 and "train" in help_.stdout and "demo" in help_.stdout, help_.stderr
    listed = installed_wheel.run("presets", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert {line.split()[0] for line in listed.stdout.splitlines()} == PRESETS
    dry = installed_wheel.run("check", cwd=tmp_path, CUDA_VISIBLE_DEVICES="")
    assert dry.returncode == 0 and "nothing run, nothing written" in dry.stdout, dry.stdout + dry.stderr
    assert list(tmp_path.iterdir()) == []


PAIRS = [{"prompt": "Tell me about tea.", "chosen": "Happy to help! Tea is made by steeping leaves in hot water.",
          "rejected": "Figure it out yourself."},
         {"prompt": "Share a fact about cats.", "chosen": "Gladly! Cats sleep for most of the day.",
          "rejected": "Not my problem."}] * 4


@pytest.mark.slow
def test_train_export_and_reward_from_the_wheel(installed_wheel, tmp_path):
    """One cpu-tiny iteration (the demo's cached models), its policy exported with a GGUF, and a reward
    model trained one step on a few pairs: each stage's imports (TRL, llama.cpp, the GGUF writer) resolve
    in the installed package."""
    tiny = ["--set", "ppo.iterations=1", "--set", "rollout.batch_size=4", "--set", "rollout.chunk_size=4",
            "--set", "ppo.mini_batch_size=4", "--set", "ppo.micro_batch_size=4", "--set", "rollout.max_new_tokens=8",
            "--set", "logging.progress=false"]
    train = installed_wheel.run("train", "--preset", "cpu-tiny", *tiny, "--out", "run", cwd=tmp_path)
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-3000:]
    assert "PPO done: 1 iterations" in train.stdout
    assert [line for line in (train.stdout + train.stderr).splitlines() if "llama_" in line] == []
    assert "n_ctx_seq" in (tmp_path / "run" / "llama.log").read_text()  # the engine's warning, kept in the run dir
    export = installed_wheel.run("export", "policy", "run", "--out", "exported", "--gguf", "f16", cwd=tmp_path)
    assert export.returncode == 0, export.stdout[-2000:] + export.stderr[-3000:]
    assert (tmp_path / "exported" / "config.json").is_file()
    assert [p.name for p in (tmp_path / "exported" / "gguf").glob("*.gguf")] == ["exported-f16.gguf"]

    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    reward = installed_wheel.run("reward", "--preset", "cpu-tiny", "--data", "pairs.jsonl", "--out", "rm",
                                 "--set", "rm.max_steps=1", "--set", "rm.batch_size=4", "--set", "logging.progress=false",
                                 cwd=tmp_path)
    assert reward.returncode == 0, reward.stdout[-2000:] + reward.stderr[-3000:]
    assert reward.stdout.strip().splitlines()[-1].startswith("reward done: 8 pairs")
    assert (tmp_path / "rm" / "gguf" / "manifest.json").is_file()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_the_app_from_the_wheel_answers_a_request(installed_wheel, tmp_path):
    port = _free_port()
    proc = subprocess.Popen([str(installed_wheel.bin / "homerlhf"), "app", "--port", str(port), "--runs", "runs"],
                            cwd=tmp_path, env=installed_wheel.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline, page = time.monotonic() + 300, None
        while time.monotonic() < deadline and proc.poll() is None and page is None:
            try:
                page = httpx.get(f"http://127.0.0.1:{port}/", timeout=10)
            except httpx.TransportError:
                time.sleep(0.2)  # not listening yet: the app imports gradio and builds its page first
        assert page is not None, proc.stdout.read() if proc.poll() is not None else "no answer in 300 s"
        assert page.status_code == 200, page.text[:500]
        config = httpx.get(f"http://127.0.0.1:{port}/config", timeout=30)  # the page's blocks, as the browser reads them
        assert config.status_code == 200 and config.json()["title"].startswith("homerlhf"), config.text[:500]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
