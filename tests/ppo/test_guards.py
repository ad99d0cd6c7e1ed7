"""The run's guards. The non-finite guard: bad steps are skipped and counted; N in a row stop with one
clear line. The KL-jump flag: an update that leaves the reference is flagged with its likely cause
and the setting that stops it, in the metrics, the log, the progress line and the app's monitor."""

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
    from homerlhf.ppo.backends import AdapterOffReference, Backends, CallableReward
    from homerlhf.ppo.checkpoint import latest_complete_checkpoint
    from homerlhf.ppo.metrics import read_metrics
    from homerlhf.ppo.trainer import RLTrainer, seed_everything

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
    trainer = RLTrainer(cfg, policy, Backends(AdapterOffReference(policy), CallableReward(score)), prompts, tmp_path)
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


# -- the KL-jump flag --------------------------------------------------------------------------------
def _kl_cfg(*overrides):
    from homerlhf.config import load_config

    # cpu-tiny: ppo.target_kl 2, ppo.score_norm false; the issue's run: actor lr 5e-4, 2 epochs
    return load_config("cpu-tiny", overrides=["actor.lr=5e-4", "ppo.epochs=2", *overrides])


def test_kl_jump_flags_the_issues_update_by_hand(caplog):
    from homerlhf.ppo.guards import KLJump

    jump = KLJump(_kl_cfg())
    assert jump.check({"iteration": 1, "kl_mean": 0.02, "approx_kl": 0.004, "score_std": 3.21}) == {"kl_flag": 0}
    with caplog.at_level("WARNING", logger="homerlhf.ppo.guards"):
        out = jump.check({"iteration": 2, "kl_mean": 17.1, "approx_kl": 0.34, "score_std": 3.214})
    assert out["kl_jump"] == pytest.approx(17.08, abs=1e-12) and out["kl_flag"] == 1
    reason = out["kl_flag_reason"]
    assert reason == (
        "iteration 2: the policy is leaving its reference: KL to the reference rose 17.08 nats in one update "
        "(0.02 -> 17.10 nats per response), past the run's budget ppo.target_kl=2; the update moved the policy "
        "0.340 nats/token (approx_kl) from the one that sampled, past 0.1; likely cause: actor.lr 0.0005 too high "
        "for this model, ppo.epochs 2 (each batch trained 2 times), raw reward scale (ppo.score_norm false, "
        "score std 3.21); set ppo.early_stop_kl=0.1 (stops an update's epochs once approx_kl passes it) and "
        "lower actor.lr")
    assert [r.getMessage() for r in caplog.records] == [reason]
    # A small step after it: 17.1 -> 17.25 is 0.15 nats, approx_kl 0.01; the bounds are strict (> 2, > 0.1).
    assert jump.check({"iteration": 3, "kl_mean": 17.25, "approx_kl": 0.01}) == \
        {"kl_jump": pytest.approx(0.15, abs=1e-12), "kl_flag": 0}
    assert jump.check({"iteration": 4, "kl_mean": 19.25, "approx_kl": 0.1}) == {"kl_jump": 2.0, "kl_flag": 0}


def test_a_kl_that_creeps_past_the_budget_is_flagged_once_a_crossing(caplog):
    from homerlhf.ppo.guards import KLJump

    # target_kl 2: 1.5 -> 2.0 is at the budget, not past it; 2.0 -> 2.6 crosses it by a 0.6-nat update.
    jump = KLJump(_kl_cfg("ppo.early_stop_kl=0.1", "ppo.epochs=1", "ppo.score_norm=true"))
    assert jump.check({"iteration": 1, "kl_mean": 1.5, "approx_kl": 0.01}) == {"kl_flag": 0}
    assert jump.check({"iteration": 2, "kl_mean": 2.0, "approx_kl": 0.01})["kl_flag"] == 0
    with caplog.at_level("WARNING", logger="homerlhf.ppo.guards"):
        out = jump.check({"iteration": 3, "kl_mean": 2.6, "approx_kl": 0.02, "kl_coef": 0.0512})
    assert out["kl_flag"] == 1 and out["kl_jump"] == pytest.approx(0.6, abs=1e-12)
    assert out["kl_flag_reason"] == (
        "iteration 3: the policy is leaving its reference: KL to the reference reached 2.60 nats per response "
        "(2.00 the iteration before), past the run's budget ppo.target_kl=2, by updates each under it; likely "
        "cause: actor.lr 0.0005 too high for this model; raise ppo.kl_coef (this iteration's 0.0512) or lower "
        "actor.lr")
    assert [r.getMessage() for r in caplog.records] == [out["kl_flag_reason"]]
    # Above the budget it stays unflagged (once a crossing); back under it and over again is a new crossing.
    assert jump.check({"iteration": 4, "kl_mean": 3.1, "approx_kl": 0.02})["kl_flag"] == 0
    assert jump.check({"iteration": 5, "kl_mean": 1.9, "approx_kl": 0.02})["kl_flag"] == 0
    assert jump.check({"iteration": 6, "kl_mean": 2.2, "approx_kl": 0.02})["kl_flag_reason"].endswith(
        "raise ppo.kl_coef or lower actor.lr")


def test_kl_jump_with_early_stop_set_and_the_gpu_presets_settings():
    from homerlhf.ppo.guards import KLJump

    # ppo.early_stop_kl is the approx_kl bound when set; one epoch and normalised scores leave the lr
    jump = KLJump(_kl_cfg("ppo.early_stop_kl=0.05", "ppo.epochs=1", "ppo.score_norm=true"), warn=False)
    out = jump.check({"iteration": 1, "kl_mean": 0.0, "approx_kl": 0.06})
    assert "kl_jump" not in out and out["kl_flag"] == 1
    assert out["kl_flag_reason"].endswith(
        "past 0.05; likely cause: actor.lr 0.0005 too high for this model; ppo.early_stop_kl is 0.05: lower it, "
        "or lower actor.lr")
    assert jump.check({"iteration": 2, "kl_mean": float("nan"), "approx_kl": 0.04}) == {"kl_flag": 0}
    assert jump.check({"iteration": 3, "kl_mean": 2.5, "approx_kl": 0.01})["kl_jump"] == 2.5  # from the last finite


def test_the_gpu_presets_stop_an_update_past_0_1_nats_per_token():
    """Measured not to stop a healthy run (benchmarks/kl_jump.py, docs/ppo_details.md detail 9); the
    cpu-tiny preset, whose demo figures were measured without it, has none."""
    from homerlhf.config import load_config, preset_names

    bounds = {name: load_config(name).ppo.early_stop_kl for name in preset_names()}
    assert bounds.pop("cpu-tiny") is None
    assert bounds == {name: 0.1 for name in ("3060-12g", "3090", "4060ti-16g", "4080", "4090", "a100-80g", "t4-colab")}


@pytest.fixture(scope="module")
def kl_runs(peaked_policy_dir, tmp_path_factory):
    """Two real 2-iteration PPO runs of a tiny Llama with a peaked next-token distribution (like a
    trained LM's), same seed and reward: the actor at a hand-made lr of 1e-2 over 2 epochs (one update
    drives it off its reference) and at 1e-4 over 1 epoch."""
    from homerlhf.config import load_config
    from homerlhf.models.policy import PolicyModel
    from homerlhf.ppo.backends import AdapterOffReference, Backends, CallableReward
    from homerlhf.ppo.metrics import read_metrics
    from homerlhf.ppo.trainer import RLTrainer, seed_everything

    runs = {}
    for name, lr, epochs, trackers in (("off", "1e-2", "2", "tensorboard"), ("healthy", "1e-4", "1", "none")):
        cfg = load_config("cpu-tiny", overrides=[f"logging.report_to={trackers}",
            "ref.backend=adapter_off", "quant.load_in_4bit=false", "rollout.batch_size=4", "rollout.chunk_size=4",
            "rollout.max_new_tokens=6", "ppo.mini_batch_size=4", "ppo.micro_batch_size=4", f"ppo.epochs={epochs}",
            f"actor.lr={lr}", "ppo.adaptive_kl=false", "checkpoint.every=100", "logging.progress=false",
            "rollout.truncation_penalty=null"])
        seed_everything(0)
        policy = PolicyModel.from_config(cfg, str(peaked_policy_dir))
        prompts = [policy.tokenizer(f"prompt {i}")["input_ids"] for i in range(4)]
        run_dir = tmp_path_factory.mktemp(f"kl-{name}")
        # the reward: how many response tokens are even ids, a signal any policy can chase
        trainer = RLTrainer(cfg, policy, Backends(AdapterOffReference(policy), CallableReward(
            lambda p, r: sum(t % 2 == 0 for t in r))), prompts, run_dir)
        trainer.train(2)
        runs[name] = run_dir, read_metrics(run_dir), cfg
    return runs


def test_a_run_driven_off_its_reference_in_one_update_is_flagged(kl_runs):
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    from homerlhf.app import monitor
    from homerlhf.ppo.metrics import progress_postfix
    from homerlhf.tracking.session import numeric

    run_dir, rows, cfg = kl_runs["off"]
    first, second = rows
    # Iteration 1: its update moved the policy past 0.1 nats/token (approx_kl); iteration 2's rollout
    # shows where that left it: more than the run's whole budget (ppo.target_kl 2) from the reference.
    assert first["kl_flag"] == 1 and "kl_jump" not in first and first["approx_kl"] > 0.1
    assert "(approx_kl)" in first["kl_flag_reason"] and "rose" not in first["kl_flag_reason"]
    assert second["kl_flag"] == 1 and second["kl_jump"] > cfg.ppo.target_kl, second  # measured 7.0 nats
    assert second["kl_jump"] == pytest.approx(second["kl_mean"] - first["kl_mean"], abs=1e-9)
    reason = second["kl_flag_reason"]
    assert reason.startswith("iteration 2: the policy is leaving its reference: KL to the reference rose "
                             f"{second['kl_jump']:.2f} nats in one update")
    assert "likely cause: actor.lr 0.01 too high for this model, ppo.epochs 2 (each batch trained 2 times)" in reason
    assert reason.endswith("set ppo.early_stop_kl=0.1 (stops an update's epochs once approx_kl passes it) and "
                           "lower actor.lr")
    # the trackers get the flag and the jump as numbers (the reason is a string: metrics.jsonl only)
    assert numeric(second)["kl_flag"] == 1.0 and "kl_flag_reason" not in numeric(second)
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    logged = {tag: {e.step: tensor_util.make_ndarray(e.tensor_proto).item() for e in acc.Tensors(tag)}
              for tag in ("kl_flag", "kl_jump")}
    assert logged == {"kl_flag": {r["iteration"]: r["kl_flag"] for r in rows}, "kl_jump": {2: second["kl_jump"]}}
    assert "kl_flag_reason" not in acc.Tags()["tensors"]
    # the CLI's progress bar and the app's progress line
    assert "KL jump" in progress_postfix(second)["warning"]
    line = monitor.progress(monitor.read_jsonl(run_dir / "metrics.jsonl"), 2).line()
    assert "**KL flag**" in line and reason in line


def test_a_healthy_run_is_not_flagged(kl_runs):
    from homerlhf.app import monitor
    from homerlhf.ppo.metrics import progress_postfix

    run_dir, rows, _ = kl_runs["healthy"]
    assert [r["kl_flag"] for r in rows] == [0, 0] and "kl_flag_reason" not in rows[1]
    assert abs(rows[1]["kl_jump"]) < 0.5 and rows[1]["approx_kl"] < 0.1, rows[1]
    assert "warning" not in progress_postfix(rows[1])
    assert "KL flag" not in monitor.progress(monitor.read_jsonl(run_dir / "metrics.jsonl"), 2).line()
