"""The non-finite guard: bad steps are skipped and counted; N in a row stop with one clear line."""

from __future__ import annotations

import math


import pytest
import torch

from homerlhf.errors import UserError
from homerlhf.ppo.guards import NonFiniteError, NonFiniteGuard, grads_finite, is_finite


def test_is_finite_and_grads_finite():
    assert is_finite(1.0) and is_finite(torch.tensor([1.0, -2.0]))
    assert not is_finite(math.nan) and not is_finite(torch.tensor([1.0, math.inf]))
    w = torch.nn.Parameter(torch.ones(2))
    b = torch.nn.Parameter(torch.ones(1))  # no grad: ignored
    (w * torch.tensor([1.0, 2.0])).sum().backward()
    assert grads_finite([w, b])
    w.grad[0] = math.nan
    assert not grads_finite([w, b])


def test_skips_and_resets_then_stops_after_n_in_a_row(tmp_path):
    guard = NonFiniteGuard(3)
    assert guard.check({"policy_loss": 0.5, "grad_norm_actor": torch.tensor(1.0)})
    assert not guard.check({"policy_loss": math.nan, "grad_norm_actor": 1.0})
    assert not guard.check({"policy_loss": 0.1, "grad_norm_actor": math.inf})
    assert guard.check({"policy_loss": 0.1, "grad_norm_actor": 1.0})  # a good step resets the run
    assert (guard.in_row, guard.skipped_total) == (0, 2)
    guard.last_checkpoint = tmp_path / "checkpoints" / "iter_000004"
    assert not guard.check({"value_loss": math.nan})
    assert not guard.check({"value_loss": math.nan})
    with pytest.raises(NonFiniteError) as info:
        guard.check({"value_loss": math.inf})
    message = str(info.value)
    assert isinstance(info.value, UserError) and info.value.exit_code == 1
    assert "3 optimizer steps in a row had a non-finite value_loss" in message
    assert "iter_000004" in message and "--resume" in message and "\n" not in message
    restored = NonFiniteGuard(3)
    restored.load_state_dict(guard.state_dict())
    assert restored.skipped_total == 5


def test_trainer_skips_nonfinite_steps_and_stops_with_last_good_checkpoint(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file

    from homerlhf.config import load_config
    from homerlhf.models.policy import PolicyModel
    from homerlhf.ppo.backends import AdapterOffReference, CallableReward
    from homerlhf.ppo.checkpoint import latest_complete_checkpoint
    from homerlhf.ppo.metrics import read_metrics
    from homerlhf.ppo.trainer import PPOTrainer, seed_everything

    cfg = load_config("cpu-tiny", overrides=[
        "ref.backend=adapter_off", "quant.load_in_4bit=false", "rollout.batch_size=4", "rollout.chunk_size=4",
        "rollout.max_new_tokens=4", "ppo.mini_batch_size=2", "ppo.micro_batch_size=2", "ppo.epochs=1",
        "checkpoint.every=1", "checkpoint.keep=5", "training.max_nonfinite_steps=3", "logging.progress=false",
        "rollout.truncation_penalty=null"])  # else the cut replies' NaN scores become the preset's -5
    seed_everything(0)
    policy = PolicyModel.from_config(cfg, str(tiny_llama_dir))
    calls = []

    def score(prompt, response):  # sane for iteration 1, then a reward model gone bad
        calls.append(1)
        return 1.0 if len(calls) <= 4 else math.nan

    prompts = [policy.tokenizer(f"prompt {i}")["input_ids"] for i in range(8)]
    trainer = PPOTrainer(cfg, policy, AdapterOffReference(policy), CallableReward(score), prompts, tmp_path)
    with pytest.raises(NonFiniteError, match="3 optimizer steps in a row") as info:
        trainer.train(10)
    # Iteration 2 ran both its steps into NaN and skipped them; iteration 3 hit the limit. No
    # checkpoint was taken while the streak lasted: iteration 1's is the last good one.
    assert "iter_000001" in str(info.value)
    rows = read_metrics(tmp_path)
    assert [r["iteration"] for r in rows] == [1, 2]
    assert rows[0]["nonfinite_skipped_steps"] == 0 and rows[1]["nonfinite_skipped_steps"] == 2
    last = latest_complete_checkpoint(tmp_path)
    assert last.name == "iter_000001"
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["iter_000001"]
    for adapter in ("actor", "critic"):  # the skipped steps changed nothing
        saved = load_file(str(last / adapter / "adapter_model.safetensors"))
        live = {k.replace(f".{adapter}.", "."): v for k, v in policy.model.named_parameters()
                if "lora_" in k and f".{adapter}." in k}
        assert sorted(live) == sorted(saved)
        assert all(torch.equal(live[k].detach(), saved[k]) for k in saved), adapter
    head = load_file(str(last / "value_head.safetensors"))
    assert torch.equal(policy.value_head.linear.weight.detach(), head["linear.weight"])
