"""What the checkpointing levers buy on a card, by the memory planner (planned, not run on a GPU).

    python benchmarks/checkpointing_levers.py [--preset 4090] [--models Qwen/Qwen2.5-7B,...]

Per model on the preset's card, with the levers off (every layer checkpointed, inputs on the card:
``training.checkpoint_every_n_layers=1 training.activation_offload=false``) and with the presets' ``auto``
(the plan picks the fewest recomputed layers, and offload only where nothing else fits): the verdict at
the preset's settings, the largest micro-batch (a divisor of the mini-batch) at the preset's lengths,
and the largest prompt + response (2:1, in steps of 96 tokens) at micro-batch 1 with the rollout chunk
at 1 (so the scoring forward does not bind first) whose plan fits with the margin, with the phase that
binds 96 tokens later. The reference and
reward run as llama.cpp workers (the placement that leaves the card to what trains), the generation
chunk ``auto``. Then the largest builtin-table model whose plan fits the preset as it is.
"""

from __future__ import annotations

import argparse

LEVERS = {"off": ["training.checkpoint_every_n_layers=1", "training.activation_offload=false"],
          "auto": ["training.checkpoint_every_n_layers=auto", "training.activation_offload=auto"]}
PLACED = ["ref.backend=llamacpp", "reward.backend=llamacpp", "rollout.generation_chunk=auto"]


def planned(preset: str, shape, *extra: str):
    from homerlhf.config import load_config
    from homerlhf.memory.planner import plan

    return plan(load_config(preset, None, PLACED + list(extra)), shape, with_suggestion=False)


def largest(values: list[int], fits) -> int:
    """The largest of ascending ``values`` that fits (fitting falls as they grow), 0 if none does."""
    lo, hi, best = 0, len(values) - 1, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(values[mid]):
            best, lo = values[mid], mid + 1
        else:
            hi = mid - 1
    return best


def row(preset: str, shape, levers: str) -> str:
    from homerlhf.config import load_config

    base = planned(preset, shape, *LEVERS[levers])
    info = base.checkpointing
    mini = load_config(preset).ppo.mini_batch_size
    micro = largest([m for m in range(1, mini + 1) if mini % m == 0],
                    lambda m: bool(planned(preset, shape, *LEVERS[levers], f"ppo.micro_batch_size={m}").fits))
    def at(t: int):
        return planned(preset, shape, *LEVERS[levers], "ppo.micro_batch_size=1", "rollout.chunk_size=1",
                       f"rollout.max_prompt_len={2 * t // 3}", f"rollout.max_new_tokens={t // 3}")

    length = largest(list(range(96, 32 * 1024 + 1, 96)), lambda t: bool(at(t).fits))
    at_max, beyond = at(max(length, 96)), at(length + 96)
    how = f"{info['checkpointed_layers']}/{info['num_layers']}" + (" offloaded" if info["offload"] else "")
    how_max = f"{at_max.checkpointing['checkpointed_layers']}/{at_max.checkpointing['num_layers']}" + \
        (" offloaded" if at_max.checkpointing["offload"] else "")
    return (f"| {shape.name} | {levers} | {how} | {base.status}, peak {base.peak_gib:.2f} GiB ({base.peak.name}) | "
            f"{micro or 'none'} | {length or 'none'} ({how_max}; then {beyond.peak.name} binds) |")


def main() -> None:
    from homerlhf.memory.shapes import BUILTIN_SHAPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="4090")
    ap.add_argument("--models", default="Qwen/Qwen2.5-7B,Qwen/Qwen2.5-14B,mistralai/Mistral-Small-24B-Base-2501",
                    help="comma-separated builtin-table names")
    args = ap.parse_args()
    print(f"preset {args.preset}: | model | levers | recomputed layers | at the preset's settings | "
          "largest micro-batch | largest prompt + response at micro-batch 1, chunk 1 |")
    for name in args.models.split(","):
        for levers in LEVERS:
            print(row(args.preset, BUILTIN_SHAPES[name], levers))
    for levers in LEVERS:
        fitting = [(s.total_params, s.name) for s in BUILTIN_SHAPES.values()
                   if planned(args.preset, s, *LEVERS[levers]).fits]
        print(f"levers {levers}: the largest table model that fits {args.preset} as it is: "
              f"{max(fitting)[1] if fitting else 'none'} ({len(fitting)} of {len(BUILTIN_SHAPES)} fit)")


if __name__ == "__main__":
    main()
