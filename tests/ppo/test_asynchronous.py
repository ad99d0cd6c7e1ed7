"""The asynchronous mode's pieces on a real tiny policy: a batch sampled ahead (in the background
thread, through the on-disk buffer) and scored when taken gives the experience that the synchronous
path gives for the same seeds; each sample carries the version of the adapter that sampled it. The
whole mode (llama.cpp engine, kill -9 and resume) runs in tests/stages/test_resume.py."""

from __future__ import annotations

import pytest
import torch

from homerlhf.models.policy import PolicyModel
from homerlhf.ppo.asynchronous import RolloutsAhead, pending_experience
from homerlhf.ppo.backends import AdapterOffReference, Backends, CallableReward, ReferenceBackend
from homerlhf.ppo.collect import Prompts, RolloutState, collect_experience
from homerlhf.ppo.engines import HFEngine
from homerlhf.ppo.meters import Meters
from homerlhf.ppo.rng import sample_seeds
from tolerances import fp32_bound


class ThreadedReference(ReferenceBackend):
    """The adapter-off log-probs, computed in the backend's worker thread like a remote reference's
    (the policy is idle meanwhile in these tests)."""

    def __init__(self, policy):
        self.inner = AdapterOffReference(policy, batch_size=4)

    def logprobs(self, prompt_ids, response_ids):
        return self.inner.logprobs(prompt_ids, response_ids)


@pytest.fixture(scope="module")
def setup(tiny_llama_dir):
    from homerlhf.config import load_config
    from homerlhf.data.builtin import prompt_records

    cfg = load_config("cpu-tiny", overrides=["ref.backend=adapter_off", "reward.backend=hf", "logging.progress=false",
                                             "rollout.batch_size=6", "rollout.chunk_size=4", "ppo.mini_batch_size=6", "ppo.micro_batch_size=2",
                                             "rollout.max_new_tokens=10", "quant.load_in_4bit=false"])
    policy = PolicyModel.from_config(cfg, str(tiny_llama_dir))
    tok = policy.tokenizer
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)) for r in prompt_records()[:6]]
    return cfg, policy, prompts


def _reward():
    return CallableReward(lambda p, r: float(len(r)) - 0.5 * len(p))


@pytest.mark.parametrize("reference_kind", ["threaded", "adapter_off"])
def test_ahead_then_taken_equals_the_synchronous_experience(setup, tmp_path, reference_kind):
    cfg, policy, prompts = setup
    reference = ThreadedReference(policy) if reference_kind == "threaded" else AdapterOffReference(policy, 4)
    indices = [5, 0, 3, 1, 2, 4]
    chosen = [prompts[i] for i in indices]
    sync, _ = collect_experience(policy, Prompts(chosen, seeds=sample_seeds(cfg.seed, 7, 6)), cfg,
                                 Backends(reference, _reward()), RolloutState(cfg.rollout.chunk_size))

    ahead = RolloutsAhead(policy, cfg, Backends(reference, _reward(), HFEngine(policy)), Prompts(prompts),
                          RolloutState(cfg.rollout.chunk_size), Meters(), tmp_path / "run")
    ahead.start(7, indices, version=4)
    ahead.settle()
    assert (tmp_path / "run" / "buffer" / "pending.json").is_file()  # it went through the disk
    pending = ahead.take()
    ahead.close()
    assert pending.iteration == 7 and pending.indices == indices
    assert (pending.ref_logprobs is None) == (reference_kind == "adapter_off")  # then taken by the trainer
    exp, _ = pending_experience(policy, pending, cfg, reference, RolloutState(cfg.rollout.chunk_size))

    assert exp.policy_version.tolist() == [4] * 6
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "truncated", "scores"):
        assert torch.equal(getattr(exp, name), getattr(sync, name)), name
    for name in ("old_logprobs", "ref_logprobs", "values"):  # scored in other chunks (tests/tolerances.py)
        want = getattr(sync, name)
        assert torch.allclose(getattr(exp, name), want, atol=fp32_bound(want.abs().max()), rtol=0), name
    # The engine's behaviour log-probs are the trainer's (HF generate on the same module), not taken as equal;
    # an importance weight exp(old - behaviour) is 1 within the same bound (its log-probs' difference).
    mask = exp.response_mask.bool()
    bound = fp32_bound(exp.old_logprobs[mask].abs().max())
    assert float((exp.behaviour_logprobs - exp.old_logprobs).abs()[mask].max()) < bound
    assert float((exp.is_weights - 1).abs()[mask].max()) < 2 * bound


def test_a_failed_batch_ahead_surfaces_once_and_leaves_nothing(setup, tmp_path):
    cfg, policy, prompts = setup

    def broken(p, r):
        raise ValueError("reward down")

    ahead = RolloutsAhead(policy, cfg, Backends(ThreadedReference(policy), CallableReward(broken), HFEngine(policy)),
                          Prompts(prompts), RolloutState(cfg.rollout.chunk_size), Meters(), tmp_path / "run")
    ahead.start(2, [0, 1, 2, 3, 4, 5], version=1)
    with pytest.raises(ValueError, match="reward down"):
        ahead.take()
    assert ahead.take() is None  # raised once; no batch in the buffer
    ahead.close()
