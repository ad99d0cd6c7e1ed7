"""The llamacpp rollout engine on a real NF4 tiny policy: with an F32 KL-consistent export and the
actor's LoRA swapped in, its behaviour log-probs are the trainer's old log-probs (1e-3 per token, tiny
Llama and Qwen2) before and after real PPO updates; with a q8_0 export the mismatch shows and the
capped weights reach the loss. llama.cpp runs in a child process: a build that dies (SIGILL) fails
one test."""

from __future__ import annotations

import json

import pytest

CHILD = r"""
import json, sys
from pathlib import Path
import torch
from homerlhf.config import load_config
from homerlhf.models.policy import PolicyModel
from homerlhf.ppo.backends import AdapterOffReference, Backends, CallableReward
from homerlhf.ppo.collect import Prompts, collect_experience, score_with_policy
from homerlhf.ppo.trainer import RLTrainer, seed_everything
from homerlhf.workers.rollout_engine import llamacpp_engine

model_dir, outtype, run_dir, is_cap = sys.argv[1:5]
cfg = load_config("cpu-tiny", overrides=[
    f"model.name_or_path={model_dir}", "ref.backend=adapter_off", "reward.backend=hf", "rollout.engine=llamacpp",
    f"rollout.engine_outtype={outtype}", "rollout.engine_f32_kv_cache=true", f"rollout.is_cap={is_cap}",
    "rollout.batch_size=4", "rollout.chunk_size=4", "rollout.max_new_tokens=8", "rollout.max_prompt_len=16",
    "rollout.temperature=0.8", "ppo.mini_batch_size=4", "ppo.micro_batch_size=4", "ppo.epochs=2", "actor.lr=5e-2",
    "ppo.kl_coef=0.02", "ppo.adaptive_kl=false", "rollout.truncation_penalty=null",  # not the demo recipe
    "logging.progress=false"])
seed_everything(0)
policy = PolicyModel.from_config(cfg, model_dir)
engine = llamacpp_engine(cfg, policy, model_dir, Path(run_dir))
prompts = [[4, 300, 301, 302, 20, 6], [4, 6], [4, 77, 78, 79, 80, 6], [4, 90, 6]]

def compare():
    # Engine vs trainer on the engine's own samples, and how far the actor is from its base.
    engine.sync(policy)
    batch = engine.generate(prompts, cfg.rollout)
    old, _, _ = score_with_policy(policy, batch)
    mask = batch.response_mask.bool()
    base = policy.reference_logprobs(*batch.sequences(), batch.response_ids.shape[1])
    return {"max_diff": float(((batch.behaviour_logprobs - old).abs() * mask).max()),
            "moved": float(((old - base).abs() * mask).max()), "tokens": int(mask.sum()),
            "stops": int((~batch.truncated).sum())}

out = {"before": compare(), "version_before": engine.version}
reward = CallableReward(lambda p, r: float(len(r)))
trainer = RLTrainer(cfg, policy, Backends(AdapterOffReference(policy), reward, engine), prompts)
rows = [trainer.step() for _ in range(2)]
out["rows"] = [{k: row[k] for k in ("is_weight_mean", "is_weight_max", "is_capped_fraction", "kl_behaviour_old")} for row in rows]
out["after"] = compare()
out["version_after"] = engine.version

# The weights as collected, and whether they reach the policy loss.
from homerlhf.ppo.advantages import compute_advantages
from types import SimpleNamespace
from homerlhf.ppo.loop import micro_batch_loss
from homerlhf.ppo.update import Updater
no_backward = Updater(cfg, SimpleNamespace(backward=lambda loss: None), None)
engine.sync(policy)
exp, _ = collect_experience(policy, Prompts(prompts), cfg, Backends(AdapterOffReference(policy), reward, engine))
cap = float(is_cap)
expected = torch.clamp(torch.exp(exp.old_logprobs - exp.behaviour_logprobs), max=cap) * exp.response_mask
out["weights_exact"] = bool(torch.equal(exp.is_weights, expected))
exp = compute_advantages(exp, cfg.ppo, 0.0, exp.scores)
with torch.no_grad():
    weighted = float(micro_batch_loss(policy, exp, 1.0, no_backward)["policy_loss"])
    exp.is_weights = None
    plain = float(micro_batch_loss(policy, exp, 1.0, no_backward)["policy_loss"])
out["loss_weighted"], out["loss_plain"] = weighted, plain
engine.close()
print(json.dumps(out))
"""


def _run(model_dir, outtype, run_dir, is_cap):
    from homerlhf.doctor import ChildFailed, run_child

    try:
        return run_child(CHILD, str(model_dir), outtype, str(run_dir), str(is_cap), timeout=900)
    except ChildFailed as exc:  # one failed test that says why, not a dead test run
        pytest.fail(f"llama.cpp rollout engine: {exc.detail}; {exc.fix}", pytrace=False)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # q/k rows permuted for llama's rope, not for qwen2's
def test_f32_engine_samples_with_the_live_adapter(arch, request, tmp_path):
    out = _run(request.getfixturevalue(f"tiny_{arch}_dir"), "f32", tmp_path, 2.0)
    before, after = out["before"], out["after"]
    assert before["tokens"] > 8 and after["tokens"] > 8
    # LoRA B starts at 0: the actor is its base; the engine matches it per token.
    assert before["moved"] == 0.0 and before["max_diff"] < 1e-3
    # After two real updates the actor moved far from its base, and the engine moved with it.
    assert after["moved"] > 1e-2 and after["max_diff"] < 1e-3, json.dumps(out)
    assert out["version_after"] > out["version_before"]
    for row in out["rows"]:
        assert abs(row["is_weight_mean"] - 1) < 1e-3 and abs(row["is_weight_max"] - 1) < 1e-3
        assert row["is_capped_fraction"] == 0.0 and 0 <= row["kl_behaviour_old"] < 1e-6
    assert out["weights_exact"]


def test_q8_0_engine_mismatch_is_measured_and_capped_weights_reach_the_loss(tiny_llama_dir, tmp_path):
    out = _run(tiny_llama_dir, "q8_0", tmp_path, 1.0)
    # q8_0 rounds the weights: the engine is measurably off the trainer (unlike F32's < 1e-6).
    assert out["after"]["max_diff"] > 1e-3, json.dumps(out)
    for row in out["rows"]:
        assert row["kl_behaviour_old"] > 1e-6
        # Cap 1: every token the trainer likes more than the engine is cut to weight 1.
        assert row["is_weight_max"] == pytest.approx(1.0, abs=1e-7) and 0 < row["is_capped_fraction"] < 1
        assert row["is_weight_mean"] < 1
    assert out["weights_exact"]
    assert out["loss_weighted"] != pytest.approx(out["loss_plain"], abs=1e-7)


# -- learning with the engine, sync and async ---------------------------------------------------
LEARN_CHILD = r"""
import json, sys
from collections import Counter
from pathlib import Path
from homerlhf.config import load_config
from homerlhf.data.builtin import prompt_records
from homerlhf.models.policy import PolicyModel
from homerlhf.ppo.backends import AdapterOffReference, Backends, CallableReward
from homerlhf.ppo.rollout import generate_rollout
from homerlhf.ppo.trainer import RLTrainer, seed_everything
from homerlhf.workers.rollout_engine import llamacpp_engine

model_dir, run_dir, mode = sys.argv[1:4]
cfg = load_config("cpu-tiny", overrides=[
    f"model.name_or_path={model_dir}", "ref.backend=adapter_off", "reward.backend=hf", "logging.progress=false",
    "rollout.engine=llamacpp", "rollout.engine_outtype=f32", "rollout.engine_threads=1", f"rollout.async={mode == 'async'}",
    "rollout.batch_size=16", "rollout.chunk_size=16", "rollout.max_new_tokens=6", "rollout.max_prompt_len=16",
    "ppo.mini_batch_size=16", "ppo.micro_batch_size=16", "ppo.epochs=2", "actor.lr=3e-3", "critic.lr=3e-3",
    "ppo.kl_coef=0.03", "ppo.iterations=5",
    "ppo.adaptive_kl=false", "rollout.truncation_penalty=null"])  # not the demo recipe of the preset
seed_everything(0)
policy = PolicyModel.from_config(cfg, model_dir)
prompts = [list(policy.tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                add_generation_prompt=True, tokenize=True, return_dict=False)) for r in prompt_records()[:16]]
probe = generate_rollout(policy, prompts, cfg.rollout)
target = Counter(probe.response_ids[probe.response_mask.bool()].tolist()).most_common(1)[0][0]
reward = CallableReward(lambda p, r: sum(t == target for t in r) / len(r))
engine = llamacpp_engine(cfg, policy, model_dir, Path(run_dir))
trainer = RLTrainer(cfg, policy, Backends(AdapterOffReference(policy), reward, engine), prompts, run_dir)
rows = trainer.train()
engine.close()
keys = ("score_mean", "kl_mean", "policy_version_lag_mean", "is_weight_mean", "kl_behaviour_old", "time_iteration_s")
print(json.dumps([{k: row[k] for k in keys} for row in rows]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ppo_learns_with_the_llamacpp_engine(peaked_policy_dir, mode, tmp_path):
    """The PPO learning test's recipe (tests/ppo/test_trainer.py: reward = share of the policy's most
    frequent starting token, 16 fixed prompts, 5 iterations) with the llamacpp engine sampling; in
    async mode each batch after the first was sampled by the adapter one update behind."""
    from homerlhf.doctor import ChildFailed, run_child

    try:
        rows = run_child(LEARN_CHILD, str(peaked_policy_dir), str(tmp_path / "run"), mode, timeout=900)
    except ChildFailed as exc:
        pytest.fail(f"PPO with the llamacpp engine: {exc.detail}; {exc.fix}", pytrace=False)
    scores = [r["score_mean"] for r in rows]
    print(mode, json.dumps(rows))
    first, last = scores[0], sum(scores[-2:]) / 2
    assert last >= first + 0.15 and last >= 2.5 * first, scores
    # Bounded: all mass on the target costs ~14 nats (measured sync: 13.9 at a score of 0.64, where the
    # hf engine's run of the recipe reached 0.40 at 6.5 nats: another sample stream, a faster climb).
    assert max(r["kl_mean"] for r in rows) < 20.0
    assert [r["policy_version_lag_mean"] for r in rows] == ([0.0] + [1.0] * 4 if mode == "async" else [0.0] * 5)
