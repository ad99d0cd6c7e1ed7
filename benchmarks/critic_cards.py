"""What a critic of its own buys on the cards (issue 43): plans, not runs (nothing here ran on a GPU).

    python benchmarks/critic_cards.py [--preset 4090] [--models Qwen/Qwen2.5-7B,...]

For each policy with the critic on its base (a LoRA, the default) and with a smaller model of its family as
the critic (``critic.model``), on the preset's card: the plan's peak and verdict at the preset's settings,
the predicted seconds per iteration (:func:`homerlhf.memory.placement.placed_plan`, default throughputs:
the H200's scaled to the card), the largest ``ppo.micro_batch_size`` that fits at the preset's lengths
(``ppo.mini_batch_size`` raised with it), and the largest prompt + response (the preset's 2:1 split, steps
of 96 tokens) that fits at the preset's micro-batch. "Fits" is the plan's: 10% of the card free.
"""

from __future__ import annotations

import argparse

# Smaller models of each family in the planner's builtin table (homerlhf.memory.shapes.BUILTIN_SHAPES).
FAMILY_CRITICS = {"Qwen/Qwen2.5": ("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-1.5B"),
                  "meta-llama/Llama-3": ("meta-llama/Llama-3.2-1B",)}
DEFAULT_MODELS = {"4090": "Qwen/Qwen2.5-7B,Qwen/Qwen2.5-14B,mistralai/Mistral-Small-24B-Base-2501",
                  "3060-12g": "Qwen/Qwen2.5-1.5B,Qwen/Qwen2.5-3B,meta-llama/Llama-3.2-3B,Qwen/Qwen2.5-7B"}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="4090")
    ap.add_argument("--models", default=None, help="comma-separated (default: the preset's list above)")
    return ap.parse_args()


def critics_for(model: str) -> list:
    smaller = next((c for family, c in FAMILY_CRITICS.items() if model.startswith(family)), ())
    return [None, *(c for c in smaller if c != model)]


def config(preset: str, model: str, critic, *extra: str):
    from homerlhf.config import load_config

    return load_config(preset, None, [f"model.name_or_path={model}", *([f"critic.model={critic}"] if critic else []),
                                      *extra])


def fits(cfg, shape) -> bool:
    from homerlhf.memory.planner import plan

    return plan(cfg, shape, with_suggestion=False).status == "fits"


def largest(preset: str, model: str, critic, shape) -> tuple:
    """(largest micro-batch at the preset's lengths, largest prompt + response at its micro-batch), None when none fits."""
    base = config(preset, model, critic)
    micro = None
    for m in (1, 2, 4, 8, 16, 32, 64):
        mini = max(m, base.ppo.mini_batch_size)
        if mini <= base.rollout.batch_size and fits(config(preset, model, critic, f"ppo.micro_batch_size={m}",
                                                           f"ppo.mini_batch_size={mini}"), shape):
            micro = m
    length = None
    for total in range(96, 16384 + 1, 96):
        prompt = total * 2 // 3
        if not fits(config(preset, model, critic, f"rollout.max_prompt_len={prompt}",
                           f"rollout.max_new_tokens={total - prompt}"), shape):
            break
        length = total
    return micro, length


def main() -> None:
    from homerlhf.memory.placement import placed_plan
    from homerlhf.memory.shapes import resolve_shape

    args = parse_args()
    models = (args.models or DEFAULT_MODELS.get(args.preset, "Qwen/Qwen2.5-7B")).split(",")
    print(f"preset {args.preset}; predicted, not run on a GPU")
    print("| policy | critic | peak GiB (generation / scoring / update) | verdict | s / iteration (update) | "
          "largest micro-batch | largest prompt + response |")
    print("|---|---|---|---|---|---:|---:|")
    for model in models:
        shape = resolve_shape(model)
        for critic in critics_for(model):
            planned = placed_plan(config(args.preset, model, critic), shape)
            phases = " / ".join(f"{p.total_gib:.2f}" for p in planned.phases)
            time = planned.timing.current.time
            micro, length = largest(args.preset, model, critic, shape)
            print(f"| {model} | {critic or 'LoRA on the policy base'} | {phases} | {planned.status} "
                  f"({planned.headroom_gib:+.2f} GiB) | {time.total_s:.1f} ({time.update_s:.1f}) | {micro or '-'} "
                  f"| {length or '-'} |")


if __name__ == "__main__":
    main()
