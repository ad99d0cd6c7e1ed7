"""Reward-hacking signals: what a batch of responses says about how the policy raises its score.

A policy can raise its score without getting better: longer answers, repeated phrases, the question
echoed back, one reward of several carrying the total, groups that all answer alike, a distribution
collapsing onto a few tokens. Each signal is a pure function of one iteration's batch (token ids,
scores, entropy), in this module; :class:`SignalMonitor` keeps what they compare to across iterations
(the first iterations' response length and entropy) and raises a flag per signal once it has been
past its threshold (``audit.*``) for ``audit.patience`` iterations in a row. The metrics are
``signal_*`` in ``metrics.jsonl`` (:data:`SIGNAL_DESCRIPTIONS`); ``homerlhf audit`` reads them back
(:mod:`homerlhf.ppo.audit`). docs/audit.md says what each flag points to.

The signals explain a hacked run after the fact better than they warn early: a correlation of score
with length is also what a reward that rightly prefers complete answers shows.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

log = logging.getLogger(__name__)

Tokens = Sequence[int]

SIGNAL_DESCRIPTIONS: dict[str, str] = {
    "signal_length_corr": "Pearson correlation over the batch of each response's score with its length in tokens "
                          "(null when either is constant).",
    "signal_length_drift": "Mean response length over that of the first audit.baseline_iterations iterations (1: no drift).",
    "signal_repetition": "Mean over responses of the share of their token n-grams (audit.ngram) that repeat an earlier one "
                         "of the same response.",
    "signal_distinct": "Distinct token n-grams over all n-grams of the batch's responses (distinct-n; null without any).",
    "signal_prompt_echo": "Mean over responses of the share of their token n-grams that occur in their own prompt.",
    "signal_reward_share_max": "Several rewards: the largest one reward's share of the batch's summed |weight * score| "
                               "over all rewards.",
    "signal_entropy_ratio": "Rollout entropy over that of the first audit.baseline_iterations iterations (1: no collapse).",
    "signal_flag_length_corr": "1 once signal_length_corr exceeded audit.length_corr_max for audit.patience iterations in a row.",
    "signal_flag_length_drift": "1 once signal_length_drift exceeded audit.length_drift_max for audit.patience iterations in a row.",
    "signal_flag_repetition": "1 once signal_repetition exceeded audit.repetition_max for audit.patience iterations in a row.",
    "signal_flag_distinct": "1 once signal_distinct fell below audit.distinct_min for audit.patience iterations in a row.",
    "signal_flag_prompt_echo": "1 once signal_prompt_echo exceeded audit.prompt_echo_max for audit.patience iterations in a row.",
    "signal_flag_reward_share": "1 once signal_reward_share_max exceeded audit.reward_share_max for audit.patience "
                                "iterations in a row.",
    "signal_flag_zero_spread": "GRPO/RLOO: 1 once group_zero_spread_fraction exceeded audit.zero_spread_max for "
                               "audit.patience iterations in a row.",
    "signal_flag_entropy": "1 once signal_entropy_ratio fell below audit.entropy_ratio_min for audit.patience iterations "
                           "in a row.",
    "signal_flags": "Number of signal_flag_* up this iteration.",
    "signal_flag_reason": "Iterations where a flag rose (a string, not sent to trackers): which signal, its value and "
                          "threshold; also logged as a warning.",
}


# -- the pure functions ------------------------------------------------------------------------------
def pearson(x: Sequence[float], y: Sequence[float]) -> Optional[float]:
    """Pearson's correlation of ``x`` and ``y``; None when fewer than 2 pairs or either is constant."""
    n = len(x)
    if n != len(y):
        raise ValueError(f"pearson needs equal lengths, got {n} and {len(y)}")
    if n < 2:
        return None
    mx, my = math.fsum(x) / n, math.fsum(y) / n
    sxy = math.fsum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = math.fsum((a - mx) ** 2 for a in x)
    syy = math.fsum((b - my) ** 2 for b in y)
    if sxx == 0 or syy == 0:
        return None
    return max(-1.0, min(1.0, sxy / math.sqrt(sxx * syy)))


def ngrams(tokens: Tokens, n: int) -> list[tuple[int, ...]]:
    """The token n-grams of ``tokens`` in order (none when shorter than ``n``)."""
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def repeated_share(tokens: Tokens, n: int) -> float:
    """Share of the n-grams of one response that repeat an earlier one of it: (all - distinct) / all;
    0 for a response with no n-gram."""
    grams = ngrams(tokens, n)
    return (len(grams) - len(set(grams))) / len(grams) if grams else 0.0


def distinct_n(responses: Sequence[Tokens], n: int) -> Optional[float]:
    """Distinct n-grams over all n-grams of the batch's responses; None when there is no n-gram."""
    counts: Counter = Counter(g for tokens in responses for g in ngrams(tokens, n))
    total = sum(counts.values())
    return len(counts) / total if total else None


def prompt_echo(prompt: Tokens, response: Tokens, n: int) -> float:
    """Share of the response's n-grams that occur anywhere in its prompt; 0 for a response with no n-gram."""
    grams = ngrams(response, n)
    if not grams:
        return 0.0
    in_prompt = set(ngrams(prompt, n))
    return sum(g in in_prompt for g in grams) / len(grams)


def reward_shares(components: Mapping[str, Sequence[Optional[float]]],
                  weights: Mapping[str, float]) -> dict[str, float]:
    """Each reward's share of the batch's summed ``|weight * score|`` over all rewards (None scores
    count 0); empty with fewer than two rewards or when every term is 0."""
    if len(components) < 2:
        return {}
    mass = {name: math.fsum(abs(weights.get(name, 1.0) * s) for s in scores if s is not None)
            for name, scores in components.items()}
    total = math.fsum(mass.values())
    return {name: m / total for name, m in mass.items()} if total > 0 else {}


def ratio(value: Optional[float], baseline: Optional[float]) -> Optional[float]:
    """``value / baseline``; None when either is missing or the baseline is not positive."""
    if value is None or baseline is None or not baseline > 0 or not math.isfinite(value):
        return None
    return value / baseline


def batch_signals(prompts: Sequence[Tokens], responses: Sequence[Tokens], lengths: Sequence[float],
                  scores: Sequence[float], n: int, components: Optional[Mapping[str, Sequence[Optional[float]]]] = None,
                  weights: Optional[Mapping[str, float]] = None) -> dict[str, Optional[float]]:
    """The signals of one batch that need no other iteration: length correlation, repetition,
    distinct-n, prompt echo and, with several rewards, the largest share. ``responses``: token ids
    without the end token (which the chat template also puts in the prompt); ``lengths``: in tokens,
    the end token included (as ``response_length_mean`` counts them); ``n``: the n-gram size."""
    lengths = [float(x) for x in lengths]
    out: dict[str, Optional[float]] = {
        "signal_length_corr": pearson(list(map(float, scores)), lengths),
        "signal_repetition": math.fsum(repeated_share(r, n) for r in responses) / len(responses) if responses else None,
        "signal_distinct": distinct_n(responses, n),
        "signal_prompt_echo": (math.fsum(prompt_echo(p, r, n) for p, r in zip(prompts, responses)) / len(responses)
                               if responses else None),
    }
    shares = reward_shares(components or {}, weights or {})
    if shares:
        out["signal_reward_share_max"] = max(shares.values())
    return out


# -- the flags ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Flag:
    """One flag: the metric it reads, the ``audit`` setting holding its threshold, which side is bad,
    and the cause it points to (docs/audit.md)."""

    name: str  # signal_flag_<name>
    metric: str
    setting: str  # audit.<setting>
    above: bool  # True: past means above the threshold
    cause: str

    def past(self, value: Optional[float], threshold: float) -> bool:
        if value is None or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        return value > threshold if self.above else value < threshold


FLAGS: tuple[Flag, ...] = (
    Flag("length_corr", "signal_length_corr", "length_corr_max", True,
         "the score pays for length: longer answers score higher whatever they say (a reward model's length bias)"),
    Flag("length_drift", "signal_length_drift", "length_drift_max", True,
         "responses grow: the policy found that length raises its score (length hacking), or it stopped ending them"),
    Flag("repetition", "signal_repetition", "repetition_max", True,
         "responses repeat their own phrases: the reward pays for words or phrases however often they come"),
    Flag("distinct", "signal_distinct", "distinct_min", False,
         "the batch's responses say the same few things: the policy collapsed onto what scores (mode collapse)"),
    Flag("prompt_echo", "signal_prompt_echo", "prompt_echo_max", True,
         "responses copy their prompt: the reward pays for overlap with the question (echoing it back)"),
    Flag("reward_share", "signal_reward_share_max", "reward_share_max", True,
         "one reward carries the total: the others' weights are too small to steer (check reward weights)"),
    Flag("zero_spread", "group_zero_spread_fraction", "zero_spread_max", True,
         "a group's answers all score alike: no advantage, nothing learned (a saturated or too coarse reward)"),
    Flag("entropy", "signal_entropy_ratio", "entropy_ratio_min", False,
         "entropy collapsed: the policy samples the same tokens every time (learning rate too high, KL too weak)"),
)
FLAGS_BY_NAME = {flag.name: flag for flag in FLAGS}


class FlagState:
    """Raises each flag once its signal has been past the threshold ``patience`` iterations in a row;
    a flag stays up for the iterations it stays past. ``thresholds``: ``audit.*`` by setting name."""

    def __init__(self, thresholds: Mapping[str, float], patience: int):
        self.thresholds = dict(thresholds)
        self.patience = patience
        self.in_row: dict[str, int] = {flag.name: 0 for flag in FLAGS}

    def check(self, row: Mapping[str, Any]) -> tuple[dict[str, int], list[str]]:
        """``(signal_flag_* of the row, a line per flag that rose at this row)``."""
        flags, rose = {}, []
        for flag in FLAGS:
            if flag.metric not in row:
                continue
            threshold = self.thresholds[flag.setting]
            was_up = self.in_row[flag.name] >= self.patience
            self.in_row[flag.name] = self.in_row[flag.name] + 1 if flag.past(row[flag.metric], threshold) else 0
            up = self.in_row[flag.name] >= self.patience
            flags[f"signal_flag_{flag.name}"] = int(up)
            if up and not was_up:
                rose.append(f"{flag.name}: {flag.metric} {row[flag.metric]:.3g} {'>' if flag.above else '<'} "
                            f"audit.{flag.setting}={threshold:g} for {self.patience} iterations; likely cause: {flag.cause}")
        return flags, rose

    def state_dict(self) -> dict[str, int]:
        return dict(self.in_row)

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.in_row.update({k: int(v) for k, v in state.items() if k in self.in_row})


def thresholds(audit_cfg) -> dict[str, float]:
    """The ``audit`` section's thresholds by setting name."""
    return {flag.setting: float(getattr(audit_cfg, flag.setting)) for flag in FLAGS}


class SignalMonitor:
    """The signals of each iteration and their flags, across a run.

    ``check(iteration, row, prompts, responses, lengths, scores, components)``: the ``signal_*`` additions to the
    iteration's metrics row (``row``: its ``response_length_mean``, ``entropy``, and
    ``group_zero_spread_fraction`` for GRPO/RLOO). The baselines (the first ``audit.baseline_iterations``
    iterations' mean length and entropy) and the flags' counts travel in the checkpoint.
    """

    def __init__(self, cfg, warn: bool = True):
        self.audit = cfg.audit
        self.weights = {reward.metric_name: reward.weight for _, reward in cfg.reward.all_rewards()}
        self.warn = warn
        self.flags = FlagState(thresholds(cfg.audit), cfg.audit.patience)
        self.baseline_lengths: list[float] = []
        self.baseline_entropies: list[float] = []

    def check(self, iteration: int, row: Mapping[str, Any], prompts: Sequence[Tokens], responses: Sequence[Tokens],
              lengths: Sequence[float], scores: Sequence[float],
              components: Optional[Mapping[str, Sequence[Optional[float]]]] = None) -> dict[str, Any]:
        out: dict[str, Any] = batch_signals(prompts, responses, lengths, scores, self.audit.ngram, components,
                                            self.weights)
        length, entropy = row.get("response_length_mean"), row.get("entropy")
        if len(self.baseline_lengths) < self.audit.baseline_iterations:
            self.baseline_lengths.append(float(length))
            self.baseline_entropies.append(float(entropy) if entropy is not None else math.nan)
        out["signal_length_drift"] = ratio(length, _mean(self.baseline_lengths))
        out["signal_entropy_ratio"] = ratio(entropy, _mean(self.baseline_entropies))
        flags, rose = self.flags.check({**row, **out})
        out.update(flags)
        out["signal_flags"] = sum(flags.values())
        if rose:
            out["signal_flag_reason"] = f"iteration {iteration}: " + "; ".join(rose)
            if self.warn:
                log.warning("reward-hacking signal: %s (homerlhf audit RUN_DIR shows the samples)",
                            out["signal_flag_reason"])
        return {key: out[key] for key in SIGNAL_DESCRIPTIONS if key in out}

    def state_dict(self) -> dict[str, Any]:
        return {"lengths": list(self.baseline_lengths), "entropies": list(self.baseline_entropies),
                "in_row": self.flags.state_dict()}

    def load_state_dict(self, state: Optional[Mapping[str, Any]]) -> None:
        if not state:  # a checkpoint from before the signals: the baselines start again
            return
        self.baseline_lengths = [float(v) for v in state["lengths"]]
        self.baseline_entropies = [float(v) for v in state["entropies"]]
        self.flags.load_state_dict(state["in_row"])


def _mean(values: Sequence[float]) -> Optional[float]:
    finite = [v for v in values if math.isfinite(v)]
    return math.fsum(finite) / len(finite) if finite else None


