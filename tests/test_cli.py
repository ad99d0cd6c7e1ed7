"""The CLI as a user meets it: a subprocess, its exit code and what it prints."""

import subprocess
import sys

import pytest


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "homerlhf.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_presets_lists_eight_lines():
    out = run("presets")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 8
    assert any(line.startswith("4090") and "24 GiB" in line for line in lines)
    assert any(line.startswith("cpu-tiny") and "CPU only" in line for line in lines)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["train", "--preset", "nope"], "unknown preset 'nope'"),
        (["train", "--preset", "cpu-tiny", "--set", "ppo.kl_coef=abc"], "ppo.kl_coef"),
        (["train", "--bogus-flag"], "--bogus-flag"),
        (["train", "--preset", "4090"], "--preset cpu-tiny"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, fragment):
    import torch

    if args[-1] == "4090" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = run(*args)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert fragment in out.stderr


@pytest.mark.parametrize("cmd", ["train", "plan", "demo", "sft", "reward", "export", "worker", "app", "presets"])
def test_every_command_has_help(cmd):
    out = run(cmd, "--help")
    assert out.returncode == 0, out.stderr
    assert "Usage" in out.stdout
