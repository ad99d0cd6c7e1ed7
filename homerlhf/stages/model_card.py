"""The model card (README.md) of an exported policy: what the run was and what the export is.

Base, data, algorithm (also its tag), iterations, the reward and KL of the exported checkpoint's iteration
(a DPO / KTO checkpoint: its data and steps, no reward model, the policy it started from and the margins it
moved), the held-out figures of a run that has them (``homerlhf demo``'s ``before_after.jsonl``, the verifiable
demo's ``summary.json``), the export's base weights, dtype and measured log-prob gap (and what
rounding to a dtype below the policy's cost), and its files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from homerlhf.stages.export_plan import PolicyExport


def _hub_id(name: str) -> Optional[str]:
    """``name`` if it reads as a Hub model id (``org/name``), else None (a local path, a builtin)."""
    if name.startswith(("builtin:", ".", "/", "~")) or name.count("/") != 1 or Path(name).exists():
        return None
    return name


def held_out_lines(run_dir: Path) -> list[str]:
    """Markdown lines of the run's held-out before/after figures, or none."""
    summary, rows_file = Path(run_dir) / "summary.json", Path(run_dir) / "before_after.jsonl"
    if summary.is_file():
        data = json.loads(summary.read_text())
        acc = data.get("held_out_accuracy") or {}
        if "before" in acc and "after" in acc:
            return [f"- held-out accuracy before -> after: {acc['before']:.3f} -> {acc['after']:.3f}"]
    if rows_file.is_file():
        from homerlhf.stages.demo import held_out_figures

        rows = [json.loads(line) for line in rows_file.read_text().splitlines() if line.strip()]
        if rows and "before_good" in rows[0]:
            return [f"- held-out ({len(rows)} prompts) {name}: {b:.3f} -> {a:.3f}"
                    for name, (b, a) in held_out_figures(rows).items()]
    return []


def _metrics_row(run_dir: Path, iteration: int) -> dict[str, Any]:
    from homerlhf.ppo.metrics import read_metrics

    rows = [r for r in read_metrics(run_dir) if r.get("iteration") == iteration]
    return rows[-1] if rows else {}


def _method(plan: PolicyExport, cfg) -> str:
    """The checkpoint's training method: its DPO / KTO ``start.json``'s, else the run's RL algorithm."""
    start = plan.checkpoint / "start.json"
    return json.loads(start.read_text())["method"] if start.is_file() else cfg.algorithm


def _run_lines(plan: PolicyExport, cfg) -> list[str]:
    """What trained the checkpoint: a PPO / GRPO / RLOO run's prompts, reward and iterations, or a DPO / KTO
    run's data, optimizer steps and start (its checkpoint's ``start.json``: homerlhf.stages.preference)."""
    start = plan.checkpoint / "start.json"
    if not start.is_file():
        return [f"- prompts: `{cfg.data.prompts}`",
                f"- algorithm: {cfg.algorithm}, {plan.iteration} of {cfg.ppo.iterations} iterations "
                f"(checkpoint `{plan.checkpoint.name}`), rollout batch {cfg.rollout.batch_size}",
                f"- reward: {_reward_source(cfg)}"]
    info = json.loads(start.read_text())
    learns = "preference pairs" if info["method"] == "dpo" else "answers rated good or bad"
    return [f"- data: {', '.join(f'`{d}`' for d in info['data'])}{_rows_note(plan.run_dir)}",
            f"- algorithm: {info['method']} (TRL), {plan.iteration} optimizer steps (checkpoint `{plan.checkpoint.name}`)",
            f"- reward model: none ({info['method'].upper()} learns from the {learns} themselves)",
            f"- started from: {_start_words(info['start'])}", *_preference_figures(plan.run_dir)]


def _rows_note(run_dir: Path) -> str:
    summary = _preference_summary(run_dir)
    return f" ({summary['n_train']} training rows)" if "n_train" in summary else ""


def _preference_summary(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(run_dir) / "preference_run.json").read_text())
    except (OSError, ValueError):
        return {}


def _start_words(start: dict[str, Any]) -> str:
    """The policy a DPO / KTO run started from, and (a PPO run's checkpoint) what that run trained on."""
    from homerlhf.config import from_yaml_file
    from homerlhf.errors import UserError

    if not start.get("checkpoint"):
        return f"`{start['name']}` ({start['kind']})"
    ckpt = Path(start["checkpoint"])
    where = f"`{ckpt.name}` of `{ckpt.parent.parent.name}` ({start['kind']})"
    try:
        cfg = from_yaml_file(ckpt / "config.yaml")
    except (UserError, OSError):
        return where
    if start["kind"] != "ppo run":
        return where
    return f"{where}: {cfg.algorithm} on the prompts `{cfg.data.prompts}`, reward {_reward_source(cfg)}"


def _preference_figures(run_dir: Path) -> list[str]:
    """The DPO / KTO run's margins before -> after, on the rows it trained on and on its held-out rows."""
    summary, lines = _preference_summary(run_dir), []
    for key, where in (("trained_rows", "training"), ("held_out", "held-out")):
        figures = summary.get(key) or {}
        if "margin_after" in figures:
            lines.append(f"- {where} pairs: margin log p(chosen) - log p(rejected) {figures['margin_before']:+.3f} -> "
                         f"{figures['margin_after']:+.3f} nats")
        if figures.get("good_logp_change") is not None:
            down = figures.get("bad_logp_change")
            lines.append(f"- {where} answers, change of log p under the trained policy: rated up "
                         f"{figures['good_logp_change']:+.3f} nats" + (f", rated down {down:+.3f}" if down is not None else ""))
    return lines


def _reward_source(cfg) -> str:
    reward = cfg.reward
    own = (f"the function `{reward.function}`" if reward.backend == "function"
           else f"the {reward.backend} reward model `{reward.url or reward.model}`")
    return own + (f", plus {len(reward.components)} weighted component(s)" if reward.components else "")


def _front_matter(base: Optional[str], gguf: bool, method: str) -> list[str]:
    lines = ["---", "library_name: transformers", "tags:", "- homerlhf", "- rlhf", f"- {method}"]
    lines += ["- gguf"] if gguf else []
    lines += ["base_model:", f"- {base}"] if base else []
    return lines + ["---", ""]


def model_card(plan: PolicyExport, result: dict[str, Any]) -> str:
    """The README.md text for the export ``plan`` whose outcome is ``result``."""
    cfg, row = plan.cfg, _metrics_row(plan.run_dir, plan.iteration)
    base_name = cfg.model.name_or_path
    method = _method(plan, cfg)
    lines = _front_matter(_hub_id(base_name), bool(result.get("gguf")), method)
    lines += [f"# {plan.name}", "",
              f"A policy trained with [homerlhf](https://github.com/homerlhf/homerlhf) ({method.upper()}, "
              "a LoRA actor on a 4-bit NF4 base), merged into a standalone model.", "",
              "## Training", "",
              f"- base model: `{base_name}`",
              *_run_lines(plan, cfg)]
    for key, what in (("score_mean", "reward (mean score of the iteration's rollouts)"),
                      ("kl_mean", "KL to the reference (nats per response)")):
        if isinstance(row.get(key), (int, float)):
            lines.append(f"- {what} at iteration {plan.iteration}: {row[key]:.4f}" + (
                f" ({cfg.ppo.kl_estimator}: an unbiased estimate, so one batch's mean can fall below 0; the KL itself "
                "cannot)" if key == "kl_mean" and row[key] < 0 else ""))
    lines += held_out_lines(plan.run_dir)
    lines += ["", "## This export", "", *_export_lines(plan, result)]
    for g in result.get("gguf", []):
        lines.append(f"- GGUF `{g['path']}` ({g['tensors']}), Ollama: `{g['modelfile']}`")
    lines += ["", "## Use", "", "```bash", *result["commands"], "```", ""]
    return "\n".join(lines)


def _export_lines(plan: PolicyExport, result: dict[str, Any]) -> list[str]:
    """The card's lines on the export itself: base weights, dtype, measured gap, stop tokens."""
    gap, dtype, compute = result["gap"], result["dtype"], result.get("compute_dtype", result["dtype"])
    exact = ("the dequantized NF4 weights the actor trained on: this is the trained policy up to "
             f"{dtype} rounding" if plan.base == "nf4" else
             "the original full-precision weights, **not** the NF4 weights the actor trained on: "
             "this model differs from the trained policy")
    lines = [f"- merged into {exact}",
             f"- log-prob gap to the trained policy (adapter on the NF4 base) on {gap['sequences']} held "
             f"sequences ({gap['tokens']} tokens): max {gap['max_abs']:.2e}, mean {gap['mean_abs']:.2e} nats/token",
             f"- dtype {dtype} (the policy computed in {compute}); generation stops at "
             f"{', '.join(repr(t) for t in result['stop_tokens'])}"]
    return lines + ([f"- {result['rounding']}"] if result.get("rounding") else [])
