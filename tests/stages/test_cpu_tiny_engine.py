"""The cpu-tiny preset's rollout engine (issue 46): ``auto``, which on a CPU with llama-cpp-python and no
``homerlhf bench`` figures takes the llama.cpp engine by the default rates and says so in its placement
line; ``--set rollout.engine=hf`` still samples with the actor's own generate. Real runs through the CLI,
with a real llama.cpp engine (the policy's NF4 base exported to GGUF, the actor's LoRA swapped in)."""

from __future__ import annotations

import pytest

from homerlhf.config import from_yaml_file, load_config
from homerlhf.ppo.metrics import read_metrics

pytest.importorskip("llama_cpp")

SMALL = ["ref.backend=adapter_off", "reward.backend=function", "reward.function=builtin:reverse",
         "data.prompts=builtin:reverse", "rollout.batch_size=4", "rollout.chunk_size=4", "rollout.max_new_tokens=6",
         "rollout.max_prompt_len=24", "rollout.truncation_penalty=null", "ppo.mini_batch_size=4",
         "ppo.micro_batch_size=4", "ppo.epochs=1", "ppo.iterations=2", "checkpoint.every=2", "logging.progress=false",
         "logging.tensorboard=false"]


@pytest.fixture
def no_bench_figures(monkeypatch, tmp_path):
    """No ``homerlhf bench`` figures on this 'machine' of 2 cores: the default rates choose."""
    monkeypatch.setenv("HOMERLHF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("homerlhf.memory.threads.physical_cores", lambda: 2)
    monkeypatch.setattr("os.cpu_count", lambda: 2)


def _train(tiny_llama_dir, out, *extra):
    from homerlhf.cli import main

    args = ["train", "--preset", "cpu-tiny", "--set", f"model.name_or_path={tiny_llama_dir}", "--out", str(out)]
    for item in [*SMALL, *extra]:
        args += ["--set", item]
    main(args)


def test_the_preset_names_auto_on_one_engine_thread():
    cfg = load_config("cpu-tiny")
    assert (cfg.rollout.engine, cfg.rollout.engine_threads) == ("auto", 1)


def test_cpu_tiny_samples_with_llamacpp_by_the_default_rates_and_says_so(tiny_llama_dir, tmp_path, capsys,
                                                                          no_bench_figures):
    _train(tiny_llama_dir, tmp_path / "run")
    out = capsys.readouterr().out
    placement = next(line for line in out.splitlines() if "placement auto:" in line)
    assert "rollout llamacpp" in placement and "(default, not measured)" in placement
    assert "rollout engine auto -> llamacpp" in out and "the alternative, hf:" in out
    assert "chosen by default rates" in out
    assert from_yaml_file(tmp_path / "run" / "config.yaml").rollout.engine == "llamacpp"  # a resume keeps it
    rows = read_metrics(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [1, 2]
    # The engine's samples are scored by the trainer: its behaviour log-probs (an f16 export) sit within float
    # error of the trainer's old ones, not on them, so the importance weights are ~1 (HF generate's: exactly).
    for row in rows:
        assert 0 < row["kl_behaviour_old"] < 1e-3
        assert row["is_weight_mean"] == pytest.approx(1.0, abs=1e-2)
    assert (tmp_path / "run" / "engine").is_dir()  # the actor's LoRA written there for the engine


def test_named_hf_still_samples_with_the_actors_generate(tiny_llama_dir, tmp_path, capsys, no_bench_figures):
    _train(tiny_llama_dir, tmp_path / "run", "rollout.engine=hf")
    out = capsys.readouterr().out
    assert "rollout engine auto" not in out
    assert from_yaml_file(tmp_path / "run" / "config.yaml").rollout.engine == "hf"
    rows = read_metrics(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [1, 2]
    assert all(row["kl_behaviour_old"] == 0.0 and row["is_weight_mean"] == 1.0 for row in rows)  # its own samples
    assert not (tmp_path / "run" / "engine").exists()
