"""`homerlhf bench`: a real --quick measurement (llama.cpp workers and engine, NF4 policy on CPU),
its cache, and the plan that reads it."""

from __future__ import annotations

import json
import subprocess
import sys

from homerlhf.config import load_config
from homerlhf.memory.render import shape_for
from homerlhf.memory.threads import physical_cores
from homerlhf.memory.timing import RATES, Throughputs
from homerlhf.workers.bench import _save, cache_path, cached_throughputs, thread_plan

TINY = ["--set", "model.name_or_path=builtin:tiny-llama"]


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "homerlhf.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_quick_bench_measures_every_rate_caches_them_and_the_plan_uses_them():
    out = cli("bench", "--quick", "--standin", *TINY)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "measured" in out.stdout and "stand-in" in out.stdout
    for line in ("llama.cpp ref worker", "llama.cpp reward worker", "llama.cpp rollout engine", "policy HF generation",
                 "policy forward (no grad)", "policy forward + backward"):
        assert line in out.stdout
    assert "bench:" in out.stderr  # the progress bar
    cfg = load_config("cpu-tiny", None, ["model.name_or_path=builtin:tiny-llama"])
    rates = cached_throughputs(cfg, shape_for(cfg))
    assert rates is not None and rates.source.startswith("measured")
    workers, trainer = thread_plan(cfg, physical_cores(), quick=True)
    for kind in RATES:
        table = getattr(rates, kind)
        assert table and all(v > 0 for v in table.values()), kind
    assert set(rates.worker_ref) == set(workers) and set(rates.trainer_forward) == set(trainer)

    again = cli("bench", "--quick", *TINY)  # same machine and shape: the cache answers
    assert again.returncode == 0 and "cached (--force to measure again)" in again.stdout

    plan = cli("plan", "--json", *TINY)
    assert plan.returncode == 0, plan.stderr
    timing = json.loads(plan.stdout)["time"]
    assert timing["current"]["source"] == rates.source
    assert timing["current"]["total_s"] > 0 and timing["line"]


def test_the_cache_round_trips_and_is_keyed_by_shape_and_dtypes():
    cfg = load_config("cpu-tiny", None, ["model.name_or_path=builtin:tiny-qwen2"])
    shape = shape_for(cfg)
    rates = Throughputs(worker_ref={1: 123.5}, worker_reward={1: 99.0}, llama_gen={2: 7.0}, trainer_gen={1: 3.0},
                        trainer_forward={1: 50.0}, trainer_train={1: 20.0}, source="measured test")
    path = _save(cfg, shape, rates, {"note": "test"})
    assert path == cache_path(cfg, shape) and json.loads(path.read_text())["details"] == {"note": "test"}
    assert cached_throughputs(cfg, shape) == rates
    other = load_config("cpu-tiny", None, ["model.name_or_path=builtin:tiny-qwen2", "ref.outtype=q8_0"])
    assert cached_throughputs(other, shape) is None  # another export type: not the same speed
    path.write_text("{not json")
    assert cached_throughputs(cfg, shape) is None  # a broken file is no figures, not a crash


def test_plan_without_figures_says_the_defaults_are_not_measured():
    out = cli("plan", "--preset", "4090", "--model", "Qwen/Qwen2.5-7B")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "time per iteration" in text and "reference log-probs" in text and "old log-probs / values" in text
    text = " ".join(text.split())  # rich wraps long lines
    assert ("(GPU: H200 figures scaled to the RTX 4090 by its published specs (165.2 vs 989.5 TFLOPS, 1.01 vs 4.8 "
            "TB/s), not measured on one; CPU workers: default, not measured)") in text
    assert "critical path" in text
    assert "placements compared" in text and ("recommended: --set" in text or "is the fastest that fits" in text)


def test_gpu_figures_are_cached_per_gpu_with_the_chunk_they_were_measured_at(monkeypatch):
    """On a CUDA machine the GPU's name is part of the machine's key and of the figures' label: what
    one card measured is not another card's. (No GPU here: the name is what torch would report.)"""
    from homerlhf.workers import bench as bench_mod

    cfg = load_config("4090", None, ["model.name_or_path=builtin:tiny-qwen2"])
    shape = shape_for(cfg)
    gpu = {"name": "NVIDIA H200"}
    monkeypatch.setattr(bench_mod, "gpu_name", lambda device: gpu["name"] if device == "cuda" else None)
    rates = Throughputs(worker_ref={8: 10.0}, worker_reward={8: 5.0}, llama_gen={16: 2.0}, trainer_gen={0: 190.0},
                        trainer_forward={0: 16_000.0}, trainer_train={0: 4_350.0},
                        source=bench_mod.source_label("cuda", "model", quick=True), gen_chunk=16)
    assert rates.source.startswith("measured ") and " on NVIDIA H200 + " in rates.source
    assert rates.source.endswith(", quick")
    path = _save(cfg, shape, rates, {"note": "test"})
    assert json.loads(path.read_text())["machine"]["gpu"] == "NVIDIA H200"
    assert cached_throughputs(cfg, shape) == rates  # gen_chunk included
    gpu["name"] = "NVIDIA GeForce RTX 4090"
    assert cached_throughputs(cfg, shape) is None  # another card: measure it there
    path.unlink()
    # What a GPU's trainer is timed on: a chunk at the run's lengths, 16 decode steps when quick, one
    # micro-batch through forward + backward.
    prompts, responses, new, rows = bench_mod.gpu_inputs(cfg, shape, quick=True)
    assert (len(prompts), len(prompts[0]), len(responses[0]), new, rows) == (16, 512, 256, 16, 4)
