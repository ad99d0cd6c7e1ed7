"""The live training monitor: read a run's ``metrics.jsonl`` / ``samples.jsonl`` while it grows and
turn them into panels of lines (drawn by :mod:`homerlhf.app.monitor_plot`), a progress line with ETA,
the latest samples, a log tail without library noise and worker status.

Everything here is plain functions over files and dicts, so it is tested without a browser. The
trainer appends one JSON object per iteration; a line still being written is skipped, never an error.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

from homerlhf.app.monitor_notes import memory_title, panel_label, panel_note

# Panels of the monitor figure, the ones that matter first: a title and regexes of metric keys drawn
# in it. Patterns rather than fixed names, so a renamed or added metric (score_mean, score/mean,
# reward/mean ...) still lands in the right panel instead of silently vanishing.
PANELS: list[tuple[str, list[str]]] = [
    ("Score and reward", [r"^(env/)?(score|scores|reward|rewards)([/_.](mean|avg))?$", r"^(score|reward)s?[/_.]?mean"]),
    # One line per reward of a weighted reward (reward.components): reward_<name>; their *_none
    # fractions (samples a function gave no reward) stay out, on another scale.
    ("Reward components", [r"^reward_(?!mean$)(?!.*_none$)[a-z0-9_]+$"]),
    # kl_mean, and the k3 estimates (never below 0) where a run logs them: its first rollout's, GRPO's loss term.
    ("KL to the reference (nats)", [r"^(objective/)?kl([/_.]?(mean|seq|sequence))?$", r"^kl_ref_(start|loss)$"]),
    ("Policy and value loss", [r"^(loss/)?(policy|pg|actor)[/_.]?loss", r"^(loss/)?(value|vf|critic)[/_.]?loss"]),
    ("Entropy (nats per token)", [r"^(?!signal_).*entropy"]),
    # What homerlhf audit reads (homerlhf.ppo.signals): ratios and shares near 0..1; their flags are in the
    # audit verdict under the figure, not drawn.
    ("Reward-hacking signals (audit)", [r"^signal_(?!flag)[a-z_]+$"]),
    ("KL penalty coefficient", [r"kl_coef"]),
    ("Clipped fraction", [r"clipfrac|clip_frac"]),
    ("Policy change per update", [r"approx_kl"]),
    ("Throughput (tokens/s)", [r"tokens?[/_.]?per[/_.]?s|tokens?_s$|tok_s|throughput"]),
    ("Memory (GiB): measured and planned", [r"(mem|memory).*(gib|gb)$", r"peak.*(gib|gb)$"]),
    # How far the rollout engine sampled from the trainer's policy (docs/ppo_details.md, detail 18).
    # In async mode (rollout.async) also how many updates behind the sampling adapter was.
    ("Rollout engine vs trainer", [r"^is_weight_(mean|max)$", r"^is_capped_fraction$", r"^kl_behaviour_old$",
                                   r"^policy_version_lag_(mean|max)$"]),
    ("Groups (GRPO / RLOO)", [r"^group_"]),
]
# Drawn only when a run logs their metrics (a PPO run has no groups, a lone reward no components) or,
# for the rollout engine's, when they say more than "the trainer sampled" (weights 1, lag 0, KL 0).
OPTIONAL_PANELS = {"Groups (GRPO / RLOO)", "Reward components", "Rollout engine vs trainer"}
TRIVIAL = {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_capped_fraction": 0.0, "kl_behaviour_old": 0.0,
           "policy_version_lag_mean": 0.0, "policy_version_lag_max": 0.0}
# What a line is called in its panel's legend; its metrics.jsonl name is in the caption under the figure.
LABELS = {
    "score_mean": "score (reward model)", "reward_mean": "reward (score - KL penalty)", "kl_mean": "KL per response",
    "kl_coef": "KL coefficient", "policy_loss": "policy", "value_loss": "value", "entropy": "entropy",
    "policy_clipfrac": "policy ratio", "value_clipfrac": "value", "approx_kl": "KL old -> new policy",
    "tokens_per_s_generation": "generation", "tokens_per_s_scoring": "scoring", "tokens_per_s_update": "update",
    "is_weight_mean": "importance weight, mean", "is_weight_max": "importance weight, max",
    "is_capped_fraction": "capped fraction", "kl_behaviour_old": "KL engine -> trainer",
    "policy_version_lag_mean": "updates behind, mean", "policy_version_lag_max": "updates behind, max",
    "group_zero_spread_fraction": "groups without signal", "group_reward_std": "reward std in a group",
    "kl_ref_start": "k3 per token, first rollout", "kl_ref_loss": "k3 per token, in the loss",
    "signal_length_corr": "score-length correlation", "signal_length_drift": "length / first iterations'",
    "signal_repetition": "repeated n-grams, share", "signal_distinct": "distinct n-grams, share",
    "signal_prompt_echo": "prompt echo, share", "signal_reward_share_max": "largest reward's share",
    "signal_entropy_ratio": "entropy / first iterations'",
    **{f"{kind}_mem_{phase}_gib": f"{phase} {word}" for kind, word in (("peak", "measured"), ("predicted", "planned"))
       for phase in ("generation", "scoring", "update")},
}


def label_of(key: str) -> str:
    return LABELS.get(key, key.replace("_", " "))


def caption_markdown() -> str:
    """Each panel's lines and the metrics.jsonl names behind them (docs/ppo_details.md explains each)."""
    from homerlhf.ppo.metrics import METRIC_DESCRIPTIONS

    parts = []
    for title, keys in panel_keys(METRIC_DESCRIPTIONS):
        if keys:
            parts.append(f"**{title}**: " + ", ".join(f"{label_of(k)} (`{k}`)" for k in keys))
    return "Metric names, by panel: " + "; ".join(parts) + "."


ITERATION_KEYS = ("iteration", "iter", "step")
TIME_KEYS = ("time", "timestamp", "wall_time", "t")
ELAPSED_KEYS = ("elapsed_s", "elapsed", "wall_s")
ITERATION_TIME_KEYS = ("time_iteration_s", "iteration_time_s")


def read_jsonl(path: str | Path, last: Optional[int] = None) -> list[dict]:
    """Rows of a JSONL file that parse as objects; a torn last line (still being written) is skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows[-last:] if last else rows


def _number(value) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def iteration_of(row: dict, index: int) -> int:
    """The row's iteration number; its 1-based position when the trainer did not log one."""
    for key in ITERATION_KEYS:
        value = _number(row.get(key))
        if value is not None:
            return int(value)
    return index + 1


def flatten(row: dict, prefix: str = "") -> dict:
    """Nested metric dicts (``{"loss": {"policy": 0.1}}``) as ``{"loss/policy": 0.1}``."""
    flat = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}/"))
        else:
            flat[name] = value
    return flat


def numeric_keys(rows: Sequence[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for row in rows:
        for key, value in row.items():
            if _number(value) is not None:
                seen.setdefault(key, None)
    return list(seen)


def panel_keys(keys: Iterable[str]) -> list[tuple[str, list[str]]]:
    """For each panel, the metric keys it draws (each key in at most one panel, first match wins)."""
    keys = [k for k in keys if k not in ITERATION_KEYS + TIME_KEYS + ELAPSED_KEYS + ITERATION_TIME_KEYS]
    used: set[str] = set()
    out = []
    for title, patterns in PANELS:
        chosen = []
        for pattern in patterns:
            for key in keys:
                if key not in used and re.search(pattern, key, flags=re.IGNORECASE):
                    chosen.append(key)
                    used.add(key)
        out.append((title, chosen))
    return out


def series(rows: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    """(iterations, values) of one metric, skipping rows where it is missing or not finite."""
    xs, ys = [], []
    for i, row in enumerate(rows):
        value = _number(row.get(key))
        if value is not None:
            xs.append(iteration_of(row, i))
            ys.append(value)
    return xs, ys


def metric_panels(rows: Sequence[dict], reference: Optional[dict] = None) -> list[tuple[str, list, str]]:
    """(title, lines, note) of each panel with data, in ``PANELS`` order; a line is (key, legend name, xs, ys).
    ``reference`` (:mod:`homerlhf.app.monitor_reference`): its lines too, in the panels of the keys it has."""
    from homerlhf.app.monitor_plot import lines_of

    kind = next((r.get("peak_mem_kind") for r in reversed(rows) if r.get("peak_mem_kind")), None)
    rows = [flatten(r) for r in rows]
    panels = []
    for title, keys in panel_keys(numeric_keys(rows)):
        if title in OPTIONAL_PANELS and not _says_something(keys, rows):
            continue
        title = memory_title(title, kind)
        lines = lines_of(keys, rows, lambda key: panel_label(title, key, label_of(key)), series)
        if lines:
            note = panel_note(title, [y for *_, ys in lines for y in ys])
            panels.append((title, lines + _reference_lines(keys, reference, title), note))
    return panels


def _reference_lines(keys: Sequence[str], reference: Optional[dict], title: str) -> list:
    """The reference run's lines of ``keys``: named for the reference alone, or with the metric when there are several."""
    from homerlhf.app.monitor_plot import lines_of
    from homerlhf.app.monitor_reference import NAME

    if not reference:
        return []
    lines = lines_of(keys, reference["rows"], lambda key: f"{NAME}: {panel_label(title, key, label_of(key))}", series)
    return [(key, NAME, xs, ys) for key, _, xs, ys in lines] if len(lines) == 1 else lines


def metrics_figure(rows: Sequence[dict], reference: Optional[dict] = None):
    """The monitor's interactive figure (plotly): one panel per group in ``PANELS`` that has data, with the lines
    of ``reference`` (a healthy run of the same task) dashed grey in them and a note under the figure."""
    from homerlhf.app.monitor_plot import heading, panel_figure
    from homerlhf.app.monitor_reference import note

    panels = metric_panels(rows, reference)
    return panel_figure(panels, heading(len(rows), "iteration"), "iteration",
                        note(reference) if reference and panels else "")


def _says_something(keys: Sequence[str], rows: Sequence[dict]) -> bool:
    return any(y != TRIVIAL.get(key) for key in keys for y in series(rows, key)[1])


def _format_duration(seconds: float) -> str:
    seconds = int(round(max(0.0, seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


@dataclass
class Progress:
    iteration: int
    total: Optional[int]
    elapsed_s: Optional[float]
    eta_s: Optional[float]
    warning: Optional[str] = None  # the last KL flag's reason (homerlhf.ppo.guards.KLJump), if any

    @property
    def fraction(self) -> float:
        return min(1.0, self.iteration / self.total) if self.total else 0.0

    def line(self) -> str:
        total = f"/{self.total}" if self.total else ""
        parts = [f"iteration {self.iteration}{total}"]
        if self.total:
            parts.append(f"{100 * self.fraction:.0f}%")
        if self.elapsed_s is not None:
            parts.append(f"elapsed {_format_duration(self.elapsed_s)}")
        if self.eta_s is not None and self.total and self.iteration < self.total:
            parts.append(f"ETA {_format_duration(self.eta_s)}")
        line = " · ".join(parts)
        return f"{line} · **KL flag** {self.warning}" if self.warning else line


def _row_time(row: dict) -> Optional[float]:
    for key in TIME_KEYS:
        value = _number(row.get(key))
        if value is not None and value > 1e9:  # a unix time, not a duration
            return value
    return None


def _row_elapsed(row: dict) -> Optional[float]:
    for key in ELAPSED_KEYS:
        value = _number(row.get(key))
        if value is not None:
            return value
    return None


def progress(
    rows: Sequence[dict],
    total: Optional[int],
    started_at: Optional[float] = None,
    now: Optional[float] = None,
) -> Progress:
    """Iteration reached, and an ETA from the mean time per iteration so far.

    Time comes from the rows (``elapsed_s`` since start, or a unix ``time``) when the trainer logs
    it, else from ``started_at`` (when the app started the run) and ``now``.
    """
    now = time.time() if now is None else now
    if not rows:
        elapsed = now - started_at if started_at else None
        return Progress(0, total, elapsed, None)
    iteration = iteration_of(rows[-1], len(rows) - 1)
    elapsed = _row_elapsed(rows[-1])
    if elapsed is None:
        t_last = _row_time(rows[-1])
        if t_last is not None and started_at:
            elapsed = t_last - started_at
        elif started_at:
            elapsed = now - started_at
    per_iteration = _mean_iteration_time(rows)
    if elapsed is None and per_iteration is not None:
        elapsed = per_iteration * len(rows)
    eta = None
    if total and iteration > 0:
        if per_iteration is not None:  # the trainer's own timing: excludes model loading at start
            eta = per_iteration * (total - iteration)
        elif elapsed is not None:
            eta = elapsed / iteration * (total - iteration)
    return Progress(iteration, total, elapsed, eta, kl_warning(rows))


def kl_warning(rows: Sequence[dict]) -> Optional[str]:
    """The reason of the last row flagged for leaving its reference in one update (``kl_flag``), with
    how many were flagged; None when none was."""
    flagged = [row for row in rows if _number(row.get("kl_flag"))]
    if not flagged:
        return None
    reason = str(flagged[-1].get("kl_flag_reason") or f"iteration {flagged[-1].get('iteration')}")
    return reason if len(flagged) == 1 else f"({len(flagged)} iterations flagged; the last) {reason}"


def _mean_iteration_time(rows: Sequence[dict], last: int = 5) -> Optional[float]:
    """Mean seconds per iteration over the last few rows that log it (recent speed, not startup)."""
    times = []
    for row in rows[-last:]:
        for key in ITERATION_TIME_KEYS:
            value = _number(row.get(key))
            if value is not None:
                times.append(value)
                break
    return sum(times) / len(times) if times else None


# Chat-template markers (<|user|>, <|im_start|>, ...): noise in a table of prompts.
_SPECIAL = re.compile(r"<\|[A-Za-z0-9_]+\|>")


def latest_samples(rows: Sequence[dict], n: int = 8) -> list[list]:
    """The last ``n`` logged samples as table rows: iteration, prompt, response, score. A sample the run kept
    twice (one of the first of its batch and also its best: ``rank``) is one row."""
    seen, unique = set(), []
    for row in rows:
        key = (row.get("iteration"), row.get("prompt"), row.get("response"), row.get("score"))
        if row.get("rank", "first") == "first" or key not in seen:
            unique.append(row)
        seen.add(key)
    out = []
    for i, row in enumerate(unique[-n:]):
        prompt = _SPECIAL.sub(" ", str(row.get("prompt", row.get("query", "")))).strip()
        response = row.get("response", row.get("completion", ""))
        score = _number(row.get("score", row.get("reward")))
        it = row.get("iteration", row.get("iter", ""))
        out.append([it, re.sub(r"\s+", " ", prompt), str(response), None if score is None else round(score, 4)])
    return list(reversed(out))


# Library noise in a run's output: Python warnings (with their source line), llama.cpp's own log lines
# ("llama_context: n_ctx_seq (2048) > n_ctx_train (512) ..."): true, and nothing a user acts on here.
_WARNING = re.compile(r"^\S+:\d+: \w*Warning: ")
_LLAMA = re.compile(r"^(llama_|llm_|ggml_|gguf_|common_|load_tensors|print_info|load)[a-z_]*: ")


def quiet_log(text: str) -> str:
    """A run's log tail as the monitor shows it: each progress bar at its last state (the text after its last
    carriage return), without library warnings or llama.cpp's log lines (the file keeps everything)."""
    kept, skip_source = [], False
    for line in text.split("\n"):
        redrawn, line = "\r" in line, line.rsplit("\r", 1)[-1]
        if redrawn and not line.strip():  # a bar that cleared itself when done
            continue
        if _WARNING.match(line):
            skip_source = True  # the next line, indented, is the warning's source line
            continue
        if skip_source and line.startswith((" ", "\t")):
            skip_source = False
            continue
        skip_source = False
        if not _LLAMA.match(line):
            kept.append(line)
    return "\n".join(kept)


def check_worker(url: str, timeout: float = 2.0, token: Optional[str] = None) -> tuple[bool, Optional[float], str]:
    """``GET url/health`` of a llama.cpp worker: (up, latency in ms, detail). ``token``: the
    worker's bearer token, when it was started with one."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    start = time.perf_counter()
    try:
        resp = httpx.get(url.rstrip("/") + "/health", timeout=timeout, headers=headers)
    except httpx.HTTPError as exc:
        return False, None, type(exc).__name__
    latency_ms = 1000 * (time.perf_counter() - start)
    return resp.status_code == 200, latency_ms, f"HTTP {resp.status_code}"
