"""Rollout and scoring under out-of-memory errors: the chunk halves, the iteration finishes, and
every sample is the one it would have been without the error."""

from __future__ import annotations

import pytest
import torch

from homerlhf.errors import UserError
from homerlhf.models.policy import PolicyModel
from homerlhf.ppo.backends import AdapterOffReference, Backends, CallableReward
from homerlhf.ppo.collect import Prompts, RolloutState, collect_experience
from homerlhf.ppo.rng import sample_seeds
from tolerances import fp32_bound


def _fail_first(obj, name: str, times: int):
    """``obj.name`` raising ``torch.cuda.OutOfMemoryError`` on its first ``times`` calls; the sizes it saw."""
    real, seen = getattr(obj, name), []

    def wrapped(*args, **kwargs):
        seen.append(args[0].shape[0])  # rows of the batch it was called with
        if len(seen) <= times:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected, call {len(seen)})")
        return real(*args, **kwargs)

    setattr(obj, name, wrapped)
    return seen


@pytest.fixture(scope="module")
def setup(tiny_llama_dir):
    from homerlhf.config import load_config
    from homerlhf.data.builtin import prompt_records

    cfg = load_config("cpu-tiny", overrides=["ref.backend=adapter_off", "reward.backend=hf", "logging.progress=false",
                                             "rollout.batch_size=8", "rollout.chunk_size=4", "ppo.mini_batch_size=8",
                                             "rollout.max_new_tokens=12", "quant.load_in_4bit=false"])
    policy = PolicyModel.from_config(cfg, str(tiny_llama_dir))
    tok = policy.tokenizer
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)) for r in prompt_records()[:8]]
    return cfg, policy, prompts


def _collect(setup, state, seeds):
    cfg, policy, prompts = setup
    reward = CallableReward(lambda p, r: float(len(r)))
    exp, _ = collect_experience(policy, Prompts(prompts, seeds=seeds), cfg,
                                Backends(AdapterOffReference(policy, batch_size=4), reward), state)
    return exp


def _responses(exp) -> list[list[int]]:
    return [ids[mask.bool()].tolist() for ids, mask in zip(exp.response_ids, exp.response_mask)]


def test_oom_in_generation_and_in_scoring_halves_the_chunk_and_keeps_every_sample(setup):
    cfg, policy, prompts = setup
    seeds = sample_seeds(cfg.seed, 1, len(prompts))
    torch.manual_seed(0)
    clean_state = RolloutState(4)
    clean = _collect(setup, clean_state, seeds)
    assert clean_state.chunk_size == 4 and clean_state.oom_retries_generation == clean_state.oom_retries_scoring == 0

    generated = _fail_first(policy, "generate", times=1)
    scored = _fail_first(policy, "actor_logprobs_and_values", times=1)
    try:
        torch.manual_seed(123)  # another global state: per-sample generators must make it irrelevant
        state = RolloutState(4)
        again = _collect(setup, state, seeds)
    finally:
        del policy.generate, policy.actor_logprobs_and_values  # the class's methods again
    # generate 4: OOM -> 2; score those 2: OOM -> 1 each; the chunk stays 1 for the 6 prompts left.
    assert generated == [4, 2] + [1] * 6
    assert scored == [2, 1, 1] + [1] * 6
    assert state.chunk_size == 1 and state.oom_retries_generation == 1 and state.oom_retries_scoring == 1
    assert _responses(again) == _responses(clean)  # the same samples
    assert len({tuple(r) for r in _responses(clean)}) > 1  # and they differ from one another
    mask = clean.response_mask.bool()
    width = mask.shape[1]
    # Scored in other chunks: other batch shapes (tests/tolerances.py).
    for name in ("old_logprobs", "values"):
        want = getattr(clean, name)[mask]
        assert torch.allclose(getattr(again, name)[:, :width][mask], want, atol=fp32_bound(want.abs().max()), rtol=0)
    assert torch.equal(again.scores, clean.scores)


def test_oom_in_reference_scoring_halves_its_batch_and_gives_the_same_logprobs(setup):
    """``ref.backend=adapter_off`` on the policy's own base: an OOM there is the trainer's OOM, so it
    halves the reference's batch (for the rest of the run) instead of ending the run at
    ``ref_future.result()``."""
    _, policy, prompts = setup
    responses = [p[-6:] for p in reversed(prompts[:5])]  # in-vocabulary ids, rows of other lengths
    reference = AdapterOffReference(policy, batch_size=4)
    clean = reference.logprobs(prompts[:5], responses)
    seen = _fail_first(policy, "reference_logprobs", times=1)
    try:
        future = reference.submit_logprobs(prompts[:5], responses)
        again = future.result()
    finally:
        del policy.reference_logprobs
    assert seen == [4, 2, 2, 1] and reference.batch_size == 2  # 4: OOM -> 2; then 2, 2 and the last row
    assert [len(r) for r in again] == [len(r) for r in responses]
    for a, b in zip(again, clean):  # other batches, other padding: the same log-probs (tests/tolerances.py)
        assert a == pytest.approx(b, abs=fp32_bound(max(map(abs, b))))


def test_seeds_make_samples_independent_of_the_chunking(setup):
    cfg, policy, prompts = setup
    seeds = sample_seeds(cfg.seed, 3, len(prompts))
    whole = _responses(_collect(setup, RolloutState(8), seeds))
    torch.manual_seed(7)
    assert _responses(_collect(setup, RolloutState(3), seeds)) == whole  # chunks of 3, 3, 2
    assert _responses(_collect(setup, RolloutState(8), sample_seeds(cfg.seed, 4, len(prompts)))) != whole


def test_oom_at_chunk_one_is_one_line(setup):
    _, policy, _ = setup
    _fail_first(policy, "generate", times=10)
    try:
        with pytest.raises(UserError, match=r"out of GPU memory in generation even with rollout.chunk_size=1"):
            _collect(setup, RolloutState(2), None)
    finally:
        del policy.generate


def test_other_errors_pass_through(setup):
    _, policy, _ = setup

    def broken(*args, **kwargs):
        raise ValueError("not an OOM")

    policy.actor_logprobs_and_values = broken
    try:
        with pytest.raises(ValueError, match="not an OOM"):
            _collect(setup, RolloutState(4), None)
    finally:
        del policy.actor_logprobs_and_values


def test_a_generation_chunk_of_its_own_halves_alone_and_scoring_keeps_its_chunk(setup):
    """``rollout.generation_chunk`` apart from ``rollout.chunk_size``: 8 prompts generated at once and
    scored 2 at a time; an OOM in generation halves the generation chunk only, and the samples are the
    ones the shared chunk gives."""
    cfg, policy, prompts = setup
    seeds = sample_seeds(cfg.seed, 5, len(prompts))
    shared = _responses(_collect(setup, RolloutState(4), seeds))
    generated = _fail_first(policy, "generate", times=1)
    scored = _fail_first(policy, "actor_logprobs_and_values", times=0)
    try:
        state = RolloutState(2, generation_chunk=8)
        apart = _collect(setup, state, seeds)
    finally:
        del policy.generate, policy.actor_logprobs_and_values
    assert generated == [8, 4, 4]  # 8: OOM -> 4, then the 4 left
    assert scored == [2, 2, 2, 2]  # each generated chunk scored in pieces of the scoring chunk
    assert (state.generation_chunk, state.chunk_size, state.oom_retries_generation) == (4, 2, 1)
    assert _responses(apart) == shared
