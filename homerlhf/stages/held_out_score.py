"""A policy's score on prompts it never trained on, by a reward function: before and after a run.

:class:`HeldOutScore` loads the run's policy model once (``cfg.model.name_or_path`` with the actor
adapter), samples ``samples`` answers per held-out prompt (temperature and length from
``cfg.rollout``: the policy RL optimises) and scores them with ``reward`` (a ``reward.function`` spec,
e.g. ``builtin:capitals``). :meth:`HeldOutScore.score` scores the model under the adapter (``None``)
or a checkpoint's actor adapter, with the same per-sample seeds for every model, so two scores differ
by what the training changed, not by the draw. Used by ``notebooks/first_real_model.ipynb`` and
``benchmarks/real_learning.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from homerlhf.config import RunConfig


class HeldOutScore:
    def __init__(self, cfg: RunConfig, prompts: str, reward: str, samples: int = 1):
        from homerlhf.models.policy import PolicyModel
        from homerlhf.models.registry import resolve_model
        from homerlhf.ppo.reward_functions import load_reward_function
        from homerlhf.stages.ppo import load_prompt_rows

        self.cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"prompts": prompts})})
        self.reward = load_reward_function(reward)
        self.policy = PolicyModel.from_config(self.cfg, resolve_model(self.cfg.model.name_or_path))
        self.prompt_ids, self.rows = load_prompt_rows(self.cfg, self.policy.tokenizer)
        self.samples = samples

    @torch.no_grad()
    def score(self, checkpoint: Optional[str | Path], seed: int = 0) -> dict[str, Any]:
        """``{"score": mean reward, "full": share of answers scoring 1, "answers": [{"prompt", "response",
        "reward"}]}`` of the model under the adapter (``checkpoint`` None) or of ``checkpoint``'s actor.
        An answer the reward gives None counts as 0."""
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        from homerlhf.ppo.rollout import generate_rollout

        repeated = [p for p in self.prompt_ids for _ in range(self.samples)]
        seeds = [seed * 1_000_003 + i for i in range(len(repeated))]
        if checkpoint is None:
            with self.policy.model.disable_adapter():
                batch = generate_rollout(self.policy, repeated, self.cfg.rollout, seeds=seeds)
        else:
            weights = load_file(str(Path(checkpoint) / "actor" / "adapter_model.safetensors"), device=str(self.policy.device))
            set_peft_model_state_dict(self.policy.peft_model_of("actor"), weights, adapter_name="actor")
            batch = generate_rollout(self.policy, repeated, self.cfg.rollout, seeds=seeds)
        tokenizer = self.policy.tokenizer
        answers = []
        for i, ids in enumerate(batch.response_lists()):
            row, prompt = self.rows[i // self.samples], repeated[i]
            text = tokenizer.decode(ids, skip_special_tokens=True)
            value = self.reward({"prompt": tokenizer.decode(prompt, skip_special_tokens=True), "response": text,
                                 "prompt_ids": list(prompt), "response_ids": list(ids), "row": row})
            answers.append({"prompt": row.get("prompt", ""), "response": text, "reward": value or 0.0})
        rewards = [a["reward"] for a in answers]
        return {"score": sum(rewards) / len(rewards), "full": sum(r == 1.0 for r in rewards) / len(rewards),
                "answers": answers}
