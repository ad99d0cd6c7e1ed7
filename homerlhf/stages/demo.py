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
    "checkpoint.every=8",
]
N_SAMPLES = 6  # rows of the before/after sample table printed to the terminal
PROBE_SAMPLES = 16  # rollout samples per iteration whose replies the task's checker scores
KL_BUDGET = 4.0  # nats per response: the KL under which the demo calls an improvement alignment
ALIGN_MARGIN = 0.25  # held-out checker accuracy gain (absolute) that counts as improved


def demo_config(out: Path, fast: bool, seed: int = 0) -> RunConfig:
    overrides = [f"output_dir={out}", f"seed={seed}", f"logging.samples_per_iteration={PROBE_SAMPLES}",
                 *(FAST_OVERRIDES if fast else [])]
    return load_config("cpu-tiny", overrides=overrides)


def _log(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def _read_samples(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "samples.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []


def probe_accuracy(samples: list[dict[str, Any]]) -> dict[int, float]:
    """Per iteration, the fraction of the logged rollout replies the task's checker calls good."""
    from homerlhf.data import builtin

    hits: dict[int, list[bool]] = {}
    for row in samples:
        topic = builtin.topic_of(row["prompt"])
        if topic is not None:
            hits.setdefault(row["iteration"], []).append(builtin.score_reply(topic, row["response"]) > 0)
    return {it: sum(h) / len(h) for it, h in sorted(hits.items())}


def plot_reward_curve(metrics: list[dict[str, Any]], out_png: Path,
                      accuracy: dict[int, float] | None = None) -> Path:
    """Score (mean ± std), the checker's accuracy on the rollout probe and KL per iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [row["iteration"] for row in metrics]
    mean = [row["score_mean"] for row in metrics]
    std = [row.get("score_std") or 0.0 for row in metrics]
    fig, (ax_score, ax_acc, ax_kl) = plt.subplots(1, 3, figsize=(14, 3.6))
    ax_score.plot(its, mean, marker="o", color="tab:green", label="score mean")
    ax_score.fill_between(its, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                          color="tab:green", alpha=0.15, label="± std")
    ax_score.set(title="Reward-model score", xlabel="PPO iteration", ylabel="score")
    ax_score.legend(loc="lower right")
    accuracy = accuracy or {}
    ax_acc.plot(list(accuracy), list(accuracy.values()), marker="o", color="tab:blue",
                label=f"checker accuracy ({PROBE_SAMPLES} rollout replies)")
    ax_acc.set(title="Task checker: polite + on-topic", xlabel="PPO iteration", ylabel="fraction", ylim=(-0.05, 1.05))
    ax_acc.legend(loc="lower right")
    ax_kl.plot(its, [row["kl_mean"] for row in metrics], marker="o", color="tab:purple", label="KL (nats/seq)")
    ax_kl.axhline(KL_BUDGET, color="tab:red", linestyle="--", label="KL budget")
    ax_kl.set(title="KL(actor || reference)", xlabel="PPO iteration", ylabel="nats per response")
    ax_kl.legend(loc="upper left")
    for ax in (ax_score, ax_acc, ax_kl):
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def before_after(checkpoint: Path, cfg: RunConfig) -> list[dict[str, Any]]:
    """The SFT policy (adapter off) and the PPO actor on every held-out prompt, in one batch per side,
    prompt ``i`` sampled with seed ``seed * 1000 + i`` on both sides, with the response cap PPO
    trained with (the reward worker's context is sized for it). The held-out split is the one the
    builtin SFT and reward models were trained without (split seed 0)."""
    from homerlhf.data import builtin
    from homerlhf.models.side_by_side import EvalModels, Sampling
    from homerlhf.stages.scorers import scoring_reward

    _, held_out = builtin.split_examples()
    models = EvalModels(cfg, checkpoint, reward=scoring_reward)
    try:
        sampling = Sampling(max_new_tokens=cfg.rollout.max_new_tokens)
        answers = models.answer_many([ex.prompt for ex in held_out], sampling,
                                     seeds=[cfg.seed * 1000 + i for i in range(len(held_out))])
        eos = models.tokenizer.eos_token_id
    finally:
        models.close()
    rows = []
    for example, (after, before) in zip(held_out, answers):
        row: dict[str, Any] = {"prompt": example.prompt, "topic": example.topic}
        for side, answer in (("before", before), ("after", after)):
            row.update({
                side: answer.text, f"{side}_score": answer.score,
                f"{side}_good": builtin.score_reply(example.topic, answer.text) > 0,
                f"{side}_well_formed": builtin.well_formed(answer.text),
                f"{side}_truncated": eos not in answer.response_ids,
            })
        rows.append(row)
    return rows


def held_out_figures(rows: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """(before, after) means over the held-out rows: checker accuracy, RM score, fluency, truncation."""
    def mean(key: str) -> float:
        return sum(float(r[key]) for r in rows) / len(rows)

    return {
        "checker accuracy (polite + on-topic)": (mean("before_good"), mean("after_good")),
        "reward-model score": (mean("before_score"), mean("after_score")),
        "well formed (whole task sentences)": (mean("before_well_formed"), mean("after_well_formed")),
        "truncated (no stop token)": (mean("before_truncated"), mean("after_truncated")),
    }


def verdict(figures: dict[str, tuple[float, float]], final_kl: float, margin: float = ALIGN_MARGIN,
            kl_budget: float = KL_BUDGET) -> tuple[bool, str]:
    """Whether alignment improved: checker accuracy up by ``margin`` with the final KL within budget."""
    before, after = figures["checker accuracy (polite + on-topic)"]
    gained, within = after - before >= margin, final_kl <= kl_budget
    if gained and within:
        return True, (f"alignment improved: checker accuracy {before:.2f} -> {after:.2f} (>= +{margin:.2f}) "
                      f"with final KL {final_kl:.2f} <= budget {kl_budget:.1f} nats/response")
    reasons = [] if gained else [f"checker accuracy {before:.2f} -> {after:.2f} is not up by {margin:.2f}"]
    reasons += [] if within else [f"final KL {final_kl:.2f} is over the budget {kl_budget:.1f} nats/response"]
    return False, "alignment did NOT improve: " + "; ".join(reasons)


def write_samples_markdown(rows: list[dict[str, Any]], figures: dict[str, tuple[float, float]],
                           verdict_line: str, path: Path) -> Path:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ") or "(empty)"

    lines = [f"# Before / after PPO on {len(rows)} held-out prompts", "", f"**{verdict_line}**", "",
             "| figure | before PPO (SFT) | after PPO |", "|---|---|---|"]
    lines += [f"| {name} | {b:.3f} | {a:.3f} |" for name, (b, a) in figures.items()]
    lines += ["", "| prompt | before PPO (SFT) | score | after PPO | score |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {cell(r['prompt'])} | {cell(r['before'])} | {r['before_score']:+.2f} "
                     f"| {cell(r['after'])} | {r['after_score']:+.2f} |")
    path.write_text("\n".join(lines) + "\n")
    return path


def print_summary(rows: list[dict[str, Any]], figures: dict[str, tuple[float, float]], verdict_line: str,
                  metrics: list[dict[str, Any]], times: dict[str, float], rm_accuracy: float | None,
                  out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    samples = Table(title=f"Before / after PPO (first {N_SAMPLES} of {len(rows)} held-out prompts, same seed)",
                    show_lines=True)
    for col in ("prompt", "before (SFT)", "score", "after (PPO)", "score"):
        samples.add_column(col, overflow="fold")
    for r in rows[:N_SAMPLES]:
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
    summary.add_row("KL at the last iteration (nats/response)", f"{metrics[-1]['kl_mean']:.3f} (budget {KL_BUDGET:.1f})")
    for name, (before, after) in figures.items():
        summary.add_row(f"held-out ({len(rows)}) {name}: before -> after", f"{before:.3f} -> {after:.3f}")
    summary.add_row("outputs", str(out))
    console.print(summary)
    console.print(verdict_line, markup=False)


def run_demo(out: str | Path = "runs/demo", fast: bool = False, overwrite: bool = False,
             seed: int = 0) -> dict[str, Any]:
    """Run the demo into ``out``; returns the PPO metrics, before/after rows and artifact paths."""
    from homerlhf.models.registry import resolve_model
    from homerlhf.ppo.metrics import read_metrics
    from homerlhf.stages.ppo import prepare_run_dir, run_ppo

    out = Path(out)
    prepare_run_dir(out, overwrite)  # refuse an earlier run before spending minutes on models
    cfg = demo_config(out, fast, seed)
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

    _log("4/4 reward curve and the held-out evaluation before/after PPO")
    t0 = time.perf_counter()
    curve = plot_reward_curve(metrics, out / "reward_curve.png", probe_accuracy(_read_samples(out)))
    rows = before_after(result["checkpoint"], cfg)
    figures = held_out_figures(rows)
    improved, verdict_line = verdict(figures, metrics[-1]["kl_mean"])
    samples_md = write_samples_markdown(rows, figures, verdict_line, out / "before_after.md")
    (out / "before_after.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    times["held-out evaluation + plot"] = time.perf_counter() - t0
    print_summary(rows, figures, verdict_line, metrics, times, rm_accuracy, out)
    return {"metrics": metrics, "before_after": rows, "figures": figures, "improved": improved,
            "reward_curve": curve, "samples": samples_md, "rm_accuracy": rm_accuracy, "run_dir": out}
