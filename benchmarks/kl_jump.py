"""What the KL-jump flag (``homerlhf.ppo.guards:KLJump``) sees on healthy runs and on runs driven off
their reference, and whether a ``ppo.early_stop_kl`` bound would stop a healthy run.

Each recipe runs in process on the builtin demo models as ``homerlhf train`` does (``builtin:demo-sft``
as the policy, ``builtin:demo-rm`` in a llama.cpp worker, the reference the NF4 base's export in
another), and records every optimizer step's ``approx_kl`` (the k3 KL(old || new) of its mini-batch:
what ``ppo.early_stop_kl`` is compared with after each step) by wrapping
``homerlhf.ppo.update:Updater.step`` (it records, it changes nothing), and each iteration's
``kl_mean``, ``kl_jump``, ``approx_kl`` and ``kl_flag``. Prints one line per recipe:

- ``demo``: the demo's recipe (``homerlhf.stages.demo:RECIPE``, GRPO, 16 iterations);
- ``cpu-tiny``: the ``cpu-tiny`` preset's own PPO (actor lr 1e-3, 2 epochs, raw scores, 12 iterations);
- ``gpu``: the GPU presets' PPO settings on these models (actor lr 1e-5, critic 5e-5, LoRA r 16,
  1 epoch, normalised scores, adaptive KL towards 6 nats);
- ``off``: driven off its reference by hand: the cpu-tiny PPO at actor lr 3e-2 over 4 epochs;
- ``off-stopped``: the same with ``ppo.early_stop_kl=0.1``.

    python benchmarks/kl_jump.py [--recipes demo,cpu-tiny,gpu,off,off-stopped] [--out DIR]
                                 [--sft DEMO_SFT_RUN --rm DEMO_RM_RUN]

``--sft`` / ``--rm``: demo models built already (a ``builtin/demo-sft-*`` and ``demo-rm-*`` dir of a
model cache), instead of building them here.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

GPU = ["actor.lr=1e-5", "critic.lr=5e-5", "ppo.epochs=1", "ppo.kl_coef=0.05", "ppo.adaptive_kl=true",
       "ppo.target_kl=6.0", "ppo.kl_horizon=10000", "ppo.score_norm=true", "actor.lora.r=16", "actor.lora.alpha=32",
       "critic.lora.r=16", "critic.lora.alpha=32"]
OFF = ["actor.lr=3e-2", "ppo.epochs=4"]
RECIPES = {"demo": None, "cpu-tiny": [], "gpu": GPU, "off": OFF, "off-stopped": [*OFF, "ppo.early_stop_kl=0.1"]}


def config(name: str, out: Path, models: list[str]):
    from homerlhf.config import load_config
    from homerlhf.stages.demo import RECIPE

    overrides = RECIPE if RECIPES[name] is None else RECIPES[name]
    return load_config("cpu-tiny", overrides=[*overrides, *models, "logging.progress=false", "checkpoint.every=100",
                                              f"output_dir={out}"])


def run(name: str, root: Path, models: list[str]) -> str:
    from homerlhf.ppo.update import Updater
    from homerlhf.stages.ppo import run_ppo

    steps: list[float] = []
    original = Updater.step

    def recording(self, *args, **kwargs):
        stats = original(self, *args, **kwargs)
        steps.append(math.nan if stats.get("skipped") else stats["approx_kl"])
        return stats

    Updater.step = recording
    started = time.perf_counter()
    try:
        rows = run_ppo(config(name, root / name, models), out_dir=root / name)["metrics"]
    finally:
        Updater.step = original
    finite = sorted(s for s in steps if math.isfinite(s))
    jumps = [r["kl_jump"] for r in rows if "kl_jump" in r]
    return (f"{name}: {len(rows)} iterations, {len(steps)} steps; step approx_kl max {finite[-1]:.4f}, "
            f"median {finite[len(finite) // 2]:.4f}, above 0.1: {sum(s > 0.1 for s in finite)}, "
            f"above 0.05: {sum(s > 0.05 for s in finite)}; iteration approx_kl max "
            f"{max(r['approx_kl'] for r in rows):.4f}; kl_jump max {max(jumps):.3f}; kl_mean "
            f"{rows[0]['kl_mean']:.3f} -> {rows[-1]['kl_mean']:.3f} (max {max(r['kl_mean'] for r in rows):.3f}); "
            f"flagged iterations {[r['iteration'] for r in rows if r['kl_flag']]}; early-stopped "
            f"{sum(r['early_stopped'] for r in rows)}; score {rows[0]['score_mean']:.2f} -> "
            f"{rows[-1]['score_mean']:.2f}; {time.perf_counter() - started:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--out", type=Path, default=None, help="Run dirs here (default: a temporary dir).")
    parser.add_argument("--sft", type=Path, default=None, help="A built demo-sft run dir (default: builtin:demo-sft).")
    parser.add_argument("--rm", type=Path, default=None, help="A built demo-rm run dir (default: builtin:demo-rm).")
    args = parser.parse_args()
    models = ([f"model.name_or_path={args.sft / 'model'}"] if args.sft else []) + \
        ([f"reward.model={args.rm}"] if args.rm else [])
    import homerlhf.stages  # noqa: F401 - registers builtin:demo-sft and builtin:demo-rm

    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        for name in args.recipes.split(","):
            print(run(name, root, models), flush=True)


if __name__ == "__main__":
    main()
