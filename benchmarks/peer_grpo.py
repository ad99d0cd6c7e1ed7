"""homerlhf GRPO beside TRL's GRPOTrainer: seconds per step and peak RSS, same model, batch and lengths
(a benchmark, not a test).

    python benchmarks/peer_grpo.py [--steps 4] [--prompts 8] [--group 4] [--new-tokens 32] [--threads 2]

Both sides train the same tiny Llama (built from code, seed 0) loaded in NF4 with the same LoRA
(r 16, all linear layers), sample ``--group`` completions for each of ``--prompts`` prompts at
temperature 1 up to ``--new-tokens`` tokens, score them with the same Python reward (distinct
characters / 100), take one optimizer step per generation batch with beta 0.04 (k3 KL in the loss,
the adapter-off base as reference) and the GRPO paper's loss aggregation. Each side runs in its own
process, so its peak RSS is its own; the first step pays one-off costs and is left out of the mean.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def reward_text(text: str) -> float:
    return len(set(text)) / 100.0


def prompts(n: int) -> list[str]:
    from homerlhf.data.builtin import prompt_records

    return [record["prompt"] for record in prompt_records()[:n]]


def run_ours(model_dir: Path, args) -> list[float]:
    from homerlhf.config import load_config
    from homerlhf.models.policy import PolicyModel
    from homerlhf.ppo.backends import AdapterOffReference, CallableReward
    from homerlhf.ppo.trainer import PPOTrainer, seed_everything

    batch = args.prompts * args.group
    cfg = load_config("cpu-tiny", overrides=[
        "algorithm=grpo", f"ppo.group_size={args.group}", "ref.backend=adapter_off", "reward.backend=hf",
        f"rollout.batch_size={batch}", f"rollout.chunk_size={batch}", f"rollout.max_new_tokens={args.new_tokens}",
        f"ppo.mini_batch_size={batch}", f"ppo.micro_batch_size={batch}", "ppo.epochs=1", "ppo.kl_coef=0.04",
        "actor.lora.r=16", "actor.lora.alpha=32", "actor.lr=1e-5", "logging.progress=false",
        "training.gradient_checkpointing=false", "ppo.score_norm=false",
    ])
    seed_everything(0)
    policy = PolicyModel.from_config(cfg, str(model_dir))
    tok = policy.tokenizer
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
           for p in prompts(args.prompts)]
    ids = [list(i["input_ids"] if hasattr(i, "keys") else i) for i in ids]
    reward = CallableReward(lambda p, r: reward_text(tok.decode(r, skip_special_tokens=True)))
    trainer = PPOTrainer(cfg, policy, AdapterOffReference(policy), reward, ids)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - t0)
    return times


def run_trl(model_dir: Path, args) -> list[float]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.start = [], None

        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self.start)

    torch.manual_seed(0)
    batch = args.prompts * args.group
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in prompts(args.prompts)] * args.steps)
    config = GRPOConfig(
        output_dir=str(Path(args.tmp) / "trl"), use_cpu=True, report_to="none", save_strategy="no",
        per_device_train_batch_size=batch, num_generations=args.group, max_completion_length=args.new_tokens,
        max_steps=args.steps, learning_rate=1e-5, beta=0.04, loss_type="grpo", temperature=1.0, num_iterations=1,
        gradient_accumulation_steps=1, logging_steps=1, bf16=False, gradient_checkpointing=False, seed=0,
        disable_tqdm=True, shuffle_dataset=False,
    )
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32)
    clock = Clock()
    trainer = GRPOTrainer(
        model=str(model_dir), reward_funcs=lambda completions, **_: [reward_text(_text(c)) for c in completions],
        args=config, train_dataset=data, quantization_config=quant, callbacks=[clock],
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    trainer.train()
    return clock.times


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from homerlhf.tiny import build_causal_lm

    model_dir = build_causal_lm(Path(args.tmp) / "policy", arch="llama", seed=0)
    times = (run_ours if args.side == "ours" else run_trl)(model_dir, args)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2  # KiB -> GiB
    print(json.dumps({"times": times, "peak_rss_gib": peak}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--side", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        return child(args)
    results = {}
    for side in ("ours", "trl"):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, __file__, "--side", side, "--tmp", tmp, "--steps", str(args.steps),
                   "--prompts", str(args.prompts), "--group", str(args.group), "--new-tokens", str(args.new_tokens),
                   "--threads", str(args.threads)]
            print(f"running {side} ({args.steps} steps) ...", file=sys.stderr, flush=True)
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{side} failed:\n{out.stderr[-3000:]}")
            results[side] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{args.prompts} prompts x {args.group} completions x {args.new_tokens} new tokens, "
          f"{args.threads} threads, steps 2..{args.steps} averaged")
    print(f"{'':>6} {'s/step':>8} {'peak RSS GiB':>13}")
    mean = {}
    for side, r in results.items():
        later = r["times"][1:] or r["times"]
        mean[side] = sum(later) / len(later)
        print(f"{side:>6} {mean[side]:8.2f} {r['peak_rss_gib']:13.2f}")
    print(f"{'ratio':>6} {mean['ours'] / mean['trl']:8.2f} "
          f"{results['ours']['peak_rss_gib'] / results['trl']['peak_rss_gib']:13.2f}   (ours / TRL; <= 1 is the goal)")


if __name__ == "__main__":
    main()
