"""Rollout engines: what samples an iteration's responses (``rollout.engine``).

An engine takes prompt ids and the rollout settings and returns a :class:`RolloutBatch`: response
ids, the stop/truncation flags and the *behaviour* log-prob of each sampled token, the log-prob
under the distribution the engine really sampled from. The trainer recomputes its own old log-probs
either way; where the engine's weights are not exactly the trainer's (an exported copy, another
precision) the two differ, and :mod:`homerlhf.ppo.importance` measures and corrects that.

- :class:`HFEngine` (``hf``): the actor's own ``generate``, the trainer's module itself (HF ``generate``
  or, ``rollout.decoder``, the static-cache loop captured as a CUDA graph: the same samples).
- ``llamacpp``: :class:`homerlhf.workers.rollout_engine.LlamaCppEngine`, built by the PPO stage
  (the workers layer sits above this one).

Before every rollout the trainer calls :meth:`RolloutEngine.sync` with the policy, so an engine
holding a copy of the actor's weights can take the current ones.
"""

from __future__ import annotations

from typing import Optional, Sequence

from homerlhf.config.schema import RolloutConfig
from homerlhf.ppo.rollout import RolloutBatch, generate_rollout


class RolloutEngine:
    """Samples one response per prompt; see the module docstring."""

    name: str = ""
    # True when the sampler is the trainer's own module: its behaviour log-probs then equal the
    # trainer's old log-probs up to float noise, and the trainer takes them as equal.
    shares_trainer_weights: bool = False

    def sync(self, policy) -> None:
        """Take the actor's current weights (called before every rollout)."""

    def generate(self, prompts: Sequence[Sequence[int]], rollout: RolloutConfig,
                 seeds: Optional[Sequence[int]] = None) -> RolloutBatch:
        """Prompts (at most ``rollout.max_prompt_len`` ids each) -> a batch with ``behaviour_logprobs``.
        ``seeds``: one per prompt, for engines that draw each sample from a stream of its own."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the engine holds. Safe to call twice."""


class HFEngine(RolloutEngine):
    """HF ``generate`` with the actor adapter: behaviour log-probs are the raw logits it sampled
    from, at ``rollout.temperature`` (:class:`homerlhf.models.generation.BehaviourLogprobs`)."""

    name = "hf"
    shares_trainer_weights = True

    def __init__(self, policy):
        self.policy = policy

    def sync(self, policy) -> None:
        self.policy = policy

    def generate(self, prompts: Sequence[Sequence[int]], rollout: RolloutConfig,
                 seeds: Optional[Sequence[int]] = None) -> RolloutBatch:
        return generate_rollout(self.policy, prompts, rollout, seeds=seeds)
