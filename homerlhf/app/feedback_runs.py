"""*Train on my feedback*: a DPO or KTO run (``homerlhf dpo`` / ``homerlhf kto``) from the evaluated
checkpoint on the feedback collected for it, started as a detached run the way *Start* starts PPO
(:func:`homerlhf.app.runs.start_run`), and what the app shows of such a run.

The run goes beside the run it starts from (``RUNS/<method>-<time>``). Its ``feedback/`` folder holds
``feedback.json`` (what it started from, how much feedback) and the rows it trains on, copied when it
starts (:func:`homerlhf.app.feedback.write_training_data`), with the prompts held out of them when there
are enough (``held_out.jsonl``, its ``--eval-data``). The run's end-of-run figures
(``preference_run.json``: each answer's log-prob under the trained policy and under the one it started
from, on the rows it trained on and on the held-out ones) are what :func:`homerlhf.app.feedback_result.result_markdown` says.

One run at a time: a Start or a feedback run while any run the app can see is running is refused
with a line naming that run (two runs do not fit one GPU; the second would train unseen).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from homerlhf.app import feedback, runs
from homerlhf.app.common import md_text
from homerlhf.errors import UserError

FOLDER = "feedback"
INFO_FILE = "feedback.json"
RESULT_FILE = "preference_run.json"  # homerlhf.stages.preference_start.RUN_FILE, written by the stage
METHODS = ("auto", "dpo", "kto")
# A handful of rows makes one batch: every batch its own optimizer step, and no warm-up step wasted.
DEFAULTS = ("grad_accum=1", "warmup_ratio=0")


def running_run(dirs: Iterable[str | Path]) -> Optional[runs.RunStatus]:
    """The first run that is running among ``dirs`` and the run directories directly under them."""
    seen: set[Path] = set()
    for root in dirs:
        if not root:
            continue
        root = Path(root)
        for path in [root, *runs.list_runs(root)]:
            if path.resolve() in seen or not path.is_dir():
                continue
            seen.add(path.resolve())
            status = runs.run_status(path)
            if status.running:
                return status
    return None


def refuse_if_running(dirs: Iterable[str | Path]) -> None:
    """A one-line refusal naming the running run, if there is one."""
    from homerlhf.app.common import NotStarted

    status = running_run(dirs)
    if status is not None:
        raise NotStarted(f"a run is already running: {status.run_dir} (pid {status.pid}); stop it in the Train tab "
                         "or wait for it to end before starting another (two runs do not fit one GPU)")


def too_small(fb: feedback.Feedback, method: str, cfg) -> Optional[str]:
    """Why ``fb`` is too little for ``method`` (how many more are needed), or None when it is enough."""
    need_pairs, need_rated = cfg.dpo.min_rows, cfg.kto.min_rows
    rated = len(fb.ratings) + 2 * len(fb.pairs)
    dpo = (f"DPO needs at least {need_pairs} preference pairs (dpo.min_rows): {len(fb.pairs)} collected, "
           f"{need_pairs - len(fb.pairs)} more: Left/Right better, or Best of these")
    kto = (f"KTO needs at least {need_rated} rated answers, a pair counting as two (kto.min_rows): {rated} "
           f"collected, {need_rated - rated} more: Thumbs up/down, or pairs")
    if method == "dpo" and len(fb.pairs) < need_pairs:
        return f"Not enough feedback for this policy yet: {dpo}."
    if method == "kto" and rated < need_rated:
        return f"Not enough feedback for this policy yet: {kto}."
    if method == "auto" and len(fb.pairs) < need_pairs and rated < need_rated:
        return f"Not enough feedback for this policy yet: {dpo}; {kto}."
    return None


def pick_method(fb: feedback.Feedback, method: str, cfg) -> str:
    """``auto``: DPO when the pairs suffice, else KTO (ratings, and pairs as good and bad answers)."""
    if method != "auto":
        return method
    return "dpo" if len(fb.pairs) >= cfg.dpo.min_rows else "kto"


def new_run_dir(parent: Path, method: str) -> Path:
    base = parent / time.strftime(f"{method}-%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def feedback_argv(method: str, preset: str, overrides: list[str], checkpoint: str, data: Path, out: Path,
                  held: Optional[Path] = None) -> list[str]:
    """``homerlhf dpo|kto`` from ``checkpoint`` on ``data`` into ``out``; ``held``: its held-out rows (None: no
    split of ``data`` either, ``data.eval_fraction=0``: a handful of rows all train)."""
    keys = {item.split("=", 1)[0] for item in overrides}
    defaults = [f"{method}.{d}" for d in DEFAULTS if f"{method}.{d.split('=')[0]}" not in keys]
    defaults += ["data.eval_fraction=0"] if held is None and "data.eval_fraction" not in keys else []
    argv = [method, "--preset", preset]
    for item in [*overrides, *defaults]:
        argv += ["--set", item]
    argv += ["--model", str(checkpoint), "--data", str(data)]
    return argv + (["--eval-data", str(held)] if held is not None else []) + ["--out", str(out)]


@dataclass
class Started:
    run_dir: Path
    method: str
    message: str


def start_feedback_run(checkpoint: str, method: str, preset: str, overrides: list[str],
                       watch: Iterable[str | Path] = ()) -> Started:
    """Check the feedback and the machine, then start the run; every refusal is one line."""
    from homerlhf.config import check_device, load_config

    if not checkpoint:
        raise UserError("pick a checkpoint first: the feedback run starts from it")
    if method not in METHODS:
        raise UserError(f"method {method!r}: choose auto, dpo or kto")
    start_run = feedback.owner_run(checkpoint)
    refuse_if_running([*watch, start_run.parent])
    cfg = load_config(preset, None, overrides)
    check_device(cfg)
    fb = feedback.policy_feedback(checkpoint)
    short = too_small(fb, method, cfg)
    if short:
        raise UserError(short)
    method = pick_method(fb, method, cfg)
    out = new_run_dir(start_run.parent, method)
    data, held = feedback.write_training_data(fb, method, out / FOLDER, getattr(cfg, method).min_rows)
    argv = feedback_argv(method, preset, overrides, checkpoint, data, out, held)
    info = {"method": method, "start_checkpoint": str(checkpoint), "start_run": str(start_run),
            "held_out": held is not None, "beta": getattr(cfg, method).beta,
            "pairs": len(fb.pairs), "ratings": len(fb.ratings), "good": fb.good, "bad": fb.bad,
            "epochs": getattr(cfg, method).epochs, "max_steps": getattr(cfg, method).max_steps, "argv": argv}
    (out / FOLDER / INFO_FILE).write_text(json.dumps(info, indent=1))
    status = runs.start_run(out, argv)
    what = f"{fb.line()}" if method == "kto" else f"{len(fb.pairs)} preference pair(s)"
    return Started(out, method, f"Started a **{method.upper()}** run `{out}` from `{Path(checkpoint).name}` "
                                f"on {what}: {md_text(status.message())}. The Train tab shows it live.")


def info_of(run_dir: str | Path) -> Optional[dict]:
    """A feedback run's ``feedback.json`` (None for any other run)."""
    try:
        return json.loads((Path(run_dir) / FOLDER / INFO_FILE).read_text())
    except (OSError, ValueError):
        return None


def start_checkpoint(run_dir: str | Path) -> Optional[Path]:
    """The checkpoint a DPO / KTO run started from: the app's record, else the stage's ``start.json``."""
    info = info_of(run_dir)
    if info:
        return Path(info["start_checkpoint"])
    for ckpt in runs.list_checkpoints(run_dir):
        try:
            start = json.loads((ckpt / "start.json").read_text()).get("start", {})
        except (OSError, ValueError):
            continue
        return Path(start["checkpoint"]) if start.get("checkpoint") else None
    return None


def is_preference_run(run_dir: str | Path, argv: list[str]) -> bool:
    return bool(argv[:1] and argv[0] in ("dpo", "kto")) or (Path(run_dir) / RESULT_FILE).is_file() \
        or info_of(run_dir) is not None


def total_steps(run_dir: str | Path, rows: list[dict]) -> Optional[int]:
    """A feedback run's optimizer steps in all: its ``max_steps``, else its epochs times the steps per
    epoch that TRL's logged ``epoch`` (a fraction) shows after the first step."""
    info = info_of(run_dir) or {}
    if info.get("max_steps"):
        return int(info["max_steps"])
    logged = [r for r in rows if isinstance(r.get("epoch"), (int, float)) and r.get("epoch") and r.get("step")]
    if not logged or not info.get("epochs"):
        return None
    per_epoch = logged[0]["step"] / logged[0]["epoch"]
    return max(int(math.ceil(per_epoch * float(info["epochs"]) - 1e-6)), logged[-1]["step"])


# The monitor's panels for a DPO / KTO run: TRL's logged figures per optimizer step.
PANELS = [("Loss", ["loss"]), ("Reward margin (chosen - rejected)", ["rewards/margins"]),
          ("Reward accuracy (chosen above rejected)", ["rewards/accuracies"]),
          ("Rewards: chosen and rejected", ["rewards/chosen", "rewards/rejected"]),
          ("Log-probs: chosen and rejected", ["logps/chosen", "logps/rejected"]), ("KL (KTO)", ["kl"])]
LABELS = {"loss": "loss", "kl": "KL to the start (TRL's estimate)", "rewards/chosen": "chosen", "rewards/rejected": "rejected", "logps/chosen": "chosen",
          "logps/rejected": "rejected", "rewards/margins": "margin", "rewards/accuracies": "accuracy"}


def preference_figure(rows: list[dict]):
    """The monitor figure of a DPO / KTO run: one panel per figure it logs, against the optimizer step
    (TRL's rewards are beta times the log-ratio to the reference: the margin rises as it learns)."""
    from homerlhf.app import monitor
    from homerlhf.app.monitor_plot import heading, lines_of, panel_figure

    steps = [r for r in rows if "loss" in r or "kl" in r]  # the end-of-run totals row aside
    panels = [(title, lines, "") for title, keys in PANELS
              if (lines := lines_of(keys, steps, lambda key: LABELS.get(key, monitor.label_of(key)), monitor.series))]
    return panel_figure(panels, heading(len(steps), "step"), "optimizer step")


def caption_markdown() -> str:
    """The *Metric names* of a DPO / KTO run's panels: each line's name and its ``metrics.jsonl`` key (TRL's)."""
    parts = [f"**{title}**: " + ", ".join(f"{LABELS.get(k, k)} (`{k}`)" for k in keys) for title, keys in PANELS]
    return ("Metric names of this DPO / KTO run, by panel (TRL's per-step figures; its rewards are beta times the "
            "log-ratio to the policy it started from): " + "; ".join(parts) + ".")
