"""``rollout.engine: auto`` (on cpu-tiny, named) when a run starts: chosen by this machine's ``homerlhf bench``
figures, read from the cache file the bench's own writer saved (else the defaults, said so); ``hf``
where llama-cpp-python is absent, or the policy's architecture has no GGUF export or an unverified
LoRA swap, with why; a named engine kept. (A real run that samples with the engine chosen:
tests/stages/test_autoplan.py::test_train_records_the_resolved_placement_in_the_run_config.)"""

from __future__ import annotations

import sys

import pytest

from homerlhf.config import load_config
from homerlhf.memory.render import shape_for
from homerlhf.memory.timing import Throughputs
from homerlhf.stages.autoplan import resolve_auto
from homerlhf.workers.bench import _save

# The small PPO shape of tests/memory/conftest.py (4 sequences in chunks of 2, 6 + 4 tokens, 1 epoch), the
# preset's reference and reward workers and the engine auto on 1 thread; its hand-made rates, the engine's
# as given (at that thread).
SMALL = ["rollout.batch_size=4", "rollout.chunk_size=2", "rollout.max_prompt_len=6", "rollout.max_new_tokens=4",
         "ppo.mini_batch_size=2", "ppo.micro_batch_size=2", "ppo.epochs=1", "rollout.engine=auto",
         "rollout.engine_threads=1"]
SOURCE = "measured by hand for tests/stages/test_autoplan_engine.py"
HF = ("ref llamacpp, reward llamacpp, rollout hf: 18.0 s per iteration (generation 4.0 s, reference log-probs 4.0 s "
      "(overlapped), reward scoring 8.0 s (overlapped), old log-probs / values 4.0 s, update 8.0 s)")


def _bench_file(cfg, llama_gen: float, shape=None):
    """This machine's bench figures for ``cfg``'s model, as ``homerlhf bench`` saves them."""
    rates = Throughputs(worker_ref={1: 10.0}, worker_reward={1: 5.0}, llama_gen={1: llama_gen},
                        trainer_gen={1: 4.0, 2: 8.0}, trainer_forward={1: 20.0, 2: 40.0},
                        trainer_train={1: 10.0, 2: 20.0}, source=SOURCE)
    return _save(cfg, shape or shape_for(cfg), rates, {"note": "hand-made"})


@pytest.fixture
def two_cores(monkeypatch, tmp_path):
    monkeypatch.setenv("HOMERLHF_CACHE", str(tmp_path / "cache"))  # no figures but the test's
    monkeypatch.setattr("homerlhf.memory.threads.physical_cores", lambda: 2)
    monkeypatch.setattr("os.cpu_count", lambda: 2)


def test_the_bench_figures_choose_the_engine_and_the_run_start_and_the_plan_say_so(two_cores):
    from homerlhf.memory.placement import placed_plan

    cfg = load_config("cpu-tiny", None, SMALL)
    assert cfg.rollout.engine == "auto"
    said: list[str] = []
    # llama.cpp at 16 tok/s: 16.5 s per iteration against hf's 18 (tests/memory/test_engine_choice.py).
    path = _bench_file(cfg, 16.0)
    assert resolve_auto(cfg, say=said.append).rollout.engine == "llamacpp"
    lines = [
        f"placement auto: ref llamacpp, reward llamacpp, rollout llamacpp: 16.5 s per iteration ({SOURCE})",
        "  alternatives that fit: ref llamacpp, reward llamacpp, rollout hf 18.0 s",
        "  rollout engine auto -> llamacpp: 16.5 s per iteration (generation 1.0 s, reference log-probs 4.0 s "
        "(overlapped), reward scoring 8.0 s (overlapped), old log-probs / values 4.0 s, update 8.0 s)",
        "  the alternative, hf: 18.0 s per iteration (generation 4.0 s, reference log-probs 4.0 s (overlapped), "
        "reward scoring 8.0 s (overlapped), old log-probs / values 4.0 s, update 8.0 s)"]
    assert said == ["[homerlhf] " + line for line in lines]  # measured: no default-rates line
    from homerlhf.workers.bench import cached_throughputs

    plan = placed_plan(cfg, shape_for(cfg), cached_throughputs(cfg, shape_for(cfg)))
    assert plan.notes[:4] == lines and plan.timing.current.time.placement.engine == "llamacpp"
    # At 2 tok/s llama.cpp takes 22 s: hf.
    _bench_file(cfg, 2.0)
    said.clear()
    assert resolve_auto(cfg, say=said.append).rollout.engine == "hf"
    assert said[0] == f"[homerlhf] placement auto: {HF.split(' (generation')[0]} ({SOURCE})"
    # Named, the engine is the config's, whatever the figures say; nothing to choose, nothing said.
    named = load_config("cpu-tiny", None, SMALL + ["rollout.engine=hf"])
    _bench_file(named, 16.0)
    assert resolve_auto(named, say=said.append) is named
    path.unlink()  # no figures: the defaults choose, and the run says so
    said.clear()
    resolve_auto(cfg, say=said.append)
    assert "(default, not measured)" in said[0] and said[-1].startswith("[homerlhf]   chosen by default rates")


def test_without_llama_cpp_or_a_gguf_export_auto_takes_hf_and_says_why(two_cores, monkeypatch, tmp_path):
    import json

    cfg = load_config("cpu-tiny", None, SMALL)
    _bench_file(cfg, 16.0)  # llama.cpp the faster, were it there
    said: list[str] = []
    with monkeypatch.context() as absent:
        absent.setitem(sys.modules, "llama_cpp", None)  # how Python marks a package that cannot be imported
        assert resolve_auto(cfg, say=said.append).rollout.engine == "hf"
    assert said == [f"[homerlhf] placement auto: {HF.split(' (generation')[0]} ({SOURCE})",
                    f"[homerlhf]   rollout engine auto -> hf: {HF.split(': ', 1)[1]}",
                    "[homerlhf]   llamacpp: not a candidate: llama-cpp-python is not installed (`pip install "
                    "llama-cpp-python` for the llamacpp engine)"]
    # A policy whose architecture the GGUF export does not serve (its config.json says so).
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    other = load_config("cpu-tiny", None, SMALL + [f"model.name_or_path={model}"])
    _bench_file(other, 16.0, shape_for(cfg))
    said.clear()
    assert resolve_auto(other, shape=shape_for(cfg), say=said.append).rollout.engine == "hf"
    assert said[-1].startswith(f"[homerlhf]   llamacpp: not a candidate: {model}: architecture 'gpt2' cannot be "
                               "served by the llama.cpp rollout engine (GGUF export supports ")
    assert not said[-1].endswith("set rollout.engine=hf (the actor samples with its own generate)")
    # One the export serves but whose LoRA swap no test has checked: named it runs, auto does not take it.
    (model / "config.json").write_text(json.dumps({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}))
    said.clear()
    assert resolve_auto(other, shape=shape_for(cfg), say=said.append).rollout.engine == "hf"
    assert said[-1] == (f"[homerlhf]   llamacpp: not a candidate: {model}: the engine's LoRA swap is verified for "
                        "llama and qwen2 policies, not mistral (name rollout.engine=llamacpp to use it)")


@pytest.mark.slow
def test_train_with_a_reward_adapter_samples_with_the_engine_auto_chose(tiny_llama_dir, tiny_lora_rm_dir, tmp_path,
                                                                        capsys, monkeypatch):
    """``homerlhf train --preset cpu-tiny --set reward.backend=adapter`` (reward.model a LoRA reward run on the
    policy's base): the preset's rollout.engine auto chooses an engine with the reward adapter kept, and one
    iteration samples with it and scores with the adapter. (The preset's own builtin:demo-rm is a reward
    model of its own: refused in one line, tests/stages/test_preflight.py.)"""
    from homerlhf.cli import main
    from homerlhf.config import from_yaml_file
    from homerlhf.ppo.metrics import read_metrics

    monkeypatch.setenv("HOMERLHF_CACHE", str(tmp_path / "cache"))  # no bench figures: the defaults choose
    settings = [f"model.name_or_path={tiny_llama_dir}", "reward.backend=adapter", f"reward.model={tiny_lora_rm_dir}",
                "rollout.batch_size=2", "rollout.chunk_size=2", "rollout.max_new_tokens=4", "rollout.max_prompt_len=24",
                "ppo.mini_batch_size=2", "ppo.micro_batch_size=2", "ppo.epochs=1", "ppo.iterations=1",
                "logging.progress=false", "logging.samples_per_iteration=2", "rollout.truncation_penalty=null"]
    main(["train", "--preset", "cpu-tiny", "--out", str(tmp_path / "run"), *[a for s in settings for a in ("--set", s)]])
    saved = from_yaml_file(tmp_path / "run" / "config.yaml")
    assert saved.reward.backend == "adapter" and saved.ref.backend == "llamacpp"
    assert saved.rollout.engine in ("hf", "llamacpp")
    out = capsys.readouterr().out
    assert f"placement auto: ref llamacpp, reward adapter, rollout {saved.rollout.engine}: " in out
    assert f"rollout engine auto -> {saved.rollout.engine}: " in out
    (row,) = read_metrics(tmp_path / "run")
    assert row["iteration"] == 1 and row["score_std"] > 0  # the adapter scored the two samples apart
