"""Rollout tokens/s of the hf and llamacpp engines side by side (a benchmark, not a test).

    python benchmarks/rollout_engines.py [--model builtin:demo-sft] [--batch 16] [--new-tokens 24]
                                         [--rounds 3] [--outtype f16] [--threads 0] [--iterations 4]

Both engines sample the same prompts (the demo task's) from the same NF4 policy: ``hf`` with the
actor's own ``generate``, ``llamacpp`` on the KL-consistent export with the actor's LoRA swapped in
(the swap is timed apart). Each round generates ``--batch`` responses; the first round of each
engine is a warm-up and not counted. Prints tokens/s per engine and their ratio. ``--model``
defaults to ``builtin:tiny-llama`` (the demo's base shape, built from code in seconds); pass
``builtin:demo-sft`` for the trained demo policy.

Then (``--iterations`` > 0) whole PPO iterations with the llamacpp engine, synchronous and
asynchronous (``rollout.async``: the next batch sampled in a background thread while this one
updates), adapter-off reference and a reward function in process: the mean seconds per iteration
after the first (the async run's first samples its own batch), with the thread split printed. On
CPU the engine's threads and torch's compete for the same cores.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def timed_rounds(engine, prompts, rollout, rounds: int) -> tuple[float, int]:
    """Seconds and response tokens over ``rounds`` generations after one warm-up."""
    engine.generate(prompts, rollout)
    seconds, tokens = 0.0, 0
    for _ in range(rounds):
        t0 = time.perf_counter()
        batch = engine.generate(prompts, rollout)
        seconds += time.perf_counter() - t0
        tokens += int(batch.response_mask.sum())
    return seconds, tokens


def iteration_seconds(cfg, model_path: str, prompts, iterations: int) -> tuple[float, float]:
    """Mean seconds per PPO iteration after the first, and mean seconds waiting for the batch."""
    from homerlhf.models.policy import PolicyModel
    from homerlhf.ppo.backends import AdapterOffReference, Backends, CallableReward
    from homerlhf.ppo.trainer import RLTrainer, seed_everything
    from homerlhf.workers.rollout_engine import llamacpp_engine

    seed_everything(0)
    policy = PolicyModel.from_config(cfg, model_path)
    with tempfile.TemporaryDirectory() as tmp:
        engine = llamacpp_engine(cfg, policy, model_path, Path(tmp))
        try:
            trainer = RLTrainer(cfg, policy, Backends(AdapterOffReference(policy), CallableReward(lambda p, r: len(r) / 10), engine),
                                 prompts)
            rows = trainer.train(iterations + 1)[1:]
        finally:
            engine.close()
    return (sum(r["time_iteration_s"] for r in rows) / len(rows),
            sum(r["time_generation_s"] for r in rows) / len(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-llama")
    parser.add_argument("--batch", type=int, default=16, help="responses per round (= rollout.chunk_size)")
    parser.add_argument("--new-tokens", type=int, default=24, help="rollout.max_new_tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16", "q8_0"])
    parser.add_argument("--threads", type=int, default=0, help="llama.cpp threads (0: all cores)")
    parser.add_argument("--iterations", type=int, default=4, help="PPO iterations per mode, sync vs async (0: skip)")
    args = parser.parse_args()

    import torch

    from homerlhf.config import load_config
    from homerlhf.models.policy import PolicyModel
    from homerlhf.models.registry import resolve_model
    from homerlhf.ppo.engines import HFEngine
    from homerlhf.ppo.trainer import seed_everything
    from homerlhf.stages.ppo import load_prompt_ids
    from homerlhf.workers.rollout_engine import llamacpp_engine

    model_path = resolve_model(args.model)
    cfg = load_config("cpu-tiny", overrides=[
        f"model.name_or_path={args.model}", "ref.backend=adapter_off", "reward.backend=hf", "logging.progress=false",
        f"rollout.batch_size={args.batch}", f"rollout.chunk_size={args.batch}",
        f"rollout.max_new_tokens={args.new_tokens}", "rollout.engine=llamacpp",
        f"rollout.engine_outtype={args.outtype}", f"rollout.engine_threads={args.threads}",
    ])
    seed_everything(0)
    policy = PolicyModel.from_config(cfg, model_path)
    prompts = load_prompt_ids(cfg, policy.tokenizer)[: args.batch]
    print(f"model {args.model}   {args.batch} responses x <= {args.new_tokens} new tokens   "
          f"torch threads {torch.get_num_threads()}   llama.cpp {args.outtype}, threads {args.threads or 'all'}")

    results = {}
    results["hf"] = timed_rounds(HFEngine(policy), prompts, cfg.rollout, args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        engine = llamacpp_engine(cfg, policy, model_path, Path(tmp))
        try:
            t0 = time.perf_counter()
            engine.sync(policy)
            swap_s = time.perf_counter() - t0
            results["llamacpp"] = timed_rounds(engine, prompts, cfg.rollout, args.rounds)
        finally:
            engine.close()

    print(f"{'engine':>9} {'seconds':>8} {'tokens':>7} {'tokens/s':>9}")
    speed = {}
    for name, (seconds, tokens) in results.items():
        speed[name] = tokens / seconds
        print(f"{name:>9} {seconds:8.2f} {tokens:7d} {speed[name]:9.1f}")
    print(f"llamacpp / hf: {speed['llamacpp'] / speed['hf']:.2f}x   (LoRA adapter write + swap: {swap_s * 1e3:.0f} ms)")
    if args.iterations <= 0:
        return
    print(f"\nPPO iterations, llamacpp engine: torch threads {torch.get_num_threads()}, engine threads "
          f"{args.threads or 'all'}, of {os.cpu_count()} logical cores")
    print(f"{'mode':>6} {'s/iteration':>12} {'s waiting for the batch':>24}")
    for mode in ("sync", "async"):
        mode_cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"async_": mode == "async"}),
                                          "ppo": cfg.ppo.model_copy(update={"mini_batch_size": args.batch,
                                                                            "micro_batch_size": args.batch})})
        seconds, waiting = iteration_seconds(mode_cfg, model_path, prompts, args.iterations)
        print(f"{mode:>6} {seconds:12.2f} {waiting:24.2f}")


if __name__ == "__main__":
    main()
