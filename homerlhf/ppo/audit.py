"""``homerlhf audit RUN_DIR``: what the reward-hacking signals did over a run, read back from its logs.

:func:`audit_run` reads a run directory (finished, running or killed): ``metrics.jsonl`` (the
``signal_*`` metrics :mod:`homerlhf.ppo.signals` wrote), ``samples.jsonl`` (the samples that show a
flag) and ``config.yaml`` (the ``audit`` thresholds; the defaults without it). The flags are raised
again from the signals with those thresholds, so an audit and the run agree, and a run logged before
an iteration was flagged is audited the same. The signals explain a hacked run after the fact better
than they warn early (docs/audit.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from homerlhf.config.audit import AuditConfig
from homerlhf.errors import UserError
from homerlhf.ppo.metrics import read_metrics
from homerlhf.ppo.signals import FLAGS, Flag, FlagState, thresholds

EXAMPLES = 3  # samples shown per flag


@dataclass
class FlagReport:
    """One flag over the run: the iterations it was up, the cause it points to, samples that show it."""

    name: str
    metric: str
    threshold: str  # e.g. "> 0.6 (audit.length_corr_max)"
    cause: str
    iterations: list[int] = field(default_factory=list)
    values: dict[int, Optional[float]] = field(default_factory=dict)  # the signal per iteration
    examples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def up(self) -> bool:
        return bool(self.iterations)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "metric": self.metric, "threshold": self.threshold, "cause": self.cause,
                "iterations": self.iterations, "values": {str(k): v for k, v in self.values.items()},
                "examples": self.examples}


@dataclass
class Audit:
    run_dir: Path
    iterations: int
    signals: list[FlagReport]  # every signal logged by the run

    @property
    def flags(self) -> list[FlagReport]:
        """The signals whose flag rose at least once."""
        return [s for s in self.signals if s.up]

    @property
    def ok(self) -> bool:
        return not self.flags

    def lines(self) -> list[str]:
        out = [f"audit of {self.run_dir}: {self.iterations} iterations, "
               + ("no flag raised" if self.ok else f"{len(self.flags)} flag(s) raised: "
                  + ", ".join(f.name for f in self.flags))]
        for signal in self.signals:
            values = [v for v in signal.values.values() if v is not None]
            span = (f"first {_fmt(values[0])}, last {_fmt(values[-1])}, min {_fmt(min(values))}, max {_fmt(max(values))}"
                    if values else "never defined")
            state = f"FLAG at iterations {_ranges(signal.iterations)}" if signal.up else "ok"
            out.append(f"  {signal.name:<13} {signal.metric} {span}; flag when {signal.threshold}: {state}")
            if signal.up:
                out.append(f"    likely cause: {signal.cause}")
                for sample in signal.examples:
                    out.append(f"    iteration {sample['iteration']} ({sample.get('rank', 'first')}, score "
                               f"{_fmt(sample.get('score'))}): {_clip(sample.get('response', ''))}")
        out.append("these signals explain a hacked run after the fact better than they warn early: read the samples")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir), "iterations": self.iterations, "ok": self.ok,
                "flags": [f.to_dict() for f in self.flags], "signals": [s.to_dict() for s in self.signals]}

    def plot(self, path: str | Path) -> Path:
        """A PNG of each signal per iteration, its threshold dashed and flagged iterations marked."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        shown = [s for s in self.signals if any(v is not None for v in s.values.values())]
        fig, axes = plt.subplots(len(shown) or 1, 1, figsize=(7, 1.8 * max(len(shown), 1)), sharex=True, squeeze=False)
        for ax, signal in zip(axes[:, 0], shown):
            its = [i for i, v in signal.values.items() if v is not None]
            ax.plot(its, [signal.values[i] for i in its], marker="o", ms=3)
            ax.axhline(float(signal.threshold.split()[1]), ls="--", color="grey", lw=1)
            flagged = [i for i in signal.iterations if signal.values.get(i) is not None]
            ax.plot(flagged, [signal.values[i] for i in flagged], "o", color="red", ms=5)
            ax.set_ylabel(signal.name, fontsize=8)
        axes[-1, 0].set_xlabel("iteration")
        fig.suptitle(f"signals of {Path(self.run_dir).name} ({'clean' if self.ok else 'flags in red'})", fontsize=9)
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out


def _fmt(value) -> str:
    return f"{value:.3g}" if isinstance(value, (int, float)) else "null"


def _clip(text: str, n: int = 100) -> str:
    text = " ".join(str(text).split())
    return repr(text if len(text) <= n else text[:n] + "...")


def _ranges(iterations: list[int]) -> str:
    """[3, 4, 5, 8] -> '3-5, 8'."""
    parts, start = [], None
    for i, it in enumerate(iterations):
        start = it if start is None else start
        if i + 1 == len(iterations) or iterations[i + 1] != it + 1:
            parts.append(f"{start}-{it}" if it != start else str(it))
            start = None
    return ", ".join(parts)


def read_samples(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "samples.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a killed run's last line may be cut
            continue
    return rows


def audit_config(run_dir: Path) -> AuditConfig:
    """The run's ``audit`` section from its ``config.yaml``; the defaults when it has none."""
    path = run_dir / "config.yaml"
    if path.is_file():
        import yaml

        section = (yaml.safe_load(path.read_text()) or {}).get("audit")
        if isinstance(section, dict):
            return AuditConfig(**section)
    return AuditConfig()


def examples(flag: Flag, iterations: list[int], samples: list[dict[str, Any]], k: int = EXAMPLES) -> list[dict]:
    """Distinct samples that show ``flag``, from its flagged iterations: the longest for length, the
    latest for entropy, distinct-n and zero spread, else the best-scored (no row of the worst k)."""
    flagged = set(iterations)
    rows = [s for s in samples if s.get("iteration") in flagged]
    if flag.name in ("length_corr", "length_drift"):
        key = lambda s: (len(str(s.get("response", ""))), s.get("iteration", 0))  # noqa: E731
    elif flag.name in ("entropy", "distinct", "zero_spread"):
        key = lambda s: (s.get("iteration", 0), s.get("score") or 0.0)  # noqa: E731
    else:  # what the reward paid for: the best-scored, never the worst k
        rows = [s for s in rows if s.get("rank") != "bottom"]
        key = lambda s: (s.get("score") if isinstance(s.get("score"), (int, float)) else float("-inf"),  # noqa: E731
                         s.get("iteration", 0))
    seen, out = set(), []
    for sample in sorted(rows, key=key, reverse=True):
        ident = (sample.get("iteration"), sample.get("prompt"), sample.get("response"))
        if ident not in seen:
            seen.add(ident)
            out.append({k: sample.get(k) for k in ("iteration", "rank", "prompt", "response", "score", "truncated")})
        if len(out) == k:
            break
    return out


def audit_run(run_dir: str | Path) -> Audit:
    """The audit of ``run_dir``. A missing dir, a dir with no ``metrics.jsonl``, a run with no samples
    or no signal logged: a one-line :class:`UserError` (exit code 2)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} does not exist: give the run directory (the --out of homerlhf train)")
    if not (run_dir / "metrics.jsonl").is_file():
        raise UserError(f"{run_dir} is not a run: it has no metrics.jsonl (give the --out of homerlhf train)")
    try:
        rows = read_metrics(run_dir)
    except json.JSONDecodeError:  # a killed run's last line may be cut: keep the whole ones
        text = (run_dir / "metrics.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in text[:-1] if line.strip()]
    if not rows:
        raise UserError(f"{run_dir} has no iteration logged yet in metrics.jsonl: audit it after its first iteration")
    samples = read_samples(run_dir)
    if not samples:
        raise UserError(f"{run_dir} has no samples (samples.jsonl is missing or empty): it was run with "
                        "logging.samples_per_iteration=0 and logging.samples_top_bottom=0; the audit needs samples")
    if not any(key.startswith("signal_") for row in rows for key in row):
        raise UserError(f"{run_dir} logged no signal_* metric: it was trained by a homerlhf without the signals; "
                        "train it again to audit it")
    cfg = audit_config(run_dir)
    state = FlagState(thresholds(cfg), cfg.patience)
    reports = {flag.name: FlagReport(flag.name, flag.metric,
                                     f"{'>' if flag.above else '<'} {getattr(cfg, flag.setting):g} "
                                     f"(audit.{flag.setting}, {cfg.patience} iterations in a row)", flag.cause)
               for flag in FLAGS}
    logged = set()
    for row in rows:
        flags, _ = state.check(row)
        for flag in FLAGS:
            if flag.metric in row:
                logged.add(flag.name)
                reports[flag.name].values[row["iteration"]] = row[flag.metric]
            if flags.get(f"signal_flag_{flag.name}"):
                reports[flag.name].iterations.append(row["iteration"])
    for flag in FLAGS:
        if reports[flag.name].up:
            reports[flag.name].examples = examples(flag, reports[flag.name].iterations, samples)
    return Audit(run_dir, len(rows), [reports[f.name] for f in FLAGS if f.name in logged])
