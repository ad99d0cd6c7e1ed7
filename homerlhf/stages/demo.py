"""`homerlhf demo`: the whole pipeline offline on CPU, with what it did shown and plotted.

tiny tokenizer + Llama built from code -> SFT on the builtin task -> reward model on its preference
pairs -> PPO with the llama.cpp reference and reward workers -> reward curve, before/after samples
and a summary table. The SFT and reward models are the cached ``builtin:demo-sft`` /
``builtin:demo-rm`` builds, so a second demo goes straight to PPO.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from homerlhf.config import RunConfig, load_config
from homerlhf.errors import UserError

# --fast: fewer, smaller iterations (CI); full: the cpu-tiny preset as it is.
FAST_OVERRIDES = [
    "ppo.iterations=8",
    "rollout.batch_size=32",
    "rollout.chunk_size=16",
    "rollout.max_new_tokens=20",
    "checkpoint.every=8",
]
N_SAMPLES = 6


def demo_config(out: Path, fast: bool) -> RunConfig:
    overrides = [f"output_dir={out}", *(FAST_OVERRIDES if fast else [])]
    return load_config("cpu-tiny", overrides=overrides)


def _log(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def plot_reward_curve(metrics: list[dict[str, Any]], out_png: Path) -> Path:
    """Score (mean ± std) and KL per iteration, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [row["iteration"] for row in metrics]
    mean = [row["score_mean"] for row in metrics]
    std = [row.get("score_std") or 0.0 for row in metrics]
    fig, (ax_score, ax_kl) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_score.plot(its, mean, marker="o", color="tab:green", label="score mean")
    ax_score.fill_between(its, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                          color="tab:green", alpha=0.15, label="± std")
    ax_score.set(title="Reward-model score", xlabel="PPO iteration", ylabel="score")
    ax_score.legend(loc="lower right")
    ax_kl.plot(its, [row["kl_mean"] for row in metrics], marker="o", color="tab:purple", label="KL (nats/seq)")
    ax_kl.set(title="KL(actor || reference)", xlabel="PPO iteration", ylabel="nats per response")
    ax_kl.legend(loc="upper left")
    for ax in (ax_score, ax_kl):
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def before_after(checkpoint: Path, cfg: RunConfig) -> list[dict[str, Any]]:
    """The SFT policy (adapter off) and the PPO actor on the same held-out prompts and seeds,
    with the response cap PPO trained with (the reward worker's context is sized for it)."""
    from homerlhf.data import builtin
    from homerlhf.models.side_by_side import EvalModels, Sampling
    from homerlhf.stages.ppo import scoring_reward

    seed = cfg.seed
    _, held_out = builtin.split_examples(seed)
    models = EvalModels(cfg, checkpoint, reward=scoring_reward)
    rows = []
    try:
        for i, example in enumerate(held_out[:N_SAMPLES]):
            after, before = models.answer_both(example.prompt, Sampling(max_new_tokens=cfg.rollout.max_new_tokens, seed=seed + i))
            rows.append({
                "prompt": example.prompt,
                "before": before.text, "before_score": before.score,
                "before_good": builtin.score_reply(example.topic, before.text) > 0,
                "after": after.text, "after_score": after.score,
                "after_good": builtin.score_reply(example.topic, after.text) > 0,
            })
    finally:
        models.close()
    return rows


def write_samples_markdown(rows: list[dict[str, Any]], path: Path) -> Path:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ") or "(empty)"

    lines = ["| prompt | before PPO (SFT) | score | after PPO | score |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {cell(r['prompt'])} | {cell(r['before'])} | {r['before_score']:+.2f} "
                     f"| {cell(r['after'])} | {r['after_score']:+.2f} |")
    path.write_text("\n".join(lines) + "\n")
    return path


def print_summary(rows: list[dict[str, Any]], metrics: list[dict[str, Any]], times: dict[str, float],
                  rm_accuracy: float | None, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    samples = Table(title="Before / after PPO (held-out prompts, same seed)", show_lines=True)
    for col in ("prompt", "before (SFT)", "score", "after (PPO)", "score"):
        samples.add_column(col, overflow="fold")
    for r in rows:
        samples.add_row(r["prompt"], r["before"], f"{r['before_score']:+.2f}", r["after"], f"{r['after_score']:+.2f}")
    console.print(samples)

    k = max(1, len(metrics) // 4)
    first = sum(m["score_mean"] for m in metrics[:k]) / k
    last = sum(m["score_mean"] for m in metrics[-k:]) / k
    summary = Table(title="homerlhf demo summary")
    summary.add_column("what")
    summary.add_column("value", justify="right")
    for stage, seconds in times.items():
        summary.add_row(f"time: {stage}", f"{seconds:.0f} s")
    if rm_accuracy is not None:
        summary.add_row("reward model held-out pairwise accuracy", f"{rm_accuracy:.3f}")
    summary.add_row(f"PPO score, first {k} iterations", f"{first:+.3f}")
    summary.add_row(f"PPO score, last {k} iterations", f"{last:+.3f}")
    summary.add_row("KL at the last iteration (nats/response)", f"{metrics[-1]['kl_mean']:.3f}")
    good_before = sum(r["before_good"] for r in rows)
    good_after = sum(r["after_good"] for r in rows)
    summary.add_row("polite + on-topic samples before -> after", f"{good_before}/{len(rows)} -> {good_after}/{len(rows)}")
    summary.add_row("outputs", str(out))
    console.print(summary)


def run_demo(out: str | Path = "runs/demo", fast: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Run the demo into ``out``; returns the PPO metrics, before/after rows and artifact paths."""
    from homerlhf.models.registry import resolve_model
    from homerlhf.ppo.metrics import read_metrics
    from homerlhf.stages.ppo import prepare_run_dir, run_ppo

    out = Path(out)
    prepare_run_dir(out, overwrite)  # refuse an earlier run before spending minutes on models
    cfg = demo_config(out, fast)
    times: dict[str, float] = {}

    _log("1/4 tokenizer + tiny Llama + SFT on the builtin polite/on-topic task")
    t0 = time.perf_counter()
    resolve_model(cfg.model.name_or_path)
    times["SFT (tiny model, built once then cached)"] = time.perf_counter() - t0

    _log("2/4 reward model on the builtin preference pairs (+ GGUF export for llama.cpp)")
    t0 = time.perf_counter()
    rm_dir = Path(resolve_model(cfg.reward.model))
    times["reward model (built once then cached)"] = time.perf_counter() - t0
    rm_summary = json.loads((rm_dir / "reward_run.json").read_text())
    rm_accuracy = rm_summary.get("eval_accuracy")
    if rm_accuracy is not None:
        _log(f"reward model held-out pairwise accuracy: {rm_accuracy:.3f}")

    _log(f"3/4 PPO: {cfg.ppo.iterations} iterations x {cfg.rollout.batch_size} prompts; "
         "reference and reward in llama.cpp CPU workers")
    t0 = time.perf_counter()
    result = run_ppo(cfg, out_dir=out, overwrite=True)
    times["PPO"] = time.perf_counter() - t0
    metrics = read_metrics(out)
    if not metrics:
        raise UserError(f"PPO wrote no metrics to {out}/metrics.jsonl; see the messages above")

    _log("4/4 reward curve and before/after samples")
    t0 = time.perf_counter()
    curve = plot_reward_curve(metrics, out / "reward_curve.png")
    rows = before_after(result["checkpoint"], cfg)
    samples_md = write_samples_markdown(rows, out / "before_after.md")
    (out / "before_after.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    times["samples + plot"] = time.perf_counter() - t0
    print_summary(rows, metrics, times, rm_accuracy, out)
    return {"metrics": metrics, "before_after": rows, "reward_curve": curve, "samples": samples_md,
            "rm_accuracy": rm_accuracy, "run_dir": out}
