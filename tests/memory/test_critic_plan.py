"""The planner and the time model with a critic of its own (``critic.model``): its base as a component of
every phase, its forward and backward at its own size, against hand counts and the loaded tensors."""

from __future__ import annotations

import json

import pytest

# The critic of tests/conftest.py's small_critic_dir: 2 layers of width 64 (4 heads of 16, 2 KV heads, MLP
# 192), 512 tokens. Per layer q 64x64, k and v 64x32, o 64x64, gate, up and down 64x192: 49,152 weights.
CRITIC_LINEAR = 2 * 49_152
# tiny_llama_dir: 4 layers of width 128 (MLP 384, KV 64): 196,608 weights a layer, + the LM head 512 x 128.
POLICY_MATMUL = 4 * 196_608 + 512 * 128


@pytest.fixture
def own(small_cfg, small_critic_dir):
    return lambda *extra: small_cfg(f"critic.model={small_critic_dir}", *extra)


def test_the_critic_base_lora_and_head_are_counted_at_its_own_size(own, tiny_llama_dir):
    from homerlhf.memory.components import Assumptions, persistent_components
    from homerlhf.memory.shapes import resolve_shape

    comps = {c.name: c.bytes for c in persistent_components(own(), resolve_shape(str(tiny_llama_dir)), Assumptions())}
    # NF4 with double quant: 0.5 + 1/64 + 4/(64 x 256) bytes a weight.
    assert comps["critic base linear weights (NF4)"] == CRITIC_LINEAR * (0.5 + 1 / 64 + 4 / (64 * 256)) == 50_712
    # cpu-tiny upcasts: embeddings 512 x 64 and norms 2 x 2 x 64 + 64, fp32; no LM head.
    assert comps["critic base embeddings + norms + biases"] == (512 * 64 + 2 * 2 * 64 + 64) * 4 == 132_352
    # LoRA r 8: 8 x (in + out) of each linear, 1,216 a layer; the head 64 + 1; Adam's two fp32 moments of both.
    assert comps["LoRA critic"] == 8 * 1_216 * 2 * 4 and comps["value head"] == 65 * 4
    assert comps["optimizer states critic (adamw)"] == 2 * (8 * 1_216 * 2 + 65) * 4
    assert "LM head" in comps  # the policy's own, as before


def test_the_plan_holds_the_bytes_of_the_loaded_critic(own, tiny_llama_dir):
    import bitsandbytes as bnb

    from homerlhf.memory.components import Assumptions, persistent_components
    from homerlhf.memory.shapes import resolve_shape
    from homerlhf.models.policy import PolicyModel

    cfg = own("ref.backend=adapter_off", "reward.backend=hf")
    comps = {c.name: c.bytes for c in persistent_components(cfg, resolve_shape(str(tiny_llama_dir)), Assumptions())}
    critic = PolicyModel.from_config(cfg, str(tiny_llama_dir)).critic_model
    quantized, other = 0, 0
    for module in critic.backbone.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state = module.weight.quant_state
            quantized += module.weight.numel() * module.weight.element_size() + state.absmax.numel()
            quantized += state.state2.absmax.numel() * state.state2.absmax.element_size()
    for name, param in critic.backbone.named_parameters():
        if "lora_" not in name and not isinstance(param, bnb.nn.Params4bit):
            other += param.numel() * param.element_size()
    held = sum(p.numel() * p.element_size() for p in critic.parameters())
    assert other == comps["critic base embeddings + norms + biases"]
    assert held == comps["LoRA critic"] + comps["value head"]
    # Each small tensor rounds its second-level absmax up to one block: 50,744 bytes held, 0.06% over.
    assert quantized == pytest.approx(comps["critic base linear weights (NF4)"], rel=1e-3)


def test_its_forward_and_backward_are_moments_of_their_own(own, tiny_llama_dir):
    from homerlhf.memory.components import Assumptions
    from homerlhf.memory.critic_phases import critic_scoring_moments, critic_update_moments
    from homerlhf.memory.phases import update_phase
    from homerlhf.memory.shapes import resolve_shape

    shape = resolve_shape(str(tiny_llama_dir))
    forward = {c.name: c.bytes for c in critic_scoring_moments(own(), Assumptions())["critic forward (own base)"]}
    assert forward["critic hidden states"] == 2 * 10 * 64 * 4  # chunk 2 x 10 tokens x width 64, fp32
    _, update = update_phase(own(), shape, Assumptions())
    grads = next(c for c in update if c.kind == "gradients")
    # fp32: the actor's LoRA r 8 on 4 layers of width 128 (8 x 2,432 a layer), the critic's and its head.
    assert grads.bytes == 4 * (8 * 2_432 * 4 + 8 * 1_216 * 2 + 65)
    backward = {c.name: c.bytes for c in critic_update_moments(own(), Assumptions(), grads)[
        "critic layer backward (own base)"]}
    # Per token a layer saves 4 (3 x 192 + 4 x 64 + 10) + 4 x 8 x 7 (LoRA A outputs) + 8 x 64 (norm inputs)
    # + 4 (2 x 64 + 192) (LoRA inputs) = 5,384 B; 2 x 10 tokens, 2 layers (no checkpointing in cpu-tiny),
    # + the final hidden state.
    assert backward["critic saved activations"] == 20 * 5_384 * 2 + 20 * 64 * 4 == 220_480


def test_the_time_model_prices_the_critic_at_its_own_size(own, small_cfg, rates, tiny_llama_dir):
    from homerlhf.memory.shapes import resolve_shape
    from homerlhf.memory.timing import iteration_time

    shape = resolve_shape(str(tiny_llama_dir))
    base = iteration_time(small_cfg(), rates, cores=2, logical=2, shape=shape)
    mine = iteration_time(own(), rates, cores=2, logical=2, shape=shape)
    share = CRITIC_LINEAR / POLICY_MATMUL  # the critic's decoder over the policy's matmuls: 3 / 26
    assert share == pytest.approx(3 / 26, rel=1e-12)
    # Update: 1 epoch x (1 + 3/26) passes x 4 sequences x 10 tokens / 10 tok/s; 8 s with the critic on the base.
    assert base.update_s == pytest.approx(8.0) and mine.update_s == pytest.approx(4 * (1 + 3 / 26))
    assert mine.phases["policy_scoring"] == pytest.approx(2 * (1 + 3 / 26))  # 2 chunks x 20 tokens / 20 tok/s


def test_plan_shows_both_placements_of_the_critic_side_by_side(capsys):
    from homerlhf.cli import main

    with pytest.raises(SystemExit) as info:
        main(["plan", "--preset", "4090", "--model", "Qwen/Qwen2.5-7B", "--set", "critic.model=Qwen/Qwen2.5-0.5B",
              "--json"])
        raise SystemExit(0)
    out = capsys.readouterr()
    assert info.value.code == 0, out.err
    data = json.loads(out.out)
    on_base, mine = data["critic"]
    assert on_base["critic"] == "on the policy's base (LoRA)" and mine["critic"] == "its own: Qwen/Qwen2.5-0.5B"
    assert mine["phases_gib"] == {p["name"]: p["total_gib"] for p in data["phases"]}
    assert any(c["name"] == "critic base linear weights (NF4)" for c in data["phases"][0]["components"])
    # 0.5B's decoder (24 layers of 14,909,440 weights) over 7B's matmuls (28 x 233,046,016 + 152,064 x 3,584).
    share = 24 * 14_909_440 / (28 * 233_046_016 + 152_064 * 3_584)
    assert mine["update_s"] / on_base["update_s"] == pytest.approx((1 + share) / 2, rel=1e-3)


def test_its_backward_follows_the_runs_checkpointing_and_offload(own, tiny_llama_dir):
    """``training.checkpoint_every_n_layers`` and ``activation_offload`` act on the critic's own base as on
    the policy's (it was counted with every layer checkpointed whatever they said): of its 2 layers every
    2nd is layer 0 alone; offloaded (on a CUDA card) its input waits in pinned host memory, a block of its
    own size beside the policy's. cpu-tiny's fp32 upcast: a = 4; micro-batch 2 x 10 tokens; a critic layer
    saves 5,384 B a token (above)."""
    from homerlhf.memory.components import Assumptions, Component
    from homerlhf.memory.critic_phases import critic_update_moments
    from homerlhf.memory.recompute import offload_host_components
    from homerlhf.memory.shapes import resolve_shape

    grads = Component("grads", "gradients", 0)

    def moments(*extra):
        cfg = own("training.gradient_checkpointing=true", "training.checkpoint_every_n_layers=2", *extra)
        return {k: {c.name: c.bytes for c in v} for k, v in critic_update_moments(cfg, Assumptions(), grads).items()}

    kept = moments()
    assert set(kept) == {"critic layer backward (own base)", "critic recomputed layer backward (own base)"}
    # Layer 0's input and the last hidden state (20 tokens x 64 x 4 B each), layer 1's activations kept.
    assert kept["critic layer backward (own base)"]["critic checkpointed layer inputs"] == 2 * 20 * 64 * 4 == 10_240
    assert kept["critic layer backward (own base)"]["critic saved activations"] == 20 * 5_384 == 107_680
    assert kept["critic recomputed layer backward (own base)"]["critic recomputed layer"] == 107_680
    off = moments("card.device=cuda", "training.activation_offload=true")["critic recomputed layer backward (own base)"]
    assert off["critic last hidden state"] == off["critic layer input back from host"] == 20 * 64 * 4 == 5_120
    assert "critic checkpointed layer inputs" not in off
    cfg = own("card.device=cuda", "training.gradient_checkpointing=true", "training.checkpoint_every_n_layers=2",
              "training.activation_offload=true")
    host = {c.name: c.bytes for c in offload_host_components(cfg, resolve_shape(str(tiny_llama_dir)))}
    # The policy's 2 of 4 layers, blocks of 20 x 128 x 4 = 10,240 B rounded to 16,384; the critic's one of
    # 5,120 B rounded to 8,192, a size the policy's blocks are not.
    assert host == {"offloaded layer inputs (pinned)": 2 * 16_384, "critic offloaded layer inputs (pinned)": 8_192}
