"""The memory planner's terms for a critic of its own (``critic.model``) against the CPU allocator.

    python benchmarks/planner_cpu_critic.py [--critic-layers 1] [--critic-hidden 256] [--dtype bf16] [--upcast]

As ``benchmarks/planner_cpu_allocations.py`` (same policy, same settings, two PPO iterations under the
profiler, the most bytes alive per phase of the second beside the plan's allocated bytes), with the
critic on a base of its own: a smaller Qwen2 of the same tokenizer (``--critic-layers`` layers of width
``--critic-hidden``, intermediate and heads scaled alike), saved in fp32 and loaded in 4-bit as the
policy is. ``--critic-layers 0`` plans and measures the critic on the policy's base, for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_cpu_allocations import LabelledPhases, build, phase_peaks  # noqa: E402


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 512), ("intermediate", 2816), ("layers", 2), ("heads", 8), ("kv-heads", 2),
                          ("head-dim", 64), ("vocab", 16384), ("prompt", 128), ("new", 32), ("chunk", 16),
                          ("micro", 4), ("critic-layers", 1), ("critic-hidden", 256)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="quant.compute_dtype")
    ap.add_argument("--upcast", action="store_true", help="quant.upcast_non_quantized=true: the fp32 residual stream")
    ap.add_argument("--no-checkpointing", action="store_true", help="training.gradient_checkpointing=false")
    return ap.parse_args()


def critic_args(args) -> argparse.Namespace:
    """The critic's shape: ``--critic-layers`` layers of width ``--critic-hidden``, the rest scaled with it."""
    scale = args.critic_hidden / args.hidden
    return argparse.Namespace(**{**vars(args), "hidden": args.critic_hidden, "layers": args.critic_layers,
                                 "intermediate": int(args.intermediate * scale), "heads": max(1, int(args.heads * scale)),
                                 "kv_heads": max(1, int(args.kv_heads * scale))})


def measure(args, tmp: str):
    """(plan, measured peaks per phase, the critic's config or None)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from homerlhf.config import load_config
    from homerlhf.memory.components import Assumptions
    from homerlhf.memory.planner import plan
    from homerlhf.memory.shapes import shape_from_config
    from homerlhf.models.policy import PolicyModel
    from homerlhf.ppo.backends import AdapterOffReference, Backends, CallableReward
    from homerlhf.ppo.trainer import RLTrainer

    config = build(args, tmp)
    critic_dir = os.path.join(tmp, "critic")
    critic = build(critic_args(args), critic_dir) if args.critic_layers else None
    c = args.chunk
    cfg = load_config("4090", None, [
        f"model.name_or_path={tmp}", "card.device=cpu", f"quant.compute_dtype={args.dtype}",
        f"quant.upcast_non_quantized={str(args.upcast).lower()}",
        f"training.gradient_checkpointing={str(not args.no_checkpointing).lower()}",
        f"rollout.chunk_size={c}", f"rollout.batch_size={2 * c}", f"rollout.generation_chunk={c}",
        f"rollout.max_prompt_len={args.prompt}", f"rollout.max_new_tokens={args.new}",
        f"ppo.mini_batch_size={c}", f"ppo.micro_batch_size={args.micro}", "ppo.epochs=1",
        "actor.optimizer=adamw_8bit", "ref.backend=adapter_off", "reward.backend=hf", "reward.model=in-process",
        "logging.tensorboard=false", "logging.progress=false", *([f"critic.model={critic_dir}"] if critic else [])])
    planned = plan(cfg, shape_from_config(config.to_dict(), "probe", "local"), 0, with_suggestion=False,
                   assumptions=Assumptions(decoder="hf"))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        policy = PolicyModel.from_config(cfg, tmp)
        prompts = torch.randint(8, 512, (2 * c, args.prompt), generator=torch.Generator().manual_seed(0)).tolist()
        trainer = RLTrainer(cfg, policy, Backends(AdapterOffReference(policy), CallableReward(lambda p, r: len(r) / 32)), prompts)
        trainer.meters.memory = LabelledPhases()
        for i in range(2):
            with record_function(f"iteration {i}"):
                trainer.step()
    trace = os.path.join(tmp, "trace.json")
    prof.export_chrome_trace(trace)
    with open(trace) as fh:
        return planned, phase_peaks(json.load(fh)["traceEvents"]), critic


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        planned, measured, critic = measure(args, tmp)
    where = (f"critic of its own: {critic.num_hidden_layers} layer(s), hidden {critic.hidden_size}, intermediate "
             f"{critic.intermediate_size}" if critic else "critic on the policy's base")
    print(f"policy {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}; {where}; compute "
          f"{args.dtype}{' (fp32 upcast)' if args.upcast else ' end to end'}, checkpointing "
          f"{'off' if args.no_checkpointing else 'on'}, chunk {args.chunk} x ({args.prompt} + {args.new}), "
          f"micro-batch {args.micro}")
    for phase in planned.phases:
        got = measured.get(phase.name, 0)
        print(f"{phase.name:<11} planned {phase.allocated_bytes / 2**20:8.2f} MiB  measured {got / 2**20:8.2f} MiB  "
              f"ratio {got / phase.allocated_bytes:.3f}  ({phase.moment})")


if __name__ == "__main__":
    main()
