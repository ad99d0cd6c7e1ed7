"""The builtin demo task learned four ways from the same SFT model, side by side (issue 44, item 3).

    python benchmarks/demo_methods.py [--seeds 0] [--methods grpo,ppo,dpo,kto] [--out runs/demo_methods]

Each method runs as a user runs it, a fresh ``python -m homerlhf.cli`` process per method and seed,
on the models of ``HOMERLHF_CACHE`` (built first, once, and timed apart, so each method's time is its
own with the models cached):

- ``grpo``: ``homerlhf demo``, the builtin demo itself: RL with the reward model ``builtin:demo-rm``
  (GRPO on the PPO trainer, :data:`homerlhf.stages.demo.RECIPE`);
- ``ppo``: the same demo recipe with ``algorithm=ppo`` (actor + critic, GAE, the KL in the reward),
  run by this script's ``--child ppo`` (the demo's CLI has no switch for it);
- ``dpo``, ``kto``: ``homerlhf demo --method dpo|kto`` (:mod:`homerlhf.stages.demo_preference`): TRL
  on the task's preference pairs, no reward model, no sampling during training.

Every method is read the same way: the demo's held-out evaluation (8 answers to each of the 40
held-out prompts per side at temperature 0.7: the task's checker, the well-formed check) and the KL to
the SFT model measured on those answers (:func:`homerlhf.stages.demo_preference.answer_log_ratio`,
nats per answer); the RL runs' own last-iteration KL (the verdict's) is shown beside it. Prints the
table and writes ``OUT/demo_methods.json``; each run keeps its directory and log under ``OUT``.
Set ``OMP_NUM_THREADS`` and ``ATEN_CPU_CAPABILITY`` in the environment as for any run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

METHODS = ("grpo", "ppo", "dpo", "kto")
# The demo recipe as PPO: one reply per prompt, a critic, the KL coefficient in the reward.
PPO_OVERRIDES = ["algorithm=ppo", "group.size=1", "group.kl_in=reward", "group.dr_grpo=false"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0", help="comma-separated seeds, e.g. 0,1,2")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--out", type=Path, default=Path("runs/demo_methods"))
    ap.add_argument("--child", choices=["ppo"], help=argparse.SUPPRESS)  # one PPO run, in its own process
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        ap.error(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--seeds {args.seeds!r}: give whole numbers separated by commas, e.g. 0,1,2")
    return args


def ppo_child(out: Path, seed: int) -> None:
    """The demo's RL with ``algorithm=ppo``: the demo's config, run, evaluation and verdict."""
    from homerlhf.config import load_config
    from homerlhf.ppo.metrics import read_metrics
    from homerlhf.stages import demo
    from homerlhf.stages.ppo import run_ppo

    cfg = load_config("cpu-tiny", overrides=[*demo.RECIPE, *PPO_OVERRIDES, f"output_dir={out}", f"seed={seed}",
                                             f"logging.samples_per_iteration={demo.PROBE_SAMPLES}"])
    result = run_ppo(cfg, out_dir=out, overwrite=True)
    rows = demo.before_after(result["checkpoint"], cfg, scored=False)
    (out / "before_after.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, line = demo.verdict(demo.held_out_figures(rows), read_metrics(out)[-1]["kl_mean"])
    print(line, flush=True)


def _command(method: str, out: Path, seed: int) -> list[str]:
    if method == "ppo":
        return [sys.executable, __file__, "--child", "ppo", "--seed", str(seed), "--out", str(out)]
    extra = ["--method", method] if method in ("dpo", "kto") else []
    return [sys.executable, "-m", "homerlhf.cli", "demo", *extra, "--seed", str(seed), "--out", str(out), "--overwrite"]


def build_models(methods: list[str]) -> dict[str, float]:
    """Seconds to build (or find cached) the SFT model, and the reward model when an RL method runs."""
    import homerlhf.stages  # noqa: F401 - registers builtin:demo-sft / demo-rm
    from homerlhf.models.registry import resolve_model

    names = ["builtin:demo-sft"] + (["builtin:demo-rm"] if {"grpo", "ppo"} & set(methods) else [])
    seconds = {}
    for name in names:
        t0 = time.perf_counter()
        resolve_model(name)
        seconds[name] = time.perf_counter() - t0
    return seconds


def _checkpoint(out: Path) -> Path:
    from homerlhf.ppo.checkpoint import latest_complete_checkpoint

    return Path(latest_complete_checkpoint(out))


def read_run(method: str, out: Path, seed: int, log: str) -> dict:
    """The figures of one finished run: the held-out rows, its verdict line and the KL on them."""
    from homerlhf.config import from_yaml_file
    from homerlhf.ppo.metrics import read_metrics
    from homerlhf.stages.demo import ACCURACY, WELL_FORMED, held_out_figures
    from homerlhf.stages.demo_preference import answer_log_ratio

    rows = [json.loads(line) for line in (out / "before_after.jsonl").read_text().splitlines() if line]
    figures = held_out_figures(rows)
    verdict = next((line for line in log.splitlines() if line.startswith("alignment ")), "no verdict line")
    checkpoint = _checkpoint(out)
    cfg = from_yaml_file(checkpoint / "config.yaml")
    if method in ("dpo", "kto"):
        kl = json.loads((out / "summary.json").read_text())["kl"]
        run_kl = None
    else:
        kl = answer_log_ratio(checkpoint, cfg, rows)
        run_kl = read_metrics(out)[-1]["kl_mean"]
    return {"method": method, "seed": seed, "checker": list(figures[ACCURACY]), "well_formed": list(figures[WELL_FORMED]),
            "kl_held_out": kl, "kl_last_iteration": run_kl, "improved": verdict.startswith("alignment improved"),
            "verdict": verdict, "n_answers": len(rows)}


def run_one(method: str, seed: int, root: Path) -> dict:
    out = root / f"{method}-s{seed}"
    t0 = time.perf_counter()
    proc = subprocess.run(_command(method, out, seed), capture_output=True, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seconds = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    (root / f"{method}-s{seed}.log").write_text(log)
    if proc.returncode != 0:
        return {"method": method, "seed": seed, "error": (proc.stderr.strip().splitlines() or ["?"])[-1],
                "seconds": seconds}
    return {**read_run(method, out, seed, log), "seconds": seconds}


def table(results: list[dict]) -> str:
    head = ["method", "seed", "held-out checker", "well formed", "KL to SFT (held-out answers)",
            "KL, last RL iteration", "verdict", "time (models cached)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['seed']} | failed: {r['error']} |")
            continue
        (c0, c1), (w0, w1) = r["checker"], r["well_formed"]
        last = f"{r['kl_last_iteration']:.2f}" if r["kl_last_iteration"] is not None else ""
        lines.append(f"| {r['method']} | {r['seed']} | {c0:.3f} -> {c1:.3f} ({c1 - c0:+.3f}) | {w0:.3f} -> {w1:.3f} "
                     f"({w1 - w0:+.3f}) | {r['kl_held_out']:.2f} | {last} | "
                     f"{'improved' if r['improved'] else 'NOT improved'} | {r['seconds']:.0f} s |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child == "ppo":
        ppo_child(args.out, args.seed)
        return
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    builds = build_models(args.methods)
    results = []
    for seed in args.seeds:
        for method in args.methods:
            results.append(run_one(method, seed, args.out))
            print(table(results[-1:]).splitlines()[-1], flush=True)
    setting = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
               "model_builds_s": builds}
    (args.out / "demo_methods.json").write_text(json.dumps({**setting, "runs": results}, indent=1) + "\n")
    print(f"torch kernels {setting['cpu_capability']}, {setting['threads']} thread(s); model builds: "
          + ", ".join(f"{k} {v:.0f} s" for k, v in builds.items()))
    print(table(results))


if __name__ == "__main__":
    main()
