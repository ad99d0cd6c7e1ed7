"""The live training monitor: read a run's ``metrics.jsonl`` / ``samples.jsonl`` while it grows and
turn them into plots, a progress line with ETA, the latest samples and worker status.

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

# Panels of the monitor figure: a title and regexes of metric keys drawn in it. Patterns rather
# than fixed names, so a renamed or added metric (score_mean, score/mean, rewards/mean ...) still
# lands in the right panel instead of silently vanishing.
PANELS: list[tuple[str, list[str]]] = [
    ("Score / reward", [r"^(env/)?(score|scores|reward|rewards)([/_.](mean|avg))?$", r"^(score|reward)s?[/_.]?mean"]),
    # One line per reward of a weighted reward (reward.components): reward_<name>; their *_none
    # fractions (samples a function gave no reward) stay out, on another scale.
    ("Reward components", [r"^reward_(?!mean$)(?!.*_none$)[a-z0-9_]+$"]),
    ("KL and kl_coef", [r"^(objective/)?kl([/_.]?(mean|seq|sequence))?$", r"kl_coef"]),
    ("Policy and value loss", [r"^(loss/)?(policy|pg|actor)[/_.]?loss", r"^(loss/)?(value|vf|critic)[/_.]?loss"]),
    ("Entropy", [r"entropy"]),
    ("Clip fraction", [r"clipfrac|clip_frac"]),
    ("Tokens / s", [r"tokens?[/_.]?per[/_.]?s|tokens?_s$|tok_s|throughput"]),
    ("Memory (GiB)", [r"(mem|memory).*(gib|gb)$", r"peak.*(gib|gb)$"]),
    ("Approx KL old→new policy", [r"approx_kl"]),
    # How far the rollout engine sampled from the trainer's policy (docs/ppo_details.md, detail 18).
    # In async mode (rollout.async) also how many updates behind the sampling adapter was.
    ("Rollout engine vs trainer", [r"^is_weight_(mean|max)$", r"^is_capped_fraction$", r"^kl_behaviour_old$",
                                   r"^policy_version_lag_(mean|max)$"]),
    ("Groups (GRPO / RLOO)", [r"^group_"]),
]
# Drawn only when a run logs their metrics (a PPO run has no groups, a lone reward no components).
OPTIONAL_PANELS = {"Groups (GRPO / RLOO)", "Reward components"}
# Drawn on a second y axis of their panel: a coefficient is on another scale than the KL itself.
SECONDARY = re.compile(r"coef", re.IGNORECASE)

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


def metrics_figure(rows: Sequence[dict]):
    """A matplotlib Figure, one small panel per group in ``PANELS``, points and lines per metric."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    rows = [flatten(r) for r in rows]
    groups = [(title, keys) for title, keys in panel_keys(numeric_keys(rows)) if keys or title not in OPTIONAL_PANELS]
    n_cols = 4
    n_rows = math.ceil(len(groups) / n_cols)
    fig = Figure(figsize=(14, 3.0 * n_rows), layout="constrained")
    axes = fig.subplots(n_rows, n_cols, squeeze=False).ravel()
    for ax, (title, keys) in zip(axes, groups):
        _draw_panel(ax, title, keys, rows)
    for ax in axes[len(groups):]:
        ax.axis("off")
    fig.suptitle(f"{len(rows)} iteration(s) logged", fontsize=10)
    return fig


def _draw_panel(ax, title: str, keys: Sequence[str], rows: Sequence[dict]) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title, fontsize=10)
    ax.set_xlabel("iteration", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    handles = []
    twin = None
    for i, key in enumerate(keys):
        xs, ys = series(rows, key)
        if not xs:
            continue
        target = ax
        if SECONDARY.search(key) and len(keys) > 1:
            twin = twin or ax.twinx()
            twin.tick_params(labelsize=8)
            target = twin
        (line,) = target.plot(xs, ys, marker="o", markersize=3, linewidth=1.2, label=key, color=f"C{i}")
        handles.append(line)
    if handles:
        ax.legend(handles=handles, fontsize=7, loc="best")
    else:
        ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes, color="gray")


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
        return " · ".join(parts)


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
    return Progress(iteration, total, elapsed, eta)


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
    """The last ``n`` logged samples as table rows: iteration, prompt, response, score."""
    out = []
    for i, row in enumerate(rows[-n:]):
        prompt = _SPECIAL.sub(" ", str(row.get("prompt", row.get("query", "")))).strip()
        response = row.get("response", row.get("completion", ""))
        score = _number(row.get("score", row.get("reward")))
        it = row.get("iteration", row.get("iter", ""))
        out.append([it, re.sub(r"\s+", " ", prompt), str(response), None if score is None else round(score, 4)])
    return list(reversed(out))


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
