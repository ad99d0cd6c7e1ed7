"""Graceful stop: the first signal sets the flag, the second aborts; handlers are restored."""

from __future__ import annotations

import os
import signal

import pytest

from homerlhf.ppo.stopping import StopRequested


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_first_signal_requests_stop_second_aborts(sig):
    before = signal.getsignal(sig)
    messages = []
    with StopRequested(echo=messages.append) as stop:
        assert not stop.requested
        os.kill(os.getpid(), sig)
        assert stop.requested and stop.reason == signal.Signals(sig).name
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), sig)
    assert signal.getsignal(sig) is before
    assert "stopping after the current phase" in messages[0] and "aborting now" in messages[1]


def test_request_from_code_keeps_first_reason():
    stop = StopRequested(echo=lambda msg: None)
    stop.request("non-finite")
    stop.request("later")
    assert stop.requested and stop.reason == "non-finite"


def _trainer(cfg, tiny_llama_dir, run_dir, stop, stop_at_call=None):
    from homerlhf.models.policy import PolicyModel
    from homerlhf.ppo.backends import AdapterOffReference, Backends, CallableReward
    from homerlhf.ppo.trainer import RLTrainer, seed_everything

    seed_everything(cfg.seed)
    policy = PolicyModel.from_config(cfg, str(tiny_llama_dir))
    calls = []

    def score(prompt, response):
        calls.append(1)
        if stop_at_call is not None and len(calls) == stop_at_call:
            stop.request("SIGINT")  # as if Ctrl-C came while the reward model was scoring
        return float(sum(t % 7 == 0 for t in response))

    prompts = [policy.tokenizer(f"prompt number {i}")["input_ids"] for i in range(10)]
    trainer = RLTrainer(cfg, policy, Backends(AdapterOffReference(policy), CallableReward(score)), prompts, run_dir)
    trainer.stop = stop
    return trainer


def test_stop_during_rollout_drops_the_half_iteration_and_resume_is_exact(tiny_llama_dir, tmp_path):
    from homerlhf.config import load_config
    from homerlhf.ppo.checkpoint import latest_complete_checkpoint
    from homerlhf.ppo.metrics import read_metrics

    cfg = load_config("cpu-tiny", overrides=[
        "ref.backend=adapter_off", "quant.load_in_4bit=false", "rollout.batch_size=4", "rollout.chunk_size=2",
        "rollout.max_new_tokens=4", "ppo.mini_batch_size=2", "ppo.micro_batch_size=2", "ppo.epochs=1",
        "ppo.score_norm=true", "checkpoint.every=100", "logging.progress=false"])
    straight = _trainer(cfg, tiny_llama_dir, tmp_path / "straight", StopRequested(echo=print))
    straight.train(2)

    stop = StopRequested(echo=print)
    run = tmp_path / "stopped"
    first = _trainer(cfg, tiny_llama_dir, run, stop, stop_at_call=4 * 1 + 3)  # inside iteration 2's scoring
    first.train(2)
    assert first.stopped and first.iteration == 1
    assert latest_complete_checkpoint(run).name == "iter_000001"
    assert [r["iteration"] for r in read_metrics(run)] == [1]

    resumed = _trainer(cfg, tiny_llama_dir, run, StopRequested(echo=print))
    resumed.resume(latest_complete_checkpoint(run))
    resumed.train(2)
    a = straight.policy.actor_parameters() + straight.policy.critic_parameters()
    b = resumed.policy.actor_parameters() + resumed.policy.critic_parameters()
    assert max((x - y).abs().max().item() for x, y in zip(a, b)) <= 1e-6
    drop = ("time_", "tokens_per_s_", "peak_mem_")
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]
    assert strip(read_metrics(run)) == strip(read_metrics(tmp_path / "straight"))
