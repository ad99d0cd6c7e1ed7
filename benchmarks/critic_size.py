"""What a smaller critic costs in learning (issue 43): PPO on a demo task once per critic, side by side.

    python benchmarks/critic_size.py [--task verifiable|demo] [--seeds 0,1,2] [--fast] [--critics ...] [--out DIR]
                                     [--iterations N]

The same seed, recipe and SFT policy for every critic; only ``critic.model`` differs.

``--task verifiable`` (the default): ``homerlhf demo --algorithm ppo`` (the digit-reversal task, the
checker as the reward, :mod:`homerlhf.stages.demo_verifiable`), critics

- ``base``: the default, a LoRA critic on the policy's own 4-bit base (tiny Llama, 4 layers of width 128);
- ``small``: ``critic.model``, a Llama of half the layers and width (2 of 64) on the same tokenizer, built
  from code and SFT'd on the task as the policy was (``homerlhf.stages.builtin``'s reverse-sft recipe): a
  smaller model of the policy's family;
- ``random``: the same half-size model as built from code, before any SFT.

The task's reward is a function, so there is no reward model to initialise a critic from there.

``--task demo``: the builtin demo task (``homerlhf demo``: ``builtin:demo-sft`` as the policy, the reward
model ``builtin:demo-rm`` in a llama.cpp worker) under PPO: the demo's recipe
(:data:`homerlhf.stages.demo.RECIPE`, 16 iterations) with ``algorithm=ppo`` and its GRPO-only settings
undone (:data:`DEMO_PPO`: one reply per prompt, 32 prompts an iteration, the KL in the reward at 0.3), critics

- ``base``: the LoRA critic on the policy's base;
- ``rm``: ``critic.model=builtin:demo-rm``, the reward model's directory (the policy's size; its score head
  initialises the value head);
- ``small``: the half-size Llama SFT'd on the demo's SFT data as ``builtin:demo-sft`` was (its recipe,
  ``homerlhf.stages.builtin.DEMO_SFT``).

Prints a table (per critic and seed: held-out figures before and after, the value loss and explained
variance over the first and last quarter of the iterations, seconds per iteration with the update's and
scoring's, and the iteration's time over the ``base`` run's of the same seed) and writes
``OUT/critic_size.json`` with every iteration's curves and each run's own directory, after every run (a
long benchmark keeps what finished; a run that fails is recorded with its error and the next one runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

TASKS = {"verifiable": ("base", "small", "random"), "demo": ("base", "rm", "small")}
# The demo's RECIPE is GRPO; these make it PPO (a critic, GAE, the KL in the reward), all else as it is.
DEMO_PPO = ("algorithm=ppo", "group.size=1", "group.kl_in=null", "group.dr_grpo=false")
CURVES = ("value_loss", "explained_variance", "score_mean", "kl_mean")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=sorted(TASKS), default="verifiable")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds, e.g. 0,1,2")
    ap.add_argument("--fast", action="store_true", help="verifiable: 40 iterations instead of 80 (the demo's --fast)")
    ap.add_argument("--critics", default=None, help="comma-separated (default: every critic of the task)")
    ap.add_argument("--out", type=Path, default=Path("runs/critic_size"))
    ap.add_argument("--iterations", type=int, default=None,
                    help="RL iterations instead of the recipe's (a short check of this script; not the table's)")
    args = ap.parse_args(argv)
    choices = TASKS[args.task]
    args.critics = [c.strip() for c in (args.critics or ",".join(choices)).split(",") if c.strip()]
    unknown = sorted(set(args.critics) - set(choices))
    if unknown:
        ap.error(f"--critics: unknown {', '.join(unknown)} for --task {args.task}; choose from {', '.join(choices)}")
    if args.iterations is not None and args.iterations < 1:
        ap.error(f"--iterations must be at least 1, got {args.iterations}")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--seeds: integers separated by commas, got {args.seeds!r}")
    return args


def half_size_critic(root: Path, sft: str | None) -> Path:
    """The half-size Llama (2 layers of width 64, the builtin tokenizer), built once under ``root``;
    ``sft``: SFT'd on that task's data by its builtin model's recipe (``reverse``: ``builtin:reverse-sft``'s,
    ``demo``: ``builtin:demo-sft``'s), None: as built from code."""
    from homerlhf.stages.builtin import DEMO_SFT, REVERSE_SFT, demo_config
    from homerlhf.stages.sft import run_sft
    from homerlhf.tiny import build_causal_lm

    raw = root / "half-random"
    if not (raw / "config.json").is_file():
        build_causal_lm(raw, arch="llama", seed=0, hidden=64, layers=2)
    if sft is None:
        return raw
    recipe, data = {"reverse": (REVERSE_SFT, "builtin:reverse-sft"), "demo": (DEMO_SFT, "builtin:demo-sft")}[sft]
    tuned = root / f"half-sft-{sft}"
    if not (tuned / "model" / "config.json").is_file():
        run_sft(demo_config(**recipe), tuned, data=data, base=str(raw), overwrite=True)
    return tuned / "model"


def critic_override(task: str, name: str, root: Path) -> tuple[str, ...]:
    if name == "base":
        return ()
    if name == "rm":
        return ("critic.model=builtin:demo-rm",)
    sft = None if name == "random" else ("reverse" if task == "verifiable" else "demo")
    return (f"critic.model={half_size_critic(root, sft)}",)


def mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else float("nan")


def run_task(task: str, out: Path, seed: int, fast: bool, overrides: tuple[str, ...]) -> dict:
    """One run; the held-out figures as {name: [before, after]} and the final KL."""
    if task == "verifiable":
        from homerlhf.stages.demo_verifiable import run_verifiable_demo

        result = run_verifiable_demo(out, "ppo", fast=fast, overwrite=True, seed=seed, overrides=overrides)
        return {"held_out": {"accuracy": [result["accuracy"]["before"], result["accuracy"]["after"]],
                             **{f"style {k}": [result["style"]["before"][k], result["style"]["after"][k]]
                                for k in ("checked_style", "right_in_style")}},
                "final_kl": result["metrics"][-1]["kl_mean"]}
    from homerlhf.stages.demo import ACCURACY, WELL_FORMED, run_demo

    result = run_demo(out, overwrite=True, seed=seed, overrides=DEMO_PPO + overrides)
    names = {ACCURACY: "checker", WELL_FORMED: "well formed", "reward-model score": "rm score",
             "truncated (no stop token)": "truncated"}
    return {"held_out": {names.get(k, k): list(v) for k, v in result["figures"].items()},
            "final_kl": result["metrics"][-1]["kl_mean"], "improved": result["improved"]}


def run_one(name: str, seed: int, args) -> dict:
    from homerlhf.ppo.metrics import read_metrics

    overrides = critic_override(args.task, name, args.out / "_models")
    if args.iterations is not None:
        overrides += (f"ppo.iterations={args.iterations}", f"checkpoint.every={args.iterations}")
    out = args.out / f"{name}-seed{seed}"
    started = time.perf_counter()
    figures = run_task(args.task, out, seed, args.fast, overrides)
    rows = read_metrics(out)
    q = max(1, len(rows) // 4)
    return {"critic": name, "seed": seed, "overrides": list(overrides), **figures, "iterations": len(rows),
            "window": q, **{key: {"first": mean(rows[:q], key), "last": mean(rows[-q:], key)}
                            for key in ("value_loss", "explained_variance")},
            "s_per_iteration": mean(rows, "time_iteration_s"), "update_s": mean(rows, "time_update_s"),
            "scoring_s": mean(rows, "time_scoring_s"), "seconds": round(time.perf_counter() - started, 1),
            "run_dir": str(out), "curves": {k: [r.get(k) for r in rows] for k in CURVES}}


def table(results: list[dict]) -> list[str]:
    """The markdown table of ``results`` (the failed runs as a line each)."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        return [f"{r['critic']} seed {r['seed']}: {r['error']}" for r in results]
    held = list(ok[0]["held_out"])
    base = {r["seed"]: r["s_per_iteration"] for r in ok if r["critic"] == "base"}
    lines = ["| critic | seed | " + " | ".join(f"{h} before -> after" for h in held)
             + f" | KL last | value loss first / last {ok[0]['window']} | explained variance first / last "
             f"{ok[0]['window']} | s / iteration (update, scoring) | time vs base |",
             "|---|---|" + "---|" * (len(held) + 5)]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['critic']} | {r['seed']} | failed: {r['error']} |")
            continue
        ratio = r["s_per_iteration"] / base[r["seed"]] if r["seed"] in base else float("nan")
        cells = " | ".join(f"{b:.3f} -> {a:.3f} ({a - b:+.3f})" for b, a in (r["held_out"][h] for h in held))
        lines.append(f"| {r['critic']} | {r['seed']} | {cells} | {r['final_kl']:.2f} "
                     f"| {r['value_loss']['first']:.4f} / {r['value_loss']['last']:.4f} "
                     f"| {r['explained_variance']['first']:.3f} / {r['explained_variance']['last']:.3f} "
                     f"| {r['s_per_iteration']:.2f} ({r['update_s']:.2f}, {r['scoring_s']:.2f}) | {ratio:.2f} |")
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:
        for name in args.critics:
            try:
                results.append(run_one(name, seed, args))
            except Exception as exc:  # noqa: BLE001 - a failed run is a row; the next one still runs
                text = str(exc).strip().splitlines()
                results.append({"critic": name, "seed": seed, "error": f"{type(exc).__name__}: {text[-1] if text else ''}"})
            (args.out / "critic_size.json").write_text(json.dumps(
                {"task": args.task, "fast": args.fast, "results": results}, indent=1) + "\n")
    iterations = {r["iterations"] for r in results if "iterations" in r}
    print(f"\nPPO on the {args.task} task, seeds {','.join(map(str, args.seeds))}, "
          f"{'/'.join(map(str, sorted(iterations)))} iterations:")
    print("\n".join(table(results)))
    print(f"curves: {args.out / 'critic_size.json'}")


if __name__ == "__main__":
    main()
