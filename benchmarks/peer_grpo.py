"""homerlhf beside TRL's GRPOTrainer: seconds per step with each of our rollout engines, the one
``rollout.engine: auto`` takes, and the ratio to TRL, in one run (a benchmark, not a test).

    python benchmarks/peer_grpo.py [--runs 3] [--steps 4] [--prompts 8] [--group 4] [--new-tokens 32]
                                   [--threads 2] [--algorithm ppo|grpo] [--engines hf,llamacpp] [--set KEY=VALUE]

Both sides train the same tiny Llama (built from code, seed 0) loaded in NF4 with the same LoRA
(r 16, all linear layers, fp32 compute), sample ``--prompts`` x ``--group`` completions per step at
temperature 1 up to ``--new-tokens`` tokens, score them with the same Python reward (distinct
characters / 100), take one optimizer step per generation batch (lr 1e-5) with a KL of 0.04 to the
adapter-off base. TRL: ``GRPOTrainer`` at its defaults otherwise (HF generate on the CPU), beta 0.04,
the GRPO loss. Ours: the cpu-tiny preset at its defaults otherwise: ``--algorithm ppo`` (the preset's:
PPO with its critic, ``--prompts`` x ``--group`` prompts a step, one epoch, the KL in the reward) or
``grpo`` (groups of ``--group``, the KL in the loss); reference ``adapter_off`` (TRL's reference too);
``rollout.engine`` each of ``--engines``, and which of them ``auto`` takes on this machine
(``homerlhf.stages.autoplan:resolve_auto``, by ``homerlhf bench``'s cached figures or the defaults,
printed); ``--set KEY=VALUE`` adds an override of ours (then the figures are no longer the defaults').
Each side runs in its own process, one after another, ``--runs`` times (interleaved, so a
change in the machine's load touches every side alike); in each run the first step pays one-off
costs and is left out of the mean; the median over runs is reported, with the CPU and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
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


def our_config(model_dir: Path, args, engine: str):
    """The cpu-tiny preset with the workload above and ``engine`` (the preset's engine threads: 1)."""
    from homerlhf.config import load_config

    batch = args.prompts * args.group
    algorithm = ["algorithm=grpo", f"group.size={args.group}", "group.kl_in=loss"] if args.algorithm == "grpo" \
        else ["algorithm=ppo"]
    return load_config("cpu-tiny", overrides=[
        *algorithm, f"model.name_or_path={model_dir}", "ref.backend=adapter_off", "reward.backend=hf",
        f"rollout.batch_size={batch}", f"rollout.chunk_size={batch}", f"rollout.max_new_tokens={args.new_tokens}",
        f"ppo.mini_batch_size={batch}", f"ppo.micro_batch_size={batch}", "ppo.epochs=1", "ppo.kl_coef=0.04",
        "ppo.adaptive_kl=false", "actor.lora.r=16", "actor.lora.alpha=32", "actor.lr=1e-5",
        "logging.progress=false", f"rollout.engine={engine}", *args.set,
    ])


def choose_engine(model_dir: Path, args) -> dict:
    """What ``rollout.engine: auto`` takes for our side here, and the lines it prints."""
    from homerlhf.stages.autoplan import resolve_auto

    said: list[str] = []
    cfg = resolve_auto(our_config(model_dir, args, "auto"), reward_given=True, say=said.append)
    return {"engine": cfg.rollout.engine, "lines": said}


def run_ours(model_dir: Path, args) -> dict:
    from homerlhf.models.policy import PolicyModel
    from homerlhf.ppo.backends import Backends, CallableReward
    from homerlhf.ppo.trainer import RLTrainer, seed_everything
    from homerlhf.stages.scorers import build_engine, build_reference

    cfg = our_config(model_dir, args, args.side.removeprefix("ours-"))
    seed_everything(0)
    policy = PolicyModel.from_config(cfg, str(model_dir))
    tok = policy.tokenizer
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
           for p in prompts(args.prompts)]
    ids = [list(i["input_ids"] if hasattr(i, "keys") else i) for i in ids]
    reward = CallableReward(lambda p, r: reward_text(tok.decode(r, skip_special_tokens=True)))
    engine = build_engine(cfg, policy, str(model_dir), Path(args.tmp) / "run")
    try:
        # The reference as a run builds it (adapter-off, in micro-batches of ppo.micro_batch_size).
        reference = build_reference(cfg, policy, str(model_dir), Path(args.tmp) / "run")
        trainer = RLTrainer(cfg, policy, Backends(reference, reward, engine), ids)
        times, generation = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            row = trainer.step()
            times.append(time.perf_counter() - t0)
            generation.append(row["time_generation_s"])
    finally:
        engine.close()
    return {"times": times, "generation": generation}


def run_trl(model_dir: Path, args) -> dict:
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
    return {"times": clock.times}


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from homerlhf.tiny import build_causal_lm

    model_dir = build_causal_lm(Path(args.tmp) / "policy", arch="llama", seed=0)
    if args.side == "choose":
        result = choose_engine(model_dir, args)
    else:
        result = (run_trl if args.side == "trl" else run_ours)(model_dir, args)
        result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2  # KiB -> GiB
    print(json.dumps(result))


def run_side(side: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, __file__, "--side", side, "--tmp", tmp, "--steps", str(args.steps),
               "--prompts", str(args.prompts), "--group", str(args.group), "--new-tokens", str(args.new_tokens),
               "--threads", str(args.threads), "--algorithm", args.algorithm, *(f"--set={item}" for item in args.set)]
        out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{side} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def later_mean(values: list[float]) -> float:
    """Mean of the steps after the first (the first pays one-off costs), or of all when there is one."""
    later = values[1:] or values
    return sum(later) / len(later)


def machine_line() -> str:
    from homerlhf.memory.threads import physical_cores
    from homerlhf.workers.bench import cpu_name

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{cpu_name()}, {physical_cores()} physical cores, {os.cpu_count()} logical; load average {load}"


def report(results: dict[str, list[dict]], chosen: str, args) -> None:
    """Per side: seconds per step of each run, the median, our generation seconds, peak RSS, vs TRL."""
    print(f"{args.prompts} prompts x {args.group} completions x {args.new_tokens} new tokens, {args.threads} threads; "
          f"ours: {args.algorithm}{' with its critic' if args.algorithm == 'ppo' else ''}; "
          f"steps 2..{args.steps} averaged per run, median of {args.runs} runs"
          + (f"; ours with --set {' '.join(args.set)}" if args.set else ""))
    median = {side: statistics.median(later_mean(r["times"]) for r in runs) for side, runs in results.items()}
    print(f"{'side':>14} {'s/step per run':>22} {'median':>7} {'gen s':>6} {'RSS GiB':>8} {'vs TRL':>7}")
    for side, runs in results.items():
        per_run = " ".join(f"{later_mean(r['times']):.2f}" for r in runs)
        gen = (f"{statistics.median(later_mean(r['generation']) for r in runs):6.3f}" if "generation" in runs[0]
               else f"{'-':>6}")
        rss = max(r["peak_rss_gib"] for r in runs)
        print(f"{side:>14} {per_run:>22} {median[side]:7.2f} {gen} {rss:8.2f} {median[side] / median['trl']:6.2f}x")
    default = f"ours-{chosen}"
    sides = f"ours with --set {' '.join(args.set)}" if args.set else "defaults on both sides"
    print(f"{sides}: rollout.engine auto takes {chosen} here: "
          f"{median[default]:.2f} s per step against TRL's {median['trl']:.2f} s, "
          f"{median[default] / median['trl']:.2f}x (<= 0.7x is issue 46's goal)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--algorithm", choices=["ppo", "grpo"], default="ppo")
    parser.add_argument("--engines", default="hf,llamacpp", help="our rollout engines to time, comma-separated")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for our side (e.g. critic.shared_adapter=true), after the workload's")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        return child(args)
    print(f"machine: {machine_line()}", flush=True)
    choice = run_side("choose", args)
    for line in choice["lines"]:
        print(line)
    engines = [e for e in args.engines.split(",") if e]
    if choice["engine"] not in engines:
        engines.append(choice["engine"])
    sides = ["trl", *(f"ours-{e}" for e in engines)]
    results: dict[str, list[dict]] = {side: [] for side in sides}
    for run in range(args.runs):
        for side in sides:
            print(f"run {run + 1}/{args.runs}: {side} ({args.steps} steps) ...", file=sys.stderr, flush=True)
            results[side].append(run_side(side, args))
    print(f"machine after: {machine_line()}")
    report(results, choice["engine"], args)


if __name__ == "__main__":
    main()
