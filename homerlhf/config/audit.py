"""The ``audit`` and ``guards`` sections of the run config (re-exported by :mod:`homerlhf.config.schema`).

``audit``: the reward-hacking signals' thresholds (:mod:`homerlhf.ppo.signals`): each signal past its
threshold for ``patience`` iterations in a row raises its flag in ``metrics.jsonl`` and in
``homerlhf audit``. ``guards``: the silent no-ops that stop a run (:mod:`homerlhf.ppo.guards`).
docs/audit.md says what each one points to.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from homerlhf.config.section import Section


class AuditConfig(Section):
    """Thresholds of the per-iteration signals (``signal_*`` metrics) and their flags."""

    baseline_iterations: int = Field(
        2, ge=1, description="The first iterations whose mean response length and entropy the drift signals compare to.")
    patience: int = Field(2, ge=1, description="Iterations in a row a signal must be past its threshold to raise its flag.")
    ngram: int = Field(3, ge=1, description="Token n-gram size of the repetition, distinct-n and prompt-echo signals.")
    length_corr_max: float = Field(
        0.6, ge=-1, le=1, description="Flag when the Pearson correlation of score with response length exceeds this.")
    length_drift_max: float = Field(
        1.5, gt=1, description="Flag when mean response length over the baseline's exceeds this ratio.")
    repetition_max: float = Field(
        0.3, ge=0, le=1, description="Flag when the mean share of repeated n-grams within a response exceeds this.")
    distinct_min: float = Field(
        0.2, ge=0, le=1, description="Flag when distinct n-grams over all n-grams of the batch fall below this.")
    prompt_echo_max: float = Field(
        0.5, ge=0, le=1, description="Flag when the mean share of a response's n-grams found in its prompt exceeds this.")
    reward_share_max: float = Field(
        0.9, gt=0, le=1, description="Several rewards: flag when one reward's share of the summed |weighted scores| exceeds this.")
    zero_spread_max: float = Field(
        0.9, ge=0, le=1, description="GRPO/RLOO: flag when the fraction of prompt groups with equal rewards exceeds this.")
    entropy_ratio_min: float = Field(
        0.3, ge=0, lt=1, description="Flag when rollout entropy over the baseline's falls below this ratio.")


class GuardsConfig(Section):
    """Runs that train nothing: each guard stops the run with its cause (or only warns)."""

    action: Literal["stop", "warn"] = Field("stop", description="What a tripped guard does: stop the run, or log a warning and go on.")
    flat_reward_iterations: int = Field(
        5, ge=1, description="Trip when every response scored the same, or every advantage was 0, this many iterations in a row.")
    lora_unchanged: bool = Field(True, description="Trip when an update with optimizer steps left the actor's LoRA weights unchanged.")
    all_capped: bool = Field(True, description="Trip when every response token's importance weight was capped at rollout.is_cap.")
    empty_or_cut_iterations: Optional[int] = Field(
        5, ge=1, description="Trip when every response was empty or cut at rollout.max_new_tokens this many iterations "
        "in a row (null: off).")
