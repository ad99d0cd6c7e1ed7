"""Per-stage wall times and tokens/s of PPO iterations on the tiny model (a benchmark, not a test).

    python benchmarks/ppo_step.py [--iterations 3] [--batch 16] [--new-tokens 24] [--device cpu]

Runs the real loop (NF4 base, LoRA actor + critic, adapter-off reference, an in-process tiny HF
reward model) and prints one row per iteration plus the mean of the iterations after the first
(the first pays one-off costs).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

STAGES = ("generation", "scoring", "reference_reward_wait", "advantages", "update")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="rollout.batch_size")
    parser.add_argument("--chunk", type=int, default=8, help="rollout.chunk_size")
    parser.add_argument("--new-tokens", type=int, default=24, help="rollout.max_new_tokens")
    parser.add_argument("--micro", type=int, default=8, help="ppo.micro_batch_size")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shared-adapter", action="store_true")
    args = parser.parse_args()

    from homerlhf.config import load_config
    from homerlhf.models.policy import PolicyModel
    from homerlhf.ppo.backends import AdapterOffReference, Backends, HFReward
    from homerlhf.ppo.trainer import RLTrainer, seed_everything
    from homerlhf.stages.ppo import load_prompt_ids
    from homerlhf.tiny import build_causal_lm, build_sequence_classifier

    with tempfile.TemporaryDirectory() as tmp:
        policy_dir = build_causal_lm(Path(tmp) / "policy", arch="llama", seed=0)
        rm_dir = build_sequence_classifier(Path(tmp) / "rm", arch="llama", seed=1)
        cfg = load_config("cpu-tiny", overrides=[
            f"card.device={args.device}", "ref.backend=adapter_off", "reward.backend=hf", f"reward.model={rm_dir}",
            f"rollout.batch_size={args.batch}", f"rollout.chunk_size={args.chunk}",
            f"rollout.max_new_tokens={args.new_tokens}", f"ppo.mini_batch_size={args.batch}",
            f"ppo.micro_batch_size={args.micro}", "ppo.epochs=1", "logging.progress=false",
            f"critic.shared_adapter={str(args.shared_adapter).lower()}",
        ])
        seed_everything(0)
        t0 = time.perf_counter()
        policy = PolicyModel.from_config(cfg, str(policy_dir))
        prompts = load_prompt_ids(cfg, policy.tokenizer)
        reward = HFReward(str(rm_dir), device=args.device)
        print(f"load: {time.perf_counter() - t0:.2f} s   device: {args.device}   "
              f"batch {args.batch} x {args.new_tokens} new tokens, micro-batch {args.micro}")
        trainer = RLTrainer(cfg, policy, Backends(AdapterOffReference(policy), reward), prompts)
        header = f"{'iter':>4} " + " ".join(f"{s[:10]:>10}" for s in STAGES) + \
            f" {'total':>7} {'gen tok/s':>10} {'score tok/s':>11} {'upd tok/s':>10} {'peak GiB':>9}"
        print(header)
        rows = []
        try:
            for _ in range(args.iterations):
                row = trainer.step()
                rows.append(row)
                peak = max(v for k, v in row.items() if k.startswith("peak_mem_") and isinstance(v, float))
                print(f"{row['iteration']:>4} " + " ".join(f"{row[f'time_{s}_s']:>10.3f}" for s in STAGES)
                      + f" {row['time_iteration_s']:>7.2f} {row['tokens_per_s_generation']:>10.1f}"
                      f" {row['tokens_per_s_scoring']:>11.1f} {row['tokens_per_s_update']:>10.1f} {peak:>9.3f}")
        finally:
            reward.close()
            trainer.meters.memory.close()
        steady = rows[1:] or rows
        mean = {k: sum(r[k] for r in steady) / len(steady) for k in steady[0] if isinstance(steady[0][k], (int, float))}
        print("mean " + " ".join(f"{mean[f'time_{s}_s']:>10.3f}" for s in STAGES)
              + f" {mean['time_iteration_s']:>7.2f} {mean['tokens_per_s_generation']:>10.1f}"
              f" {mean['tokens_per_s_scoring']:>11.1f} {mean['tokens_per_s_update']:>10.1f}")


if __name__ == "__main__":
    main()
