"""`homerlhf demo --algorithm grpo|rloo|ppo`: RL with a verifiable reward, offline on CPU.

The builtin addition task (:mod:`homerlhf.data.builtin_math`): a tiny Llama after a short SFT
(``builtin:math-sft``, built once then cached) answers a few percent of "What is a + b?" right; the
reward is the task's own checker (``reward.function: builtin:math``, 1 for the right sum, else 0),
no reward model. RL then trains on the training problems, and the demo measures what it taught on
held-out problems it never practised on: accuracy of sampled answers (temperature 1, the policy RL
optimises) before and after, on every held-out problem, ``EVAL_SAMPLES`` samples each.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from homerlhf.config import RunConfig, load_config
from homerlhf.errors import UserError

ALGORITHMS = ("grpo", "rloo", "ppo")
RECIPE = [
    "model.name_or_path=builtin:math-sft",
    "data.prompts=builtin:math",
    "reward.backend=function",
    "reward.function=builtin:math",
    "rollout.max_prompt_len=24",
    "rollout.max_new_tokens=6",
    "rollout.batch_size=64",
    "rollout.chunk_size=64",
    "ppo.mini_batch_size=32",
    "ppo.micro_batch_size=32",
    "ppo.epochs=1",
    "ppo.kl_coef=0.02",
    "actor.lr=3e-3",
    "critic.lr=3e-3",
    "ppo.iterations=15",
    "checkpoint.every=15",
]
GROUP_SIZE = 8  # samples per prompt for grpo / rloo: 8 problems x 8 answers per iteration
FAST_OVERRIDES = ["ppo.iterations=8", "checkpoint.every=8"]
EVAL_SAMPLES = 4  # sampled answers per held-out problem
MARGIN = 0.10  # held-out accuracy gain (absolute) the summary calls an improvement


def math_demo_config(out: Path, algorithm: str, fast: bool = False, seed: int = 0) -> RunConfig:
    """The cpu-tiny preset with the verifiable task's recipe for ``algorithm``."""
    if algorithm not in ALGORITHMS:
        raise UserError(f"demo --algorithm {algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
    group = [f"ppo.group_size={GROUP_SIZE}"] if algorithm != "ppo" else []
    return load_config("cpu-tiny", overrides=[
        *RECIPE, f"algorithm={algorithm}", *group, f"output_dir={out}", f"seed={seed}",
        *(FAST_OVERRIDES if fast else [])])


def _log(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


@torch.no_grad()
def held_out_accuracy(policy, cfg: RunConfig, adapter: bool, seed: int) -> float:
    """Fraction of right sampled answers over every held-out problem, ``EVAL_SAMPLES`` each, with the
    RL adapter (``adapter``) or the SFT model underneath it; the same sampling noise for both."""
    from homerlhf.data import builtin_math
    from homerlhf.ppo.rollout import generate_rollout
    from homerlhf.stages.ppo import load_prompt_rows

    held = cfg.model_copy(update={"data": cfg.data.model_copy(update={"prompts": "builtin:math-heldout"})})
    prompts, rows = load_prompt_rows(held, policy.tokenizer)
    prompts = [p for p in prompts for _ in range(EVAL_SAMPLES)]
    rows = [r for r in rows for _ in range(EVAL_SAMPLES)]
    torch.manual_seed(seed)
    right = 0
    for start in range(0, len(prompts), 256):
        chunk = prompts[start : start + 256]
        if adapter:
            batch = generate_rollout(policy, chunk, cfg.rollout)
        else:
            with policy.model.disable_adapter():
                batch = generate_rollout(policy, chunk, cfg.rollout)
        for response, row in zip(batch.response_lists(), rows[start : start + 256]):
            right += builtin_math.check(policy.tokenizer.decode(response, skip_special_tokens=True), row["answer"])
    return right / len(prompts)


def evaluate(cfg: RunConfig, checkpoint: Path) -> dict[str, float]:
    """Held-out accuracy of the SFT model (adapter off) and of the RL policy from ``checkpoint``."""
    from homerlhf.models.policy import PolicyModel
    from homerlhf.models.registry import resolve_model
    from homerlhf.ppo.checkpoint import load_adapters

    policy = PolicyModel.from_config(cfg, resolve_model(cfg.model.name_or_path))
    load_adapters(policy, checkpoint)
    return {"before": held_out_accuracy(policy, cfg, adapter=False, seed=cfg.seed),
            "after": held_out_accuracy(policy, cfg, adapter=True, seed=cfg.seed)}


def plot_accuracy(metrics: list[dict[str, Any]], accuracy: dict[str, float], out_png: Path, title: str) -> Path:
    """Training-batch accuracy (the mean reward) and KL per iteration, the held-out figures as lines."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    its = [m["iteration"] for m in metrics]
    fig = Figure(figsize=(9, 3.2), layout="constrained")
    ax, ax_kl = fig.subplots(1, 2)
    ax.plot(its, [m["score_mean"] for m in metrics], marker="o", label="training batch (reward)")
    ax.axhline(accuracy["before"], color="grey", linestyle="--", label=f"held-out before {accuracy['before']:.2f}")
    ax.axhline(accuracy["after"], color="green", linestyle="--", label=f"held-out after {accuracy['after']:.2f}")
    ax.set(title=f"{title}: accuracy", xlabel="iteration", ylim=(0, 1))
    ax.legend(fontsize=8)
    ax_kl.plot(its, [m["kl_mean"] for m in metrics], marker="o", color="tab:red")
    ax_kl.set(title="KL to the SFT model (nats / response)", xlabel="iteration")
    fig.savefig(out_png, dpi=110)
    return out_png


def run_math_demo(out: str | Path, algorithm: str, fast: bool = False, overwrite: bool = False,
                  seed: int = 0) -> dict[str, Any]:
    """Run the verifiable-task demo into ``out``; returns the metrics, held-out accuracy and paths."""
    from homerlhf.models.registry import resolve_model
    from homerlhf.ppo.metrics import read_metrics
    from homerlhf.stages.ppo import prepare_run_dir, run_ppo

    out = Path(out)
    prepare_run_dir(out, overwrite)
    cfg = math_demo_config(out, algorithm, fast, seed)
    started = time.perf_counter()
    _log("1/3 tiny Llama + a short SFT on the addition task (built once, then cached)")
    resolve_model(cfg.model.name_or_path)
    group = f"{cfg.rollout.batch_size // cfg.ppo.group_size} problems x {cfg.ppo.group_size} answers"
    _log(f"2/3 {algorithm.upper()}: {cfg.ppo.iterations} iterations of {group if algorithm != 'ppo' else '64 problems'}; "
         "reward = the task's checker; reference in a llama.cpp CPU worker")
    result = run_ppo(cfg, out_dir=out, overwrite=True)
    metrics = read_metrics(out)
    if not metrics:
        raise UserError(f"{algorithm} wrote no metrics to {out}/metrics.jsonl; see the messages above")
    _log("3/3 held-out accuracy before/after")
    accuracy = evaluate(cfg, result["checkpoint"])
    curve = plot_accuracy(metrics, accuracy, out / "accuracy_curve.png", algorithm.upper())
    gain = accuracy["after"] - accuracy["before"]
    verdict = (f"{'Improved' if gain >= MARGIN else 'Not improved'}: held-out accuracy "
               f"{accuracy['before']:.3f} -> {accuracy['after']:.3f} ({gain:+.3f}; the bar is +{MARGIN:.2f}), "
               f"final KL {metrics[-1]['kl_mean']:.2f} nats per response")
    summary = {"algorithm": algorithm, "seed": seed, "fast": fast, "held_out_accuracy": accuracy,
               "final_kl": metrics[-1]["kl_mean"], "seconds": round(time.perf_counter() - started, 1),
               "verdict": verdict}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{verdict}\nplot: {curve}   metrics: {out / 'metrics.jsonl'}   took {summary['seconds']:.0f} s")
    return {"metrics": metrics, "accuracy": accuracy, "improved": gain >= MARGIN, "curve": curve, "run_dir": out}
