"""The update stage on a real 4-bit tiny policy: an OOM retry with halved micro-batches gives the
un-split step; under fp16 compute the trainable weights and Adam moments are fp32 and the grad
scaler's step is the unscaled one."""

from __future__ import annotations

import math

import pytest
import torch

from homerlhf.models.policy import PolicyModel
from homerlhf.ppo.advantages import compute_advantages
from homerlhf.ppo.backends import AdapterOffReference, Backends, CallableReward
from homerlhf.ppo.collect import Prompts, collect_experience
from homerlhf.ppo.loop import micro_batch_loss, update
from homerlhf.ppo.trainer import seed_everything
from homerlhf.ppo.update import Updater, UpdateState
from tolerances import fp32_bound


def minibatch_step(policy, exp, updater: Updater) -> dict[str, float]:
    """One optimizer step of PPO's loss on the whole of ``exp``."""
    return updater.step(exp, len(exp), lambda micro, share: micro_batch_loss(policy, micro, share, updater))


def prompt_pair(policy):
    """Two left-padded prompts (ids, mask)."""
    from homerlhf.ppo.rollout import pad_sequences

    return pad_sequences([[4, 300, 301, 6], [4, 6]], policy.tokenizer.pad_token_id)


@pytest.fixture(scope="module")
def update_run(tiny_llama_dir):
    """(cfg, policy, experience): 8 rollouts of the 4-bit tiny policy, rows of different widths, with
    advantages. Tests that step it restore the weights they start from."""
    from homerlhf.config import load_config
    from homerlhf.data.builtin import all_examples

    cfg = load_config("cpu-tiny", overrides=[
        "ref.backend=adapter_off", "reward.backend=hf", "logging.progress=false", "ppo.kl_coef=0.02",
        "ppo.adaptive_kl=false", "rollout.truncation_penalty=null", "actor.lr=2e-3", "rollout.batch_size=8",
        "rollout.chunk_size=8", "rollout.max_new_tokens=6", "ppo.mini_batch_size=8", "ppo.micro_batch_size=8",
        "ppo.max_grad_norm=1e6"])
    seed_everything(0)
    policy = PolicyModel.from_config(cfg, str(tiny_llama_dir))
    prompts = [list(policy.tokenizer.apply_chat_template([{"role": "user", "content": e.prompt}],
                                                         add_generation_prompt=True, tokenize=True, return_dict=False))
               for e in all_examples()[:8]]
    # The target token rewards rows unevenly, so advantages (and gradients) are far from uniform.
    reward = CallableReward(lambda p, r: sum(t % 7 == 0 for t in r) / len(r))
    exp, _ = collect_experience(policy, Prompts(prompts), cfg, Backends(AdapterOffReference(policy), reward))
    exp = compute_advantages(exp, cfg.ppo, 0.05, exp.scores)
    assert exp.response_mask.sum(dim=1).unique().numel() > 1 or exp.prompt_mask.sum(dim=1).unique().numel() > 1
    return cfg, policy, exp


def test_injected_oom_halves_micro_batch_and_gives_the_unsplit_step(update_run):
    from accelerate import Accelerator

    from homerlhf.memory.oom import inject_oom_at

    cfg, policy, exp = update_run
    params = policy.actor_parameters() + policy.critic_parameters()
    start = [p.detach().clone() for p in params]
    accelerator = Accelerator(cpu=True)

    def one_step(inject: bool):
        for p, s in zip(params, start):
            p.data.copy_(s)
        # Plain SGD: its step is proportional to the gradient, so any mis-weighting shows.
        actor_opt = torch.optim.SGD(policy.actor_parameters(), lr=0.5)
        critic_opt = torch.optim.SGD(policy.critic_parameters(), lr=0.5)
        state = UpdateState(micro_batch_size=8)
        updater = Updater(cfg, accelerator, actor_opt, critic_opt, state=state)
        policy.checkpoint_activations(True)
        if inject:
            with inject_oom_at(micro_batch_size=8, times=1) as injector:
                minibatch_step(policy, exp, updater)
            assert injector.raised == [8]
        else:
            minibatch_step(policy, exp, updater)
        return [p.detach().clone() for p in params], state

    unsplit, state_a = one_step(inject=False)
    retried, state_b = one_step(inject=True)
    assert state_a.micro_batch_size == 8 and state_a.oom_retries == 0
    assert state_b.micro_batch_size == 4 and state_b.oom_retries == 1
    moved = max(float((u - s).abs().max()) for u, s in zip(unsplit, start))
    assert moved > 1e-3  # the step really changed the LoRA weights
    diff = max(float((u - r).abs().max()) for u, r in zip(unsplit, retried))
    # SGD's step is lr x the gradient, a sum over the mini-batch's response tokens of terms through 384-wide
    # reductions, accumulated over micro-batches of 8 or of 4 rows: other shapes (tests/tolerances.py).
    assert diff <= fp32_bound(moved, 384 * int(exp.response_mask.sum()), floor=0.0), diff


def test_an_update_reads_the_device_twice_a_mini_batch_however_many_micro_batches(update_run, host_syncs):
    """homerlhf's update never makes the host wait for the device inside the micro-batch loop, so the
    next forward is queued while the last one runs: per mini-batch the micro-batches' widths are read
    once and the stats once (with the gradient norms); per epoch the rows' widths once. (It was ~15
    a micro-batch: ``float()`` of every stat and share, ``trimmed()``'s widths.)"""
    from accelerate import Accelerator

    cfg, policy, exp = update_run
    params = policy.actor_parameters() + policy.critic_parameters()
    start = [p.detach().clone() for p in params]
    counted = {}
    try:
        for micro in (4, 2):  # 1 and 2 micro-batches in each of the 2 mini-batches
            run_cfg = cfg.model_copy(update={"ppo": cfg.ppo.model_copy(update={"mini_batch_size": 4, "epochs": 1})})
            opts = [torch.optim.SGD(policy.actor_parameters(), lr=0.1), torch.optim.SGD(policy.critic_parameters(), lr=0.1)]
            with host_syncs() as syncs:
                stats = update(policy, exp, Updater(run_cfg, Accelerator(cpu=True), *opts,
                                                    generator=torch.Generator().manual_seed(0), state=UpdateState(micro)))
            counted[micro] = {key: n for key, n in syncs.counts.items() if key != "other"}  # ours
            assert stats["optimizer_steps"] == 2 and math.isfinite(stats["policy_loss"])
    finally:
        for p, s in zip(params, start):
            p.data.copy_(s)
    assert counted[4] == counted[2], counted  # nothing per micro-batch
    by_file = {}
    for key, n in counted[2].items():
        by_file[key.split(":")[0]] = by_file.get(key.split(":")[0], 0) + n
    # experience.py: the epoch's widths and its permutation (on the CPU generator: no wait there), each
    # mini-batch's micro-batch widths; update.py: each mini-batch's stats and gradient norms.
    assert by_file == {"ppo/experience.py": 1 + 1 + 2, "ppo/update.py": 2}, counted[2]
    # (transformers' own mask check reads the padding mask at each forward: HostSyncs' "other".)


# -- fp16 compute: fp32 trainable weights and the grad scaler ----------------------------------------
@pytest.fixture(scope="module")
def fp16_run(tiny_llama_dir):
    """(cfg, policy, experience): an fp16-compute policy (NF4 matmuls in fp16 on the CPU) and one
    rollout of it. Tests that step it start from whatever weights it holds and restore nothing."""
    from homerlhf.config import load_config
    from homerlhf.data.builtin import prompt_records

    cfg = load_config("cpu-tiny", overrides=[
        "ref.backend=adapter_off", "reward.backend=hf", "logging.progress=false", "quant.compute_dtype=fp16",
        "rollout.batch_size=4", "rollout.chunk_size=4", "rollout.max_new_tokens=5", "ppo.mini_batch_size=4",
        "ppo.micro_batch_size=2", "ppo.max_grad_norm=1e6"])
    seed_everything(0)
    policy = PolicyModel.from_config(cfg, str(tiny_llama_dir))
    prompts = [policy.tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                                    add_generation_prompt=True, tokenize=True, return_dict=False)
               for r in prompt_records()[:4]]
    reward = CallableReward(lambda p, r: sum(t % 5 == 0 for t in r) / len(r))
    exp, _ = collect_experience(policy, Prompts(prompts), cfg, Backends(AdapterOffReference(policy), reward))
    return cfg, policy, compute_advantages(exp, cfg.ppo, 0.05, exp.scores)


def test_fp16_compute_keeps_trainable_weights_and_adam_states_fp32(fp16_run):
    from accelerate import Accelerator
    from bitsandbytes.nn import Linear4bit

    from homerlhf.models.precision import loss_scaler
    from homerlhf.ppo.update import build_optimizer

    cfg, policy, exp = fp16_run
    trainable = policy.actor_parameters() + policy.critic_parameters()
    assert len(trainable) > 2 and {p.dtype for p in trainable} == {torch.float32}
    assert {p.dtype for p in policy.model.parameters() if p.requires_grad} == {torch.float32}
    # The frozen base computes in fp16: its 4-bit layers' compute dtype (weights: packed uint8).
    quantized = [m for m in policy.model.modules() if isinstance(m, Linear4bit)]
    assert quantized and {(m.compute_dtype, m.weight.dtype) for m in quantized} == {(torch.float16, torch.uint8)}
    # peft's prepare_model_for_kbit_training puts the non-4-bit weights (embeddings, norms, LM head) in fp32.
    frozen = {p.dtype for n, p in policy.model.named_parameters() if "lora_" not in n and p.dtype != torch.uint8}
    assert frozen == {torch.float32}

    actor_opt = build_optimizer("adamw", policy.actor_parameters(), 1e-3, 0.0)
    critic_opt = build_optimizer("adamw", policy.critic_parameters(), 1e-3, 0.0)
    scaler = loss_scaler(torch.float16, policy.device)
    assert scaler.is_enabled()
    before = [p.detach().clone() for p in trainable]
    policy.checkpoint_activations(True)
    stats = minibatch_step(policy, exp, Updater(cfg, Accelerator(cpu=True), actor_opt, critic_opt, scaler,
                                                state=UpdateState(2)))
    assert stats["skipped"] == 0.0 and math.isfinite(stats["grad_norm_actor"]) and stats["grad_norm_actor"] > 0
    assert max(float((p.detach() - b).abs().max()) for p, b in zip(trainable, before)) > 1e-5
    # The step's gradients stay until the next update zeroes them: the memory plan counts them through
    # generation and scoring (homerlhf.memory.components:held_gradients).
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trainable)
    moments = [s[k] for opt in (actor_opt, critic_opt) for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert len(moments) == 2 * len(trainable) and {t.dtype for t in moments} == {torch.float32}


def test_fp16_loss_scaling_gives_the_unscaled_step_and_an_overflow_only_lowers_the_scale(fp16_run):
    from accelerate import Accelerator

    from homerlhf.ppo.guards import NonFiniteGuard

    cfg, policy, exp = fp16_run
    params = policy.actor_parameters() + policy.critic_parameters()
    start = [p.detach().clone() for p in params]

    def one_step(scaler=None, guard=None, make=lambda ps: torch.optim.SGD(ps, lr=0.5)):
        for p, s in zip(params, start):
            p.data.copy_(s)
        # Plain SGD by default: its step is the gradient itself, so any scaling left in it shows.
        actor_opt, critic_opt = make(policy.actor_parameters()), make(policy.critic_parameters())
        policy.checkpoint_activations(True)
        updater = Updater(cfg, Accelerator(cpu=True), actor_opt, critic_opt, guard=guard, state=UpdateState(2))
        if scaler is not None:
            updater.scaler = scaler
        stats = minibatch_step(policy, exp, updater)
        return stats, [p.detach().clone() for p in params]

    _, plain = one_step(None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    stats, scaled = one_step(scaler)
    assert stats["skipped"] == 0.0 and scaler.get_scale() == 2.0**10  # no overflow, no growth yet
    moved = max(float((u - s).abs().max()) for u, s in zip(plain, start))
    assert moved > 1e-3
    # A power-of-two scale and its exact inverse: the same step up to fp16 rounding in the base's backward.
    assert max(float((u - s).abs().max()) for u, s in zip(plain, scaled)) <= 1e-3 * moved

    # A fused AdamW (build_optimizer's on CUDA; it reads the scaler's state itself) takes the unfused one's step.
    adam = {fused: one_step(torch.amp.GradScaler("cpu", init_scale=2.0**10),
                            make=lambda ps, f=fused: torch.optim.AdamW(ps, lr=1e-3, fused=f))[1] for fused in (None, True)}
    assert max(float((u - s).abs().max()) for u, s in zip(adam[None], start)) > 5e-4
    assert max(float((u - f).abs().max()) for u, f in zip(adam[None], adam[True])) <= 1e-6

    # 2**40 overflows fp16 in the 4-bit layers' backward: the step is skipped and the scale halved,
    # and the non-finite guard (one bad step stops the run) does not count it.
    guard = NonFiniteGuard(max_in_row=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    stats, after = one_step(scaler, guard)
    assert not math.isfinite(stats["grad_norm_actor"]) and math.isfinite(stats["policy_loss"])
    assert stats["skipped"] == 1.0 and scaler.get_scale() == 2.0**39 and guard.in_row == 0
    assert all(torch.equal(a, s) for a, s in zip(after, start))
    assert all(p.grad is None for p in params)  # a skipped step drops its gradients: none held after it


def test_lora_dropout_is_off_in_the_update_forward_so_the_first_ratio_is_exactly_one(tiny_llama_dir, ppo_cfg, prompt_ids):
    """bf16 end to end (bf16 hidden states and KV cache, fp32 logits): at step 0 the adapter-off reference
    gives the actor's log-probs exactly (KL 0), and the first mini-batch's ratio is exactly 1."""
    from accelerate import Accelerator

    cfg = ppo_cfg("rollout.batch_size=4", "rollout.chunk_size=4", "rollout.max_new_tokens=6",
                  "ppo.mini_batch_size=4", "ppo.micro_batch_size=4", "actor.lora.dropout=0.5",
                  "critic.lora.dropout=0.5", "training.gradient_checkpointing=true", "quant.compute_dtype=bf16",
                  "quant.upcast_non_quantized=false")
    seed_everything(0)
    policy = PolicyModel.from_config(cfg, str(tiny_llama_dir))
    assert policy.hidden_states(*prompt_pair(policy)).dtype == torch.bfloat16
    backends = Backends(AdapterOffReference(policy), CallableReward(lambda p, r: float(len(r))))
    start, _ = collect_experience(policy, Prompts(prompt_ids(policy.tokenizer, 4)), cfg, backends)
    mask = start.response_mask.bool()
    assert torch.equal(start.old_logprobs[mask], start.ref_logprobs[mask])  # LoRA B = 0: the base, bit for bit
    # Train the adapters off zero first: with LoRA B = 0 dropout on A's input would change nothing.
    for p in policy.actor_parameters() + policy.critic_parameters():
        torch.nn.init.normal_(p, std=0.2)
    exp, _ = collect_experience(policy, Prompts(prompt_ids(policy.tokenizer, 4)), cfg, backends)
    exp = compute_advantages(exp, cfg.ppo, 0.05, exp.scores)
    input_ids, attention_mask = exp.sequences()
    mask = exp.response_mask.bool()

    # What peft's own training mode would do: dropout on, the ratio is off 1 before any step.
    policy.model.train()
    with_dropout, _ = policy.actor_logprobs(input_ids, attention_mask, exp.response_len)
    assert (with_dropout - exp.old_logprobs)[mask].abs().max() > 1e-3

    policy.checkpoint_activations(True)
    layers = [m for m in policy.model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    assert layers and all(m.training for m in layers)  # checkpointing runs only in training mode
    dropouts = [m for n, m in policy.model.named_modules() if "lora_dropout" in n and isinstance(m, torch.nn.Dropout)]
    assert dropouts and not any(m.training for m in dropouts)
    logprobs, _ = policy.actor_logprobs(input_ids, attention_mask, exp.response_len)
    values = policy.critic_values(input_ids, attention_mask, exp.response_len)
    assert logprobs.requires_grad
    assert torch.equal(torch.exp(logprobs - exp.old_logprobs)[mask], torch.ones(int(mask.sum())))
    assert torch.equal(values[mask], exp.values[mask])
    # And through the update stage itself: no clipping and zero approx KL on the first mini-batch.
    actor_opt = torch.optim.SGD(policy.actor_parameters(), lr=0.1)
    critic_opt = torch.optim.SGD(policy.critic_parameters(), lr=0.1)
    stats = minibatch_step(policy, exp, Updater(cfg, Accelerator(cpu=True), actor_opt, critic_opt, state=UpdateState(4)))
    assert (stats["approx_kl"], stats["policy_clipfrac"], stats["value_clipfrac"]) == (0.0, 0.0, 0.0)
