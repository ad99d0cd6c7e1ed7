"""The hf rollout engine: the actor's own generate behind the engine interface, its behaviour
log-probs the distribution HF sampled from, and a training step whose IS metrics are exactly 1/0/0."""

from __future__ import annotations

import pytest
import torch

from homerlhf.config import load_config
from homerlhf.ppo.engines import HFEngine
from tolerances import fp32_bound


@pytest.fixture(scope="module")
def policy(tiny_llama_dir):
    from homerlhf.models.policy import PolicyModel

    cfg = load_config("cpu-tiny", overrides=["ref.backend=adapter_off", "reward.backend=hf", "rollout.temperature=0.7"])
    return PolicyModel.from_config(cfg, str(tiny_llama_dir))


def test_hf_engine_behaviour_logprobs_are_what_generate_sampled_from(policy):
    """Same seed, same samples as generate(output_logits=True); behaviour log-probs equal
    log_softmax(raw logits / 0.7) of the sampled tokens and the trainer's old log-probs to 1e-4."""
    from homerlhf.models.generation import build_generation_config, checkpoint_defaults_off
    from homerlhf.ppo.collect import score_with_policy
    from homerlhf.ppo.rollout import pad_sequences

    cfg = load_config("cpu-tiny", overrides=["rollout.temperature=0.7", "rollout.max_new_tokens=8"])
    prompts = [[4, 300, 301, 302, 20, 6], [4, 6], [4, 77, 78, 6]]
    torch.manual_seed(11)
    batch = HFEngine(policy).generate(prompts, cfg.rollout)

    pad = policy.tokenizer.pad_token_id
    p_ids, p_mask = pad_sequences(prompts, pad)
    config = build_generation_config(max_new_tokens=8, temperature=0.7, stop_ids=policy.stop_ids, pad_id=pad)
    config.output_logits, config.return_dict_in_generate = True, True
    torch.manual_seed(11)
    with torch.no_grad(), policy.use_adapter("actor"), checkpoint_defaults_off(policy.model.get_base_model(), config):
        out = policy.model.generate(input_ids=p_ids, attention_mask=p_mask, generation_config=config)
    response = out.sequences[:, p_ids.shape[1]:]
    mask = batch.response_mask.bool()
    assert torch.equal(torch.where(mask, response, pad), batch.response_ids)
    raw = torch.stack(out.logits, dim=1).float()
    expected = torch.log_softmax(raw / 0.7, -1).gather(-1, response.unsqueeze(-1)).squeeze(-1)
    assert batch.behaviour_logprobs.shape == batch.response_ids.shape
    bound = fp32_bound(torch.where(mask, expected, 0.0).abs().max())  # other kernels (tests/tolerances.py)
    torch.testing.assert_close(batch.behaviour_logprobs, torch.where(mask, expected, 0.0), atol=bound, rtol=0)
    old, _, _ = score_with_policy(policy, batch)
    torch.testing.assert_close(batch.behaviour_logprobs, old * mask, atol=bound, rtol=0)
    assert float((batch.behaviour_logprobs * mask).sum()) < 0  # real log-probs, not zeros


def test_hf_engine_run_reports_exactly_one_zero_zero(tiny_llama_dir, ppo_cfg, prompt_ids):
    from homerlhf.models.policy import PolicyModel
    from homerlhf.ppo.backends import AdapterOffReference, Backends, CallableReward
    from homerlhf.ppo.trainer import RLTrainer, seed_everything

    cfg = ppo_cfg("rollout.batch_size=4", "rollout.chunk_size=2", "rollout.max_new_tokens=4", "ppo.mini_batch_size=2",
                  "ppo.micro_batch_size=2", "ppo.epochs=2", "actor.lr=1e-2")
    seed_everything(0)
    policy = PolicyModel.from_config(cfg, str(tiny_llama_dir))
    trainer = RLTrainer(cfg, policy, Backends(AdapterOffReference(policy), CallableReward(lambda p, r: float(len(r)))),
                         prompt_ids(policy.tokenizer, 4))
    assert isinstance(trainer.backends.engine, HFEngine)
    for _ in range(2):  # the second after an update: still the trainer's own module
        row = trainer.step()
        assert (row["is_weight_mean"], row["is_weight_max"], row["is_capped_fraction"], row["kl_behaviour_old"]) == \
            (1.0, 1.0, 0.0, 0.0)
