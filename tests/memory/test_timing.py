"""The time model against hand-derived timelines: phases, the critical path with the trainer's
overlap, the recommendation and its savings, thread scaling, the GPU budget."""

from __future__ import annotations

import pytest

from homerlhf.memory.cards import card_spec
from homerlhf.memory.timing import Placement, Throughputs, iteration_time


def test_both_workers_on_llamacpp_the_reward_worker_is_the_critical_path(small_cfg, rates):
    it = iteration_time(small_cfg(), rates, cores=2, logical=2)
    # Per chunk: generation 2 x 4 / 4 = 2 s; ref 20 tokens / 10 = 2 s and reward 20 / 5 = 4 s on
    # their workers; old log-probs + values 2 forwards x 20 / 20 = 2 s.
    # Chunk 1: gen 0-2, ref 2-4, reward 2-6, scoring 2-4. Chunk 2: gen 4-6, ref 6-8, reward 6-10,
    # scoring 6-8. The trainer is done at 8 and waits for the reward worker until 10.
    assert it.phases == pytest.approx({"generation": 4.0, "reference": 4.0, "reward": 8.0,
                                       "policy_scoring": 4.0, "update": 8.0})
    assert it.rollout_s == pytest.approx(10.0) and it.wait_s == pytest.approx(2.0)
    # Update: 1 epoch x 2 passes x 4 sequences x 10 tokens / 10 tok/s = 8 s.
    assert it.update_s == pytest.approx(8.0) and it.total_s == pytest.approx(18.0)
    assert it.critical == "workers"
    assert it.threads == {"trainer": 1, "llama_engine": 2, "ref": 1, "reward": 1}
    assert it.where["reference"] == it.where["reward"] == "worker"


def test_adapter_off_reference_runs_in_the_trainers_sequence_and_delays_the_reward_submit(small_cfg, rates):
    it = iteration_time(small_cfg(), rates, Placement("adapter_off", "llamacpp", "hf"), cores=2, logical=2)
    # One local worker: trainer 1 thread. Chunk 1: gen 0-2, ref forward 20 / 20 = 1 s (2-3), the
    # reward submitted at 3 runs 3-7, scoring 3-5. Chunk 2: gen 5-7, ref 7-8, reward 8-12
    # (submitted at 8), scoring 8-10. Rollout ends at 12; update 8.
    assert it.rollout_s == pytest.approx(12.0) and it.wait_s == pytest.approx(2.0)
    assert it.phases["reference"] == pytest.approx(2.0) and it.where["reference"] == "trainer"
    assert it.total_s == pytest.approx(20.0)


def test_everything_on_the_trainer_gets_all_cores(small_cfg, rates):
    it = iteration_time(small_cfg(), rates, Placement("adapter_off", "adapter", "hf"), cores=2, logical=2)
    # No local worker: the trainer has both cores. Per chunk: gen 8 / 8 = 1, ref 20 / 40 = 0.5,
    # reward 0.5, scoring 40 / 40 = 1: 3 s; two chunks 6 s. Update 80 / 20 = 4 s.
    assert it.threads["trainer"] == 2
    assert it.rollout_s == pytest.approx(6.0) and it.wait_s == 0.0 and it.critical == "trainer"
    assert it.total_s == pytest.approx(10.0)


def test_grpo_scores_and_updates_with_one_forward(small_cfg, rates):
    it = iteration_time(small_cfg("algorithm=grpo", "group.size=2"), rates, cores=2, logical=2)
    assert it.phases["policy_scoring"] == pytest.approx(2.0)  # 1 forward x 40 tokens / 20
    assert it.update_s == pytest.approx(4.0)  # 1 pass x 40 tokens / 10


def test_the_llamacpp_engine_generates_at_its_own_rate(small_cfg, rates):
    it = iteration_time(small_cfg(), rates, Placement("llamacpp", "llamacpp", "llamacpp"), cores=2, logical=2)
    assert it.phases["generation"] == pytest.approx(16.0)  # 16 new tokens at 1 tok/s (2 threads: all logical cores)


def test_an_explicit_thread_setting_wins_over_the_split(small_cfg, rates):
    it = iteration_time(small_cfg("ref.threads=2"), Throughputs(**{**rates.__dict__, "worker_ref": {1: 10.0}}),
                        cores=2, logical=2)
    # ref at 2 threads: the 1-thread figure scaled linearly, 20 tok/s: 1 s per chunk.
    assert it.threads["ref"] == 2 and it.phases["reference"] == pytest.approx(2.0)


def test_rates_scale_linearly_from_the_nearest_measured_thread_count():
    rates = Throughputs(worker_ref={2: 100.0, 4: 300.0}, worker_reward={1: 50.0}, llama_gen={}, trainer_gen={0: 7.0},
                        trainer_forward={}, trainer_train={})
    assert rates.rate("worker_ref", 4) == 300.0
    assert rates.rate("worker_ref", 3) == pytest.approx(225.0)  # equidistant: the larger, 300 x 3 / 4
    assert rates.rate("worker_ref", 1) == pytest.approx(50.0)
    assert rates.rate("worker_reward", 3) == pytest.approx(150.0)
    assert rates.rate("trainer_gen", 0) == 7.0
    assert Throughputs.from_dict(rates.to_dict()) == rates


def test_the_gpu_rates_give_back_the_h200_measurements():
    """The GPU defaults are the H200 runs' figures (docs/time.md): the time model gives back each
    measured phase of the 7B PPO run and, from the same per-layer decode cost, the 1.5B GRPO run's
    generation (also 28 layers)."""
    from homerlhf.config import load_config
    from homerlhf.memory.shapes import BUILTIN_SHAPES
    from homerlhf.memory.gpu_rates import GPU_SOURCE
    from homerlhf.memory.timing import default_throughputs

    def run(model, *extra):  # as scripts/validate_memory_gpu.py runs it; the reward an in-process function
        cfg = load_config("4090", None, ["rollout.batch_size=32", "rollout.chunk_size=16", "rollout.generation_chunk=null",
                                          "ppo.mini_batch_size=16", "ppo.epochs=1", "card.name=NVIDIA H200", *extra])
        rates = default_throughputs(BUILTIN_SHAPES[model], cfg, cores=2)
        return iteration_time(cfg, rates, Placement("adapter_off", "function", "hf"), cores=2, logical=2), rates

    # 2026-12-04 (bf16 compute, TF32, the captured loop; benchmarks/gpu_generation.py's 7B iteration): 32 prompts
    # in one chunk of 32: generation 6.43 s, scoring 2.80 s, update 8.75 s.
    it, rates = run("Qwen/Qwen2.5-7B", "rollout.generation_chunk=32")
    assert GPU_SOURCE in rates.source and rates.gen_chunk == 16
    # 256 steps x (28 x 0.65 ms + 30.45 GB / 4.8 TB/s + 16 x 2 x 7.07 G / 3.72e14 FLOP/s) = 256 x 25.15 ms
    step = 28 * 0.65e-3 + 30.45e9 / 4.8e12 + 16 * 2 * 7.070e9 / 3.72e14
    assert it.phases["generation"] == pytest.approx(256 * step, rel=1e-3) == pytest.approx(6.43, rel=0.01)
    # scoring: reference + actor + critic forwards of 32 x 768 tokens; the update 2 passes, forward + backward
    assert it.phases["reference"] + it.phases["policy_scoring"] == pytest.approx(2.80, rel=0.01)
    assert it.update_s == pytest.approx(8.75, rel=0.01)
    # 2026-11-30 (the fp32 upcast, HF generate at chunk 16): generation 42-44 s (2 chunks x 256 steps x 28 layers
    # x 3.0 ms), scoring 4.5-4.7 s, update 11.3 s; the 1.5B GRPO run's generation 19-22 s (one chunk of 16).
    old = ("quant.upcast_non_quantized=true", "rollout.decoder=hf")
    it, _ = run("Qwen/Qwen2.5-7B", *old)
    assert it.phases["generation"] == pytest.approx(2 * 256 * 28 * 3.0e-3) and 42 <= it.phases["generation"] <= 44
    assert 4.5 <= it.phases["reference"] + it.phases["policy_scoring"] <= 4.7
    assert it.update_s == pytest.approx(11.3, rel=0.01)
    grpo, _ = run("Qwen/Qwen2.5-1.5B", "algorithm=grpo", "group.size=4", "rollout.batch_size=16", *old)
    assert 19 <= grpo.phases["generation"] <= 22


def test_a_gpu_generation_figure_scales_with_the_chunk_up_to_the_forward_rate():
    rates = Throughputs(worker_ref={}, worker_reward={}, llama_gen={}, trainer_gen={0: 200.0},
                        trainer_forward={0: 1000.0}, trainer_train={0: 300.0}, gen_chunk=16)
    # A launch-bound decode step takes as long for 40 rows as for 16: 40 / 16 x 200 tokens/s.
    assert rates.generation_rate(0, 40) == pytest.approx(500.0)
    assert rates.generation_rate(0, 8) == pytest.approx(100.0)
    assert rates.generation_rate(0, 160) == pytest.approx(1000.0)  # never above a forward over as many tokens
    cpu = Throughputs(**{**rates.__dict__, "gen_chunk": 0})
    assert cpu.generation_rate(0, 40) == 200.0  # a CPU figure is the run's own chunk's
    assert Throughputs.from_dict(rates.to_dict()) == rates


def test_a_consumer_card_gets_the_h200_rates_scaled_by_its_published_flops_and_bandwidth():
    """Qwen2.5-7B (28 layers, hidden 3584, MLP 18944, 4 KV heads of 128, vocab 152,064): 233.05 M
    linear weights a layer, 6.525 G in all, 0.545 G in the output projection; 7.070 G matmul
    parameters a token. A decode step of 16 rows moves 4.5 B x 6.525 G + 2 B x 0.545 G = 30.45 GB."""
    from homerlhf.config import load_config
    from homerlhf.memory.shapes import BUILTIN_SHAPES
    from homerlhf.memory.gpu_rates import decode_step_s
    from homerlhf.memory.timing import default_throughputs

    shape = BUILTIN_SHAPES["Qwen/Qwen2.5-7B"]
    assert shape.linear_weight_params == 28 * 233_046_016
    moved = 4.5 * 28 * 233_046_016 + 2.0 * 152_064 * 3584  # 30.45 GB

    def rates(preset, *extra):
        return default_throughputs(shape, load_config(preset, None, list(extra)), cores=2)

    r4090, r3060 = rates("4090"), rates("3060-12g")
    h200 = rates("4090", "card.name=NVIDIA H200")
    # Forward and update are compute-bound: the H200's effective 3.72e14 / 2.38e14 FLOP/s (bf16 compute, a
    # policy's own kernels) times the card's share of the H200's 989.5 dense BF16 TFLOPS: 4090 165.2
    # (0.1670), 3060 25.4 (0.0257); with the fp32 upcast the 2026-11-30 run's 2.27e14 / 1.85e14.
    forward_4090 = 3.72e14 * 165.2 / 989.5 / (2 * 7.070e9)  # 4,392 tokens/s
    assert r4090.trainer_forward[0] == pytest.approx(forward_4090, rel=1e-3) and forward_4090 == pytest.approx(4392, rel=1e-3)
    assert r3060.trainer_forward[0] == pytest.approx(3.72e14 * 25.4 / 989.5 / (2 * 7.070e9), rel=1e-3)  # 675
    assert r3060.trainer_train[0] == pytest.approx(2.38e14 * 25.4 / 989.5 / (6 * 7.070e9), rel=1e-3)  # 144
    upcast = rates("4090", "quant.upcast_non_quantized=true")
    assert upcast.trainer_train[0] == pytest.approx(1.85e14 * 165.2 / 989.5 / (6 * 7.070e9), rel=1e-3)  # 728
    assert h200.trainer_forward[0] / r4090.trainer_forward[0] == pytest.approx(989.5 / 165.2)
    # A decode step of 16 rows, the captured loop (rollout.decoder auto on CUDA): 28 layers x 0.65 ms = 18.2 ms,
    # + 30.45 GB at the card's bandwidth + 16 x 2 x 7.07 G FLOPs: H200 18.2 + 6.34 + 0.61 = 25.15 ms, 4090
    # 18.2 + 30.21 + 3.64 = 52.05 ms, 3060 18.2 + 84.58 + 23.66 = 126.4 ms.
    flops = 16 * 2 * 7.070e9
    assert decode_step_s(shape) == pytest.approx(0.0182 + moved / 4.8e12 + flops / 3.72e14, rel=1e-3)
    assert decode_step_s(shape) == pytest.approx(0.02515, rel=1e-3)
    assert decode_step_s(shape, card_spec("RTX 4090")) == pytest.approx(0.05205, rel=1e-3)
    assert decode_step_s(shape, card_spec("RTX 3060 12GB")) == pytest.approx(0.1264, rel=1e-3)
    assert r4090.trainer_gen[0] == pytest.approx(16 / decode_step_s(shape, card_spec("RTX 4090")))
    # HF generate (rollout.decoder=hf): the launches (28 x 2.35 ms = 65.8 ms) bound the H200 and the 4090 (its
    # bytes 30.2 ms); at 360 GB/s the 3060's bytes take 84.6 ms and bound it.
    hf = rates("4090", "rollout.decoder=hf")
    assert decode_step_s(shape, decoder="hf") == pytest.approx(0.0658) and hf.trainer_gen[0] == pytest.approx(16 / 0.0658)
    assert decode_step_s(shape, card_spec("RTX 3060 12GB"), "hf") == pytest.approx(moved / 360e9) == pytest.approx(0.0846, rel=1e-3)
    assert decode_step_s(shape, decoder="hf", upcast=True) == pytest.approx(0.084)  # 3.0 ms a layer, 2026-11-30
    assert r4090.source.startswith("GPU: H200 figures scaled to the RTX 4090 by its published specs "
                                   "(165.2 vs 989.5 TFLOPS, 1.01 vs 4.8 TB/s), not measured on one")
    # A card with no published figures here keeps the H200's, and says so.
    other = default_throughputs(shape, load_config("4090", None, ["card.name=My card"]), cores=2)
    assert other.trainer_forward == h200.trainer_forward
    assert "an NVIDIA H200's figures (2026-12-04), not scaled to 'My card'" in other.source


def test_durations_read_as_a_person_says_them():
    from homerlhf.memory.timing import human_seconds

    assert [human_seconds(s) for s in (0.043, 42.04, 89.9, 450.0, 5399.0, 11_520.0, 463_393.0)] == [
        "0.04 s", "42.0 s", "89.9 s", "7.5 min", "90.0 min", "3.2 h", "5.4 days"]
