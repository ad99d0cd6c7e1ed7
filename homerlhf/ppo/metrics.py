"""Per-iteration metrics: the row of one iteration (``iteration_metrics``), written as one JSON line
in ``RUN_DIR/metrics.jsonl`` (and to the experiment trackers of ``logging.report_to``), and the samples.

Metric names are stable and snake_case; ``METRIC_DESCRIPTIONS`` says what each one means (in the
order rows are written) and ``docs/ppo_details.md`` documents every name in it.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from pathlib import Path
from typing import Any, Iterable

from torch import Tensor

from homerlhf.ppo.advantages import experience_kl_estimator, sequence_kl
from homerlhf.ppo.group import group_zero_spread, groups
from homerlhf.ppo.experience import Experience, Rollout
from homerlhf.ppo.importance import importance_metrics
from homerlhf.ppo.math import K3_MAX, explained_variance, k3_kl, masked_mean
from homerlhf.ppo.meters import Meters, StageTimes
from homerlhf.ppo.signals import SIGNAL_DESCRIPTIONS
from homerlhf.tracking.session import TrackerSession
from homerlhf.tracking.settings import report_to

log = logging.getLogger(__name__)

METRIC_DESCRIPTIONS: dict[str, str] = {
    "iteration": "PPO iteration number, starting at 1.",
    "score_mean": "Mean reward-model score of the iteration's responses (after truncation penalty, before normalisation).",
    "score_std": "Standard deviation of those scores.",
    "score_used_mean": "Mean score that entered the rewards (after normalisation and clipping, if on).",
    "reward_mean": "Mean over sequences of the summed KL-shaped per-token rewards.",
    "kl_mean": "Mean over sequences of the summed per-token KL(actor || reference) estimate, in nats.",
    "kl_per_token": "The same KL estimate averaged over response tokens.",
    "kl_coef": "KL penalty coefficient used for this iteration's rewards.",
    "kl_clamped_frac": f"k3 runs only: fraction of the rollout's response tokens whose k3 KL to the reference was capped at {K3_MAX:g} nats (log-ratio beyond about -11 or +2.6).",
    "kl_ref_start": "First iteration only: mean per-token k3 KL(actor || reference) of the rollout, before any update (~0 when the reference holds the actor's starting weights).",
    "kl_jump": "From the second iteration of a run on (a resume continues it): kl_mean minus the previous iteration's, nats per response: how far one update moved the policy from the reference.",
    "kl_flag": "1 if the iteration left its reference in one update: kl_jump above ppo.target_kl (the run's KL budget), or approx_kl above ppo.early_stop_kl (0.1 when unset); or if kl_mean crossed ppo.target_kl by smaller updates (once a crossing); else 0.",
    "kl_flag_reason": "Flagged iterations only (a string, not sent to trackers): what jumped, the likely cause and the setting that stops it; also logged as a warning.",
    "entropy": "Mean per-token entropy of the actor's next-token distribution at rollout, in nats.",
    "group_zero_spread_fraction": "GRPO/RLOO: fraction of prompt groups whose sequence rewards are all equal (no signal).",
    "group_reward_std": "GRPO/RLOO: mean over groups of the (unbiased) std of their sequence rewards.",
    "kl_ref_loss": "GRPO/RLOO: mean per-token k3 KL(actor || reference) under the update's forward, averaged over steps.",
    "kl_clamped_frac_loss": f"GRPO/RLOO: fraction of response tokens whose k3 KL to the reference was capped at {K3_MAX:g} nats under the update's forward (no KL gradient from them), averaged over steps.",
    "value_mean": "Mean critic value over response tokens at rollout.",
    "return_mean": "Mean GAE return over response tokens (the critic's target).",
    "policy_loss": "Clipped surrogate policy loss, averaged over optimizer steps.",
    "value_loss": "Clipped value loss, averaged over optimizer steps.",
    "policy_clipfrac": "Fraction of response tokens whose policy ratio was clipped.",
    "value_clipfrac": "Fraction of response tokens whose value update was clipped.",
    "approx_kl": "k3 estimate of KL(old policy || new policy) during the update, averaged over steps.",
    "explained_variance": "1 - Var[returns - values] / Var[returns] at rollout: how well the critic predicts.",
    "grad_norm_actor": "Actor gradient norm before clipping, averaged over steps.",
    "grad_norm_critic": "Critic (LoRA + value head) gradient norm before clipping, averaged over steps.",
    "optimizer_steps": "Optimizer steps taken this iteration.",
    "critic_warmup": "PPO: 1 in the first critic.warmup_iterations, whose steps trained the critic alone (the actor kept its weights); else 0.",
    "nonfinite_skipped_steps": "Optimizer steps skipped this iteration because a loss or gradient norm was NaN/inf.",
    "loss_scale": "fp16 compute only: the grad scaler's loss scale after the iteration's last step (halved at each overflow).",
    "early_stopped": "1 if the epochs stopped early because approx_kl exceeded ppo.early_stop_kl.",
    "micro_batch_size": "Micro-batch size in use at the end of the iteration (lower after an OOM backoff).",
    "oom_retries": "Times an out-of-memory error halved the micro-batch this iteration.",
    "rollout_chunk_size": "Rollout chunk in use at the end of the iteration (lower after an OOM in generation or scoring).",
    "oom_retries_generation": "Times an out-of-memory error in generation halved the rollout chunk this iteration.",
    "oom_retries_scoring": "Times an out-of-memory error in scoring halved the rollout chunk this iteration.",
    "response_length_mean": "Mean response length in tokens (EOS included).",
    "truncated_fraction": "Fraction of responses that hit rollout.max_new_tokens without EOS.",
    "is_weight_mean": "Mean truncated importance weight min(exp(old - behaviour), rollout.is_cap) over response tokens (1 with the hf engine).",
    "is_weight_max": "Largest truncated importance weight of the batch.",
    "is_capped_fraction": "Fraction of response tokens whose importance ratio exceeded rollout.is_cap.",
    "kl_behaviour_old": "Mean per-token k3 KL(rollout engine || trainer's old policy), nats (0 with the hf engine).",
    "policy_version_lag_mean": "Mean over samples of the updates the trainer had applied beyond the adapter that sampled them (0 in sync mode; 1 in async mode after iteration 1).",
    "policy_version_lag_max": "Largest policy version lag of the batch.",
    "time_generation_s": "Wall seconds spent sampling responses.",
    "time_scoring_s": "Wall seconds computing old log-probs and values with the actor and critic.",
    "time_reference_reward_wait_s": "Wall seconds waiting for reference log-probs and scores after the last chunk.",
    "time_advantages_s": "Wall seconds for rewards, GAE and whitening.",
    "time_update_s": "Wall seconds for the PPO epochs (forward, backward, optimizer steps).",
    "time_iteration_s": "Wall seconds for the whole iteration.",
    "tokens_per_s_generation": "Response tokens sampled per second of generation.",
    "tokens_per_s_scoring": "Prompt + response tokens scored per second by actor and critic.",
    "tokens_per_s_update": "Prompt + response tokens trained on per second of update (all epochs).",
    "peak_mem_generation_gib": "Peak memory during generation, GiB (CUDA: max allocated; CPU: process RSS).",
    "peak_mem_scoring_gib": "Peak memory during scoring, GiB (CUDA: max allocated; CPU: process RSS).",
    "peak_mem_update_gib": "Peak memory during the update, GiB (CUDA: max allocated; CPU: process RSS).",
    "predicted_mem_generation_gib": "The memory planner's allocated GiB for generation, to compare with peak_mem_generation_gib.",
    "predicted_mem_scoring_gib": "The memory planner's allocated GiB for scoring, to compare with peak_mem_scoring_gib.",
    "predicted_mem_update_gib": "The memory planner's allocated GiB for the update (at the micro-batch in use).",
    "peak_mem_kind": "What the peak_mem_* figures measure: cuda_max_allocated or cpu_rss.",
    **SIGNAL_DESCRIPTIONS,  # the reward-hacking signals and their flags (homerlhf.ppo.signals, docs/audit.md)
}
# Metrics named after the run's rewards (``reward.name`` / ``reward.components``), logged when the
# reward is a function or a weighted sum (``homerlhf.ppo.reward_functions.component_metrics``).
METRIC_FAMILIES: dict[str, str] = {
    "reward_<name>": "Mean of one reward's scores over the iteration's samples it scored (before its weight).",
    "reward_<name>_none": "Fraction of the iteration's samples that reward returned None (no reward, counted as 0) for.",
}
_FAMILY_PATTERNS = [re.compile("^" + re.escape(f).replace(re.escape("<name>"), "[a-z][a-z0-9_]*") + "$")
                    for f in METRIC_FAMILIES]


def is_documented(key: str) -> bool:
    """A metric named in ``METRIC_DESCRIPTIONS`` or of a ``METRIC_FAMILIES`` pattern."""
    return key in METRIC_DESCRIPTIONS or any(p.match(key) for p in _FAMILY_PATTERNS)


def rollout_metrics(exp: Experience, scores: Tensor, entropy: Tensor, kl_coef: float) -> dict[str, float]:
    """What the iteration's experience says: scores, rewards, KL, entropy, values and returns.

    ``exp``: with rewards, KL and advantages computed; ``scores`` (B,) as they entered the rewards;
    ``entropy`` (B, T) at rollout; ``kl_coef``: the coefficient those rewards used.
    """
    mask = exp.response_mask
    kl_per_seq = sequence_kl(exp)
    return {
        "score_mean": float(exp.scores.mean()),
        "score_std": float(exp.scores.std()) if len(exp) > 1 else 0.0,
        "score_used_mean": float(scores.mean()),
        "reward_mean": float((exp.rewards * mask).sum(dim=1).mean()),
        "kl_mean": float(kl_per_seq.mean()),
        "kl_per_token": float(masked_mean(exp.kl, mask)),
        "kl_coef": kl_coef,
        "entropy": float(masked_mean(entropy, mask)),
        "response_length_mean": float(mask.sum(dim=1).float().mean()),
        "truncated_fraction": float(exp.truncated.float().mean()),
        **sampler_metrics(exp),
        **critic_metrics(exp),
    }


def critic_metrics(exp: Experience) -> dict[str, float]:
    """Values, returns and explained variance at rollout; nothing without a critic (no returns)."""
    if exp.returns is None:
        return {}
    mask = exp.response_mask
    return {
        "value_mean": float(masked_mean(exp.values, mask)),
        "return_mean": float(masked_mean(exp.returns, mask)),
        "explained_variance": float(explained_variance(exp.values, exp.returns, mask)),
    }


def group_metrics(exp: Experience, group_size: int) -> dict[str, float]:
    """How much signal the groups carry: the fraction with no spread and the mean within-group std."""
    sequence_rewards = (exp.rewards * exp.response_mask).sum(dim=1)
    return {
        "group_zero_spread_fraction": float(group_zero_spread(sequence_rewards, group_size)),
        "group_reward_std": float(groups(sequence_rewards, group_size).std(dim=1).mean()),
    }


def sampler_metrics(exp: Experience) -> dict[str, float]:
    """The rollout engine's distance from the trainer (:func:`homerlhf.ppo.importance.importance_metrics`);
    none for an experience without behaviour log-probs."""
    if exp.behaviour_logprobs is None or exp.is_weights is None:
        return {}
    stats = importance_metrics(exp.old_logprobs, exp.behaviour_logprobs, exp.is_weights, exp.response_mask)
    return {key: float(value) for key, value in stats.items()}


def version_lag_metrics(exp: Experience, iteration: int) -> dict[str, float]:
    """How many updates behind the trainer (version ``iteration - 1`` during iteration ``iteration``)
    each sample's adapter was; none for an experience without policy versions."""
    if exp.policy_version is None:
        return {}
    lag = (iteration - 1 - exp.policy_version).float()  # (B,)
    return {"policy_version_lag_mean": float(lag.mean()), "policy_version_lag_max": float(lag.max())}


def kl_clamp_metrics(exp: Experience) -> dict[str, float]:
    """Where ``exp.kl`` is k3: the fraction of response tokens whose k3 was capped
    (:func:`homerlhf.ppo.math.k3_kl`, the function that computed it)."""
    mask = exp.response_mask
    _, clamped = k3_kl(exp.old_logprobs, exp.ref_logprobs, mask)
    return {"kl_clamped_frac": float(masked_mean(clamped.to(exp.old_logprobs.dtype), mask))}


KL_REF_START_WARN = 1e-3  # nats/token: the warning threshold of kl_ref_start


def kl_ref_start(exp: Experience) -> float:
    """Mean per-token KL(actor || reference) over response tokens, k3 estimator (>= 0):
    ``exp(ref_logp - logp) - 1 - (ref_logp - logp)``. On iteration 1's experience, before any
    update, it measures how far the reference is from the actor's starting weights. In float64 and
    unbounded on purpose (not :func:`homerlhf.ppo.math.k3_kl`): a diagnostic, in no reward or gradient."""
    mask = exp.response_mask.bool()
    log_ratio = (exp.ref_logprobs - exp.old_logprobs).double().masked_fill(~mask, 0.0)  # (B, T)
    return float(masked_mean(log_ratio.expm1() - log_ratio, mask))


UPDATE_METRICS = ("policy_loss", "value_loss", "policy_clipfrac", "value_clipfrac", "approx_kl", "grad_norm_actor",
                  "grad_norm_critic", "kl_ref_loss", "kl_clamped_frac_loss", "optimizer_steps",
                  "nonfinite_skipped_steps", "early_stopped", "micro_batch_size", "oom_retries", "rollout_chunk_size",
                  "oom_retries_generation", "oom_retries_scoring")
OPTIONAL_UPDATE_METRICS = ("loss_scale", "critic_warmup")  # fp16 compute only; PPO only


def time_metrics(times: StageTimes, exp: Experience, optimizer_steps: int, mini_batch_size: int,
                 iteration_s: float) -> dict[str, float]:
    """Wall seconds per stage and tokens per second of generation, scoring and update."""
    n_response = float(exp.response_mask.sum())
    n_tokens = n_response + float(exp.prompt_mask.sum())
    return {
        "time_generation_s": times.generation,
        "time_scoring_s": times.scoring,
        "time_reference_reward_wait_s": times.reference_reward_wait,
        "time_advantages_s": times.advantages,
        "time_update_s": times.update,
        "time_iteration_s": iteration_s,
        "tokens_per_s_generation": n_response / max(times.generation, 1e-9),
        "tokens_per_s_scoring": n_tokens / max(times.scoring, 1e-9),
        "tokens_per_s_update": n_tokens * optimizer_steps * mini_batch_size
        / max(len(exp), 1) / max(times.update, 1e-9),
    }


def iteration_metrics(iteration: int, rollout: Rollout, scores: Tensor, kl_coef: float, update: dict[str, float],
                      meters: Meters, cfg) -> dict[str, Any]:
    """The metrics row of one iteration (memory aside), in the order of ``METRIC_DESCRIPTIONS``.

    ``rollout``: its experience with rewards, KL and advantages computed, and the rollout entropy;
    ``scores`` (B,): as they entered the rewards; ``update``: the update's stats (the critic's and the
    group loss's only where they exist) and the OOM bookkeeping (``micro_batch_size``, ``oom_retries``,
    ``rollout_chunk_size``, ``oom_retries_generation``, ``oom_retries_scoring``); ``meters``: the
    iteration's times and start; ``cfg``: the run's (the group figures for GRPO / RLOO, ``kl_clamped_frac``
    where ``exp.kl`` is k3).
    """
    exp = rollout.exp
    row: dict[str, Any] = {
        "iteration": iteration,
        **rollout_metrics(exp, scores, rollout.entropy, kl_coef),
        **version_lag_metrics(exp, iteration),
        **(group_metrics(exp, cfg.group.size) if not cfg.has_critic else {}),
        **(kl_clamp_metrics(exp) if experience_kl_estimator(cfg) == "k3" else {}),
        **{key: update[key] for key in UPDATE_METRICS if key in update},
        **{key: update[key] for key in OPTIONAL_UPDATE_METRICS if key in update},
        **time_metrics(meters.times, exp, update["optimizer_steps"], cfg.ppo.mini_batch_size,
                       time.perf_counter() - meters.started),
    }
    return {key: row[key] for key in METRIC_DESCRIPTIONS if key in row}


def sample_records(exp: Experience, tokenizer, n: int, k: int = 0) -> list[dict[str, Any]]:
    """The iteration's samples for ``samples.jsonl``, as text with their scores: the first ``n``
    generations of ``exp`` (``rank`` "first"), then the ``k`` best-scored (``rank`` "top", best first)
    and the ``k`` worst (``rank`` "bottom", worst first). A sample can be in more than one of them."""
    first = list(range(min(n, len(exp))))
    order = sorted(range(len(exp)), key=lambda i: (-float(exp.scores[i]), i))  # best first; ties by position
    top = order[:min(k, len(exp))]
    bottom = sorted(range(len(exp)), key=lambda i: (float(exp.scores[i]), i))[:min(k, len(exp))]
    return [{**_sample(exp, tokenizer, i), "rank": rank}
            for rank, indices in (("first", first), ("top", top), ("bottom", bottom)) for i in indices]


def _sample(exp: Experience, tokenizer, i: int) -> dict[str, Any]:
    return {
        "prompt": tokenizer.decode(exp.prompt_ids[i][exp.prompt_mask[i].bool()], skip_special_tokens=False),
        "response": tokenizer.decode(exp.response_ids[i][exp.response_mask[i].bool()], skip_special_tokens=True),
        "score": float(exp.scores[i]),
        "truncated": bool(exp.truncated[i]),
    }


def token_lists(ids: Tensor, mask: Tensor) -> list[list[int]]:
    """Each row's ids where ``mask`` is set, as Python lists (a batch's prompts or responses)."""
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def signal_inputs(exp: Experience) -> tuple[list[list[int]], list[list[int]], list[float], list[float]]:
    """What the reward-hacking signals read of a batch (:meth:`homerlhf.ppo.signals.SignalMonitor.check`):
    prompts and responses as token lists (a finished response without its end token), each response's
    length with it, and the scores."""
    responses = token_lists(exp.response_ids, exp.response_mask)
    lengths = [float(len(r)) for r in responses]
    ended = (~exp.truncated.bool()).tolist()
    texts = [r[:-1] if end and r else r for r, end in zip(responses, ended)]
    return token_lists(exp.prompt_ids, exp.prompt_mask), texts, lengths, exp.scores.tolist()


def _clean(value: Any) -> Any:
    """Floats that JSON cannot hold (nan, inf) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends a row per iteration to ``metrics.jsonl`` and its samples to ``samples.jsonl``, and hands
    both to the run's experiment trackers (``logging.report_to``, :mod:`homerlhf.tracking`)."""

    def __init__(self, run_dir: str | Path, cfg=None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.samples_path = self.run_dir / "samples.jsonl"
        names = report_to(cfg.logging) if cfg is not None else ()
        self.trackers = TrackerSession(names, self.run_dir, cfg) if names else None
        self.samples_max_bytes = int(cfg.logging.samples_max_mb * 2**20) if cfg is not None else None
        self.samples_full = False  # samples.jsonl reached logging.samples_max_mb: no more rows

    def log(self, row: dict[str, Any], samples: Iterable[dict[str, Any]] = ()) -> None:
        """Row and samples of one iteration: to the two logs, then to the trackers (the iteration as the step)."""
        unknown = {key for key in row if not is_documented(key)}
        if unknown:  # a name must be documented before it is logged
            raise KeyError(f"undocumented metric names: {sorted(unknown)}")
        samples = list(samples)
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
        self.log_samples(int(row["iteration"]), samples)
        if self.trackers is not None:
            self.trackers.log(int(row["iteration"]), row, samples, self._backlog)

    def log_samples(self, iteration: int, samples: Iterable[dict[str, Any]]) -> None:
        """Append the iteration's samples, unless ``samples.jsonl`` would pass ``logging.samples_max_mb``:
        then no more rows, and one warning (an iteration's rows are written whole or not at all)."""
        lines = "".join(json.dumps({"iteration": iteration, **{k: _clean(v) for k, v in sample.items()}}) + "\n"
                        for sample in samples)
        if not lines or self.samples_full:
            return
        size = self.samples_path.stat().st_size if self.samples_path.exists() else 0
        if self.samples_max_bytes is not None and size + len(lines.encode()) > self.samples_max_bytes:
            self.samples_full = True
            log.warning("samples.jsonl reached logging.samples_max_mb (%g MiB) at iteration %d: no more samples are "
                        "written (metrics go on); raise logging.samples_max_mb to keep more",
                        self.samples_max_bytes / 2**20, iteration)
            return
        with self.samples_path.open("a") as fh:
            fh.write(lines)

    def _backlog(self, after: int) -> list[tuple[int, dict[str, Any], list[dict[str, Any]]]]:
        """The logged iterations after ``after``, each with its samples: what a tracker that holds
        iterations up to ``after`` lacks (after a resume, the logs are cut back to the checkpoint)."""
        samples: dict[int, list[dict[str, Any]]] = {}
        if self.samples_path.exists():
            for line in self.samples_path.read_text().splitlines():
                if line.strip():
                    record = json.loads(line)
                    samples.setdefault(record.pop("iteration"), []).append(record)
        return [(row["iteration"], row, samples.get(row["iteration"], []))
                for row in read_metrics(self.run_dir) if row["iteration"] > after]

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``RUN_DIR/metrics.jsonl`` (empty when there is none)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def progress_postfix(row: dict[str, Any]) -> dict[str, str]:
    """The few numbers the progress bar shows, and a flag when the iteration left its reference in one
    update (``kl_flag``, :class:`homerlhf.ppo.guards.KLJump`; its reason is in the warning line)."""
    postfix = {"score": f"{row['score_mean']:.3f}", "kl": f"{row['kl_mean']:.3f}"}
    if row.get("kl_flag"):
        postfix["warning"] = "KL jump: the policy is leaving its reference (see ppo.early_stop_kl in the log)"
    return postfix
