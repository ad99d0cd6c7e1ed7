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


@pytest.mark.parametrize("cmd", ["train", "plan", "demo", "sft", "reward", "export", "worker", "app", "presets", "config"])
def test_every_command_has_help(cmd):
    out = run(cmd, "--help")
    assert out.returncode == 0, out.stderr
    assert "Usage" in out.stdout


def test_config_lists_every_setting_of_the_preset_and_train_help_config_is_the_same():
    from homerlhf.config import load_config
    from homerlhf.config.listing import settings

    rows = list(settings(load_config("4090")))
    listed = run("config", "--preset", "4090")
    assert listed.returncode == 0, listed.stderr
    header, *lines = listed.stdout.strip().splitlines()
    assert header.startswith(f"# preset 4090: key, type, value, description ({len(rows)} settings")
    assert [line.split()[0] for line in lines] == [row.key for row in rows]
    # train --help-config: the same rows for the same command line, on any machine (no CUDA, no --data needed)
    same = run("train", "--preset", "4090", "--help-config")
    assert same.returncode == 0 and same.stdout == listed.stdout, same.stderr
    # a section, with --set on top; an unknown one is one line
    ppo = run("config", "ppo", "--preset", "4090", "--set", "ppo.kl_coef=0.07").stdout.strip().splitlines()[1:]
    assert ppo and all(line.startswith("ppo.") for line in ppo)
    assert next(line for line in ppo if line.startswith("ppo.kl_coef ")).split()[2] == "0.07"
    bad = run("config", "nope")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: no setting is named 'nope' or starts with it; `homerlhf config` lists them all"]


def test_train_help_names_data_model_and_reward():
    out = run("train", "--help")
    assert out.returncode == 0
    for flag in ("--data", "--model", "--reward", "--help-config"):
        assert flag in out.stdout, flag
