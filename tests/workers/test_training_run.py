"""kill -9 of the reward worker during a real PPO run (tiny Llama, llama.cpp ref and reward workers)."""

from __future__ import annotations

import os
import signal

import pytest

from homerlhf.config import load_config
from homerlhf.ppo.backends import RewardBackend
from homerlhf.workers.backends import llamacpp_reward
from tolerances import LLAMA_CPP_F32


class KillingReward(RewardBackend):
    """The real llama.cpp reward backend; kills its worker (-9) just before call ``kill_at`` is sent.

    Records every answer the trainer receives, so the test can check each sample got exactly one.
    """

    def __init__(self, inner, kill_at: int):
        self.inner = inner
        self.kill_at = kill_at
        self.calls: list[tuple[list, list, list[float]]] = []
        self.killed_pid = None

    def score(self, prompt_ids, response_ids):
        if len(self.calls) == self.kill_at:
            self.killed_pid = self.inner.client.process.pid
            os.kill(self.killed_pid, signal.SIGKILL)
        scores = self.inner.score(prompt_ids, response_ids)
        self.calls.append(([list(p) for p in prompt_ids], [list(r) for r in response_ids], scores))
        return scores

    def close(self):
        super().close()
        self.inner.close()


@pytest.mark.slow
def test_kill_9_reward_worker_during_training(tiny_llama_dir, llama_rm_dir, llama_rm_export, tmp_path):
    import psutil
    import torch
    from transformers import AutoModelForSequenceClassification

    from homerlhf.stages.ppo import run_ppo

    cfg = load_config("cpu-tiny", None, [
        f"model.name_or_path={tiny_llama_dir}", f"reward.model={llama_rm_export}",
        "ppo.iterations=1", "ppo.epochs=1", "rollout.batch_size=6", "rollout.chunk_size=2",
        "ppo.mini_batch_size=6", "ppo.micro_batch_size=6", "rollout.max_new_tokens=6",
        "rollout.truncation_penalty=null", "logging.progress=false", "logging.samples_per_iteration=0", "checkpoint.every=5",
    ])
    from transformers import AutoTokenizer

    inner = llamacpp_reward(cfg, AutoTokenizer.from_pretrained(tiny_llama_dir), tmp_path / "run")
    chunks_per_iteration = cfg.rollout.batch_size // cfg.rollout.chunk_size
    reward = KillingReward(inner, kill_at=1)  # mid-iteration: chunk 0 scored, chunks 1 and 2 to come
    result = run_ppo(cfg, tmp_path / "run", reward=reward)

    assert [row["iteration"] for row in result["metrics"]] == [1]  # the run completed
    assert inner.client.restarts == 1 and reward.killed_pid is not None
    assert not psutil.pid_exists(reward.killed_pid) or psutil.Process(reward.killed_pid).status() == psutil.STATUS_ZOMBIE
    assert not inner.client.process.alive()  # run_ppo closed the backend: no worker left

    calls = reward.calls  # all in the iteration the kill fell in
    assert len(calls) == chunks_per_iteration
    assert [len(s) for _, _, s in calls] == [len(p) for p, _, _ in calls] == [cfg.rollout.chunk_size] * chunks_per_iteration
    scores = [s for _, _, chunk in calls for s in chunk]
    # Each sample's score is its own (a re-sent request answered out of order would show here):
    # the HF reward model, an independent implementation, gives the same numbers.
    hf = AutoModelForSequenceClassification.from_pretrained(llama_rm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        again = [hf(torch.tensor([p + r])).logits[0, 0].item() for prompts, responses, _ in calls
                 for p, r in zip(prompts, responses)]
    assert max(abs(a - b) for a, b in zip(scores, again)) < LLAMA_CPP_F32
    # ...and the trainer used exactly these scores, once each (the truncation penalty is off).
    assert cfg.rollout.truncation_penalty is None
    assert result["metrics"][0]["score_mean"] == pytest.approx(sum(scores) / len(scores), abs=1e-5)
