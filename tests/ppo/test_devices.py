"""Where a PPO iteration's tensors live, checked on the CPU: what goes to the backends is lists, what
comes back lands on the trainer's device, and an iteration makes no tensor without naming its
device. ``meta`` stands in for the GPU's second device (see ``StrayTensorsOnMeta`` in conftest)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import fields

import pytest
import torch

from homerlhf.ppo.devices import to_trainer, worker_lists
from homerlhf.ppo.rollout import RolloutBatch

META = torch.device("meta")


def _batch(device="cpu") -> RolloutBatch:
    """Two samples: prompts [5, 6] and [7] (left-padded with 0), responses [8, 2] and [9, 10, 2]."""
    t = lambda rows, **kw: torch.tensor(rows, device=device, **kw)  # noqa: E731
    return RolloutBatch(prompt_ids=t([[5, 6], [0, 7]]), prompt_mask=t([[1, 1], [0, 1]]),
                        response_ids=t([[8, 2, 0], [9, 10, 2]]), response_mask=t([[1, 1, 0], [1, 1, 1]]),
                        truncated=t([False, False]), behaviour_logprobs=t([[-1.0, -2.0, 0.0], [-3.0, -4.0, -5.0]]))


def _devices(obj) -> dict[str, str]:
    return {f.name: str(getattr(obj, f.name).device) for f in fields(obj) if isinstance(getattr(obj, f.name), torch.Tensor)}


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def test_worker_lists_are_the_unpadded_ids():
    assert worker_lists(_batch()) == ([[5, 6], [7]], [[8, 2], [9, 10, 2]])


def test_to_trainer_places_scores_rows_tensors_and_batches():
    scores = to_trainer([1, 2.5], "cpu")
    assert scores.dtype == torch.float32 and scores.tolist() == [1.0, 2.5]
    rows = to_trainer([[-1.0], [-2.0, -3.0], []], "cpu", width=3)
    assert rows.tolist() == [[-1.0, 0.0, 0.0], [-2.0, -3.0, 0.0], [0.0, 0.0, 0.0]]
    assert to_trainer(torch.tensor([[1.0, 2.0]]), "cpu", width=3).tolist() == [[1.0, 2.0, 0.0]]
    assert to_trainer([torch.tensor([1.5])], "cpu", width=2).tolist() == [[1.5, 0.0]]
    for value in (to_trainer([1.0], META), to_trainer([[1.0]], META, width=2), to_trainer(torch.ones(2), META)):
        assert value.device == META
    moved = to_trainer(_batch(), META)
    assert set(_devices(moved).values()) == {"meta"} and moved.prompt_ids.dtype == torch.long
    with pytest.raises(ValueError, match="row 0 has 3 values for 2 response tokens"):
        to_trainer([[1.0, 2.0, 3.0]], "cpu", width=2)


def test_what_the_backends_return_lands_on_the_trainers_device():
    """The trainer's old log-probs and values are on ``meta`` (the GPU), the engine's rollout on the
    CPU (a llama.cpp engine), the reference returns lists (a worker over HTTP), the reward a CPU
    tensor (an in-process model): the experience is on ``meta``, every field of it."""
    from homerlhf.config import load_config
    from homerlhf.ppo.collect import _assemble

    class CpuEngine:
        shares_trainer_weights = False

    cfg = load_config("cpu-tiny")
    on_gpu = torch.zeros((2, 3), device=META)
    pending = [(_batch("cpu"), on_gpu, on_gpu, on_gpu, _done([[-1.0, -2.0], [-3.0, -4.0, -5.0]]),
                _done(torch.tensor([0.5, 1.5])))]
    exp, entropy = _assemble(pending, cfg, CpuEngine(), pad_id=0)
    assert set(_devices(exp).values()) == {"meta"}, _devices(exp)
    assert entropy.device == META


@pytest.fixture(scope="module")
def policy_and_prompts(tiny_llama_dir):
    from homerlhf.config import load_config
    from homerlhf.data.builtin import prompt_records
    from homerlhf.models.policy import PolicyModel

    cfg = load_config("cpu-tiny", overrides=["ref.backend=adapter_off", "reward.backend=hf", "logging.progress=false"])
    policy = PolicyModel.from_config(cfg, str(tiny_llama_dir))
    prompts = [list(policy.tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                                         add_generation_prompt=True, tokenize=True, return_dict=False))
               for r in prompt_records()[:4]]
    return policy, prompts


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_an_iteration_makes_no_tensor_without_naming_its_device(policy_and_prompts, ppo_cfg, stray_tensors_on_meta,
                                                                algorithm):
    """Rollout, scoring, advantages and the update of a real 4-bit tiny policy with every tensor that
    homerlhf makes without a device sent to ``meta``: on a GPU those are the CPU tensors that meet
    CUDA ones (``policy_version`` made so broke every GPU run's first update)."""
    from homerlhf.ppo.backends import AdapterOffReference, Backends, CallableReward
    from homerlhf.ppo.trainer import RLTrainer

    policy, prompts = policy_and_prompts
    group = ("algorithm=grpo", "group.size=2") if algorithm == "grpo" else ()
    cfg = ppo_cfg("rollout.batch_size=4", "rollout.chunk_size=2", "rollout.max_new_tokens=4", "ppo.mini_batch_size=2",
                  "ppo.micro_batch_size=1", "ppo.epochs=1", *group)
    trainer = RLTrainer(cfg, policy, Backends(AdapterOffReference(policy), CallableReward(lambda p, r: float(sum(r) % 5))),
                         prompts)
    with stray_tensors_on_meta() as mode:
        rollout = trainer.rollouts.collect(trainer.iteration, trainer.next_indices, trainer.total_iterations)
        exp, entropy = rollout.exp, rollout.entropy
        assert set(_devices(exp).values()) == {str(policy.device)} and entropy.device == policy.device
        row = trainer.step()
    assert mode.sent == []
    assert row["optimizer_steps"] == 2


def test_a_batch_from_the_buffer_is_scored_on_the_trainers_device(policy_and_prompts, ppo_cfg, stray_tensors_on_meta):
    """The asynchronous mode's path: a batch sampled ahead (by an engine, with its reference
    log-probs, scores and policy versions) taken by the trainer."""
    from homerlhf.ppo.asynchronous import pending_experience, produce_batch
    from homerlhf.ppo.backends import AdapterOffReference, Backends, CallableReward
    from homerlhf.ppo.collect import Prompts, RolloutState
    from homerlhf.ppo.engines import HFEngine

    policy, prompts = policy_and_prompts
    cfg = ppo_cfg("rollout.batch_size=4", "rollout.chunk_size=2", "rollout.max_new_tokens=4", "ppo.mini_batch_size=4",
                  "ppo.micro_batch_size=2")
    reference, state = AdapterOffReference(policy), RolloutState(2)
    with stray_tensors_on_meta() as mode:
        pending = produce_batch(Backends(reference, CallableReward(lambda p, r: 1.0), HFEngine(policy)), cfg, state, 3,
                                Prompts(prompts).take([0, 1, 2, 3]), version=2, pad_id=policy.tokenizer.pad_token_id)
        exp, _ = pending_experience(policy, pending, cfg, reference, state)
    assert mode.sent == []
    assert set(_devices(exp).values()) == {str(policy.device)} and exp.policy_version.tolist() == [2] * 4
