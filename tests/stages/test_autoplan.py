"""``auto`` settings resolved when a run starts: the choice by hand-made rates and its printed line, a
resumed run's choice kept, a ready reward backend left alone, and the resolved values recorded in the
run's config.yaml."""

from __future__ import annotations

import pytest

from homerlhf.config import from_yaml_file, load_config
from homerlhf.config.learning_rates import auto_actor_lr, auto_lr_line
from homerlhf.memory.render import shape_for
from homerlhf.memory.timing import Throughputs
from homerlhf.stages.autoplan import has_auto, resolve_auto

# The small PPO shape of tests/memory/conftest.py: 4 sequences in chunks of 2, 6 + 4 tokens, 1 epoch,
# HF generate named (an auto engine: tests/stages/test_autoplan_engine.py).
SMALL = ["rollout.batch_size=4", "rollout.chunk_size=2", "rollout.max_prompt_len=6", "rollout.max_new_tokens=4",
         "ppo.mini_batch_size=2", "ppo.micro_batch_size=2", "ppo.epochs=1", "rollout.engine=hf"]
RATES = Throughputs(worker_ref={1: 10.0}, worker_reward={1: 5.0}, llama_gen={2: 1.0}, trainer_gen={1: 4.0, 2: 8.0},
                    trainer_forward={1: 20.0, 2: 40.0}, trainer_train={1: 10.0, 2: 20.0}, source="hand-made")


def _auto(*extra):
    return load_config("cpu-tiny", None, SMALL + ["ref.backend=auto", "reward.backend=auto", *extra])


def test_the_choice_is_printed_and_resolved(monkeypatch):
    monkeypatch.setattr("homerlhf.memory.threads.physical_cores", lambda: 2)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    said = []
    cfg = resolve_auto(_auto(), rates=RATES, rewards=["llamacpp", "adapter", "hf"], say=said.append)
    # tests/memory/test_timing.py derives these timelines by hand: everything on the trainer, 10 s.
    assert (cfg.ref.backend, cfg.reward.backend, cfg.rollout.engine) == ("adapter_off", "adapter", "hf")
    assert not has_auto(cfg)
    assert said[0] == "[homerlhf] placement auto: ref adapter_off, reward adapter, rollout hf: 10.0 s per iteration " \
                      "(hand-made)"
    assert said[1].startswith("[homerlhf]   alternatives that fit: ref adapter_off, reward hf, rollout hf 10.0 s")
    # A reward that is only a llama.cpp export: the reference's worker keeps up (18 s against 20 s).
    gguf_only = resolve_auto(_auto(), rates=RATES, rewards=["llamacpp"], say=said.append)
    assert (gguf_only.ref.backend, gguf_only.reward.backend) == ("llamacpp", "llamacpp")
    named = load_config("cpu-tiny", None, SMALL)
    assert resolve_auto(named, rates=RATES, say=said.append) is named  # nothing auto: as it is


def test_actor_lr_auto_alone_takes_the_rate_for_the_size_and_a_resumed_run_keeps_its_rate():
    """No placement is chosen for a config whose only auto is the learning rate; a resumed run keeps the
    rate its checkpoint trained with, whatever the rule says now."""
    said = []
    cfg = resolve_auto(load_config("cpu-tiny", None, SMALL + ["actor.lr=auto"]), rates=RATES, say=said.append)
    size = shape_for(cfg).total_params
    assert cfg.actor.lr == auto_actor_lr(size) == 1e-4 and said == [f"[homerlhf] {auto_lr_line(size)}"]
    saved = load_config("cpu-tiny", None, SMALL + ["actor.lr=3e-5"])
    assert resolve_auto(load_config("cpu-tiny", None, SMALL + ["actor.lr=auto"]), saved=saved, rates=RATES,
                        say=pytest.fail).actor.lr == 3e-5


def test_a_resumed_run_keeps_its_choice_and_a_ready_reward_is_left_alone(monkeypatch):
    monkeypatch.setattr("homerlhf.memory.threads.physical_cores", lambda: 2)  # the rates' threads, on any machine
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    saved = load_config("cpu-tiny", None, SMALL + ["ref.backend=llamacpp", "reward.backend=hf", "reward.model=x",
                                                   "rollout.generation_chunk=4"])
    cfg = resolve_auto(_auto("rollout.generation_chunk=auto"), saved=saved, rates=RATES, say=pytest.fail)
    assert (cfg.ref.backend, cfg.reward.backend, cfg.rollout.generation_chunk) == ("llamacpp", "hf", 4)
    given = resolve_auto(_auto(), rates=RATES, reward_given=True, say=lambda line: None)
    assert given.reward.backend == "auto" and given.ref.backend == "adapter_off"


def test_train_records_the_resolved_placement_in_the_run_config(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    import gc
    import weakref

    from bitsandbytes.nn import Linear4bit

    from homerlhf.models.policy import PolicyModel
    from homerlhf.ppo.metrics import read_metrics
    from homerlhf.stages.ppo import run_ppo
    from homerlhf.tiny import build_sequence_classifier
    from homerlhf.workers.bench import _save

    layers, load = [], PolicyModel.from_config

    def recorded(*args, **kwargs):
        policy = load(*args, **kwargs)
        layers.extend(weakref.ref(m) for m in policy.model.modules() if isinstance(m, Linear4bit))
        return policy

    monkeypatch.setattr(PolicyModel, "from_config", recorded)

    rm = build_sequence_classifier(tmp_path / "rm", arch="llama", seed=3)  # an HF classifier: llamacpp or hf
    cfg = load_config("cpu-tiny", overrides=[
        f"model.name_or_path={tiny_llama_dir}", "ref.backend=auto", "reward.backend=auto", f"reward.model={rm}",
        "rollout.batch_size=2", "rollout.chunk_size=2", "rollout.max_new_tokens=4", "rollout.max_prompt_len=24",
        "ppo.mini_batch_size=2", "ppo.micro_batch_size=2", "ppo.iterations=1", "logging.progress=false",
        "logging.tensorboard=false", "rollout.truncation_penalty=null", "rollout.engine=auto"])
    # This machine's bench figures (hand-made, saved by the bench's own writer): the llama.cpp engine far the
    # faster, so rollout.engine auto takes it (tests/stages/test_autoplan_engine.py: the choice),
    # and workers far the slower (no worker to start: the reference and the reward in process).
    monkeypatch.setenv("HOMERLHF_CACHE", str(tmp_path / "cache"))
    figures = {**RATES.__dict__, "llama_gen": {1: 1e6}, "worker_ref": {1: 1e-3}, "worker_reward": {1: 1e-3}}
    _save(cfg, shape_for(cfg), Throughputs(**figures), {"note": "hand-made"})
    gc.disable()  # no collection but the stage's own (objects stay young: enabling would collect them)
    try:
        run_ppo(cfg, out_dir=tmp_path / "run")
        alive = sum(ref() is not None for ref in layers)
    finally:
        gc.enable()
    # The policy's 4-bit layers (reference cycles: Params4bit.module) are gone when the run returns:
    # a notebook's next stage loads into a free card.
    assert layers and alive == 0
    out = capsys.readouterr().out
    saved = from_yaml_file(tmp_path / "run" / "config.yaml")
    assert (saved.ref.backend, saved.reward.backend) == ("adapter_off", "hf")
    line = f"placement auto: ref {saved.ref.backend}, reward {saved.reward.backend}, rollout llamacpp: "
    assert line in out and "s per iteration" in out and saved.rollout.engine == "llamacpp"
    # Sampled by llama.cpp: the actor's LoRA went to it as a GGUF adapter (written in the run's engine/), and
    # its f16 export's behaviour log-probs are not the trainer's (with hf they are taken as equal: weights
    # exactly 1; measured here: is_weight_max 1.0003).
    assert (tmp_path / "run" / "engine").is_dir()
    (row,) = read_metrics(tmp_path / "run")
    assert row["is_weight_max"] != 1.0


def test_a_run_start_that_sees_cuda_measures_nothing_and_says_the_defaults_decided(monkeypatch, tmp_path, capsys):
    """``homerlhf train --preset 4090`` on a CUDA machine with no ``homerlhf bench`` figures: the
    placement comes from the default rates, and no model is built, no GGUF exported, no worker
    started to choose it (the GPU machine has no llama.cpp; a user would wait minutes for nothing),
    whether or not the candidates are within 2x by those rates."""
    import bitsandbytes  # noqa: F401 - imported while the real device shows (its import reads it)
    import torch

    from homerlhf.stages.autoplan import resolve_for_run

    monkeypatch.setenv("HOMERLHF_CACHE", str(tmp_path / "cache"))  # no bench figures
    measured = []

    def forbidden(what):
        def call(*args, **kwargs):
            measured.append(what)
            raise AssertionError(f"a run's start measured: {what}")
        return call

    for target in ("homerlhf.workers.bench.standin_dir", "homerlhf.workers.gguf.export.export_ref",
                   "homerlhf.workers.gguf.export.export_reward", "homerlhf.workers.process.WorkerProcess.start",
                   "homerlhf.models.policy.PolicyModel.from_config"):
        monkeypatch.setattr(target, forbidden(target))
    # The 4090's 7B: every alternative far slower by the defaults; the 3060's 1.5B: an in-process hf
    # reward ties the reward adapter, within 2x, so this machine's own figures could pick either.
    for preset, model, verdict in (("4090", "Qwen/Qwen2.5-7B", "every alternative that fits is over 2x slower"),
                                   ("3060-12g", "Qwen/Qwen2.5-1.5B", "ref adapter_off, reward hf, rollout hf is "
                                                                     "within 2x of it")):
        cfg = load_config(preset, overrides=[f"model.name_or_path={model}"])  # the builtin table's shape
        with monkeypatch.context() as deciding:  # the machine reports CUDA while the run decides
            deciding.setattr(torch.cuda, "is_available", lambda: True)
            deciding.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 4090")
            resolved = resolve_for_run(cfg, None, reward_given=False)
        assert not measured
        assert not has_auto(resolved) and isinstance(resolved.rollout.generation_chunk, int)
        said = capsys.readouterr().out.splitlines()
        # actor.lr auto first: the rate for the model's size (tests/config/test_learning_rates.py: the rule)
        size = shape_for(cfg).total_params
        assert said.pop(0) == f"[homerlhf] {auto_lr_line(size)}" and resolved.actor.lr == auto_actor_lr(size)
        assert said[0].startswith(f"[homerlhf] placement auto: ref {resolved.ref.backend}, "
                                  f"reward {resolved.reward.backend}")
        assert "GPU: H200 figures scaled to the" in said[0]  # the GPU's default rates, as the plan labels them
        rates_line = next(line for line in said if "chosen by default rates" in line)  # then the checkpointing's
        assert rates_line.startswith("[homerlhf]   chosen by default rates (no `homerlhf bench` figures")
        assert verdict in rates_line and "`homerlhf bench` with this run's preset and --set measures them" in rates_line
        assert said[-1].startswith("[homerlhf] activation checkpointing (planned): ")
