"""What a smaller critic costs in learning (issue 43): the verifiable demo under PPO with each critic.

    python benchmarks/critic_size.py [--seed 0] [--fast] [--critics base,small,random] [--out runs/critic_size]

``homerlhf demo --algorithm ppo`` (the digit-reversal task, the checker as the reward,
:mod:`homerlhf.stages.demo_verifiable`) once per critic, the same seed, recipe and SFT policy:

- ``base``: the default, a LoRA critic on the policy's own 4-bit base (tiny Llama, 4 layers of width 128);
- ``small``: ``critic.model``, a Llama of half the layers and width (2 of 64) on the same tokenizer, built
  from code and SFT'd on the task as the policy was (``homerlhf.stages.builtin``'s reverse-sft recipe): a
  smaller model of the policy's family;
- ``random``: the same half-size model as built from code, before any SFT.

The task's reward is a function, so there is no reward model to initialise a critic from here (the
builtin demo task has one, ``builtin:demo-rm``: ``critic.model=builtin:demo-rm``, not run by this script).
Prints, side by side: held-out accuracy before and after, the value loss and explained variance (first
and last 10 iterations' means), and seconds per iteration (mean, and the update's); writes
``OUT/critic_size.json`` with every iteration's curves and each run's own directory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

CHOICES = ("base", "small", "random")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fast", action="store_true", help="40 iterations instead of 80 (the demo's --fast)")
    ap.add_argument("--critics", default=",".join(CHOICES), help=f"comma-separated, of {', '.join(CHOICES)}")
    ap.add_argument("--out", type=Path, default=Path("runs/critic_size"))
    args = ap.parse_args()
    args.critics = [c.strip() for c in args.critics.split(",") if c.strip()]
    unknown = sorted(set(args.critics) - set(CHOICES))
    if unknown:
        ap.error(f"--critics: unknown {', '.join(unknown)}; choose from {', '.join(CHOICES)}")
    return args


def half_size_critic(root: Path, sft: bool) -> Path:
    """The half-size Llama (2 layers of width 64, the builtin tokenizer), SFT'd on the task like
    ``builtin:reverse-sft`` when ``sft``; built once under ``root``."""
    from homerlhf.stages.builtin import REVERSE_SFT, demo_config
    from homerlhf.stages.sft import run_sft
    from homerlhf.tiny import build_causal_lm

    raw = root / "half-random"
    if not (raw / "config.json").is_file():
        build_causal_lm(raw, arch="llama", seed=0, hidden=64, layers=2)
    if not sft:
        return raw
    tuned = root / "half-sft"
    if not (tuned / "model" / "config.json").is_file():
        run_sft(demo_config(**REVERSE_SFT), tuned, data="builtin:reverse-sft", base=str(raw), overwrite=True)
    return tuned / "model"


def mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else float("nan")


def run_one(name: str, args) -> dict:
    from homerlhf.ppo.metrics import read_metrics
    from homerlhf.stages.demo_verifiable import run_verifiable_demo

    overrides = ()
    if name != "base":
        overrides = (f"critic.model={half_size_critic(args.out / '_models', sft=name == 'small')}",)
    out = args.out / f"{name}-seed{args.seed}"
    started = time.perf_counter()
    result = run_verifiable_demo(out, "ppo", fast=args.fast, overwrite=True, seed=args.seed, overrides=overrides)
    rows = read_metrics(out)
    return {"critic": name, "overrides": list(overrides), "held_out": result["accuracy"],
            **{key: {"first10": mean(rows[:10], key), "last10": mean(rows[-10:], key)}
               for key in ("value_loss", "explained_variance")},
            "s_per_iteration": mean(rows, "time_iteration_s"), "update_s": mean(rows, "time_update_s"),
            "scoring_s": mean(rows, "time_scoring_s"), "seconds": round(time.perf_counter() - started, 1),
            "run_dir": str(out),
            "curves": {k: [r.get(k) for r in rows] for k in ("value_loss", "explained_variance", "score_mean")}}


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.critics:  # written after each run: a long benchmark keeps what finished
        results.append(run_one(name, args))
        (args.out / "critic_size.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nPPO on the verifiable demo, seed {args.seed}, {'40' if args.fast else '80'} iterations:")
    print("| critic | held-out before -> after | value loss first 10 / last 10 | explained variance first 10 / "
          "last 10 | s / iteration (update, scoring) |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['critic']} | {r['held_out']['before']:.3f} -> {r['held_out']['after']:.3f} "
              f"| {r['value_loss']['first10']:.4f} / {r['value_loss']['last10']:.4f} "
              f"| {r['explained_variance']['first10']:.3f} / {r['explained_variance']['last10']:.3f} "
              f"| {r['s_per_iteration']:.2f} ({r['update_s']:.2f}, {r['scoring_s']:.2f}) |")
    print(f"curves: {args.out / 'critic_size.json'}")


if __name__ == "__main__":
    main()
