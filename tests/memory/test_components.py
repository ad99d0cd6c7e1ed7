"""The byte counts of the plan's pieces against real bitsandbytes and torch objects."""

from __future__ import annotations

import pytest
import torch

from homerlhf.memory.components import adam_state_bytes, nf4_bytes_per_param


def test_nf4_bytes_match_bitsandbytes():
    import bitsandbytes.functional as F

    weight = torch.randn(512, 1024)
    for double_quant in (True, False):
        packed, state = F.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
        stored = packed.numel() * packed.element_size() + state.absmax.numel() * state.absmax.element_size()
        if double_quant:
            stored += state.state2.absmax.numel() * state.state2.absmax.element_size()
        assert stored == pytest.approx(weight.numel() * nf4_bytes_per_param(double_quant), rel=1e-9)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit", "paged_adamw_8bit"])
def test_optimizer_state_bytes_match_the_real_optimizers(optimizer):
    import bitsandbytes as bnb

    make = {"adamw": torch.optim.AdamW, "adamw_8bit": bnb.optim.AdamW8bit, "paged_adamw_8bit": bnb.optim.PagedAdamW8bit}
    # A LoRA A (16 x 896), B (4864 x 16) and a value head (1 x 896, under the 8-bit size floor).
    params = [torch.nn.Parameter(torch.randn(*s)) for s in [(16, 896), (4864, 16), (1, 896)]]
    opt = make[optimizer](params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    with pytest.warns(UserWarning) if optimizer.startswith("paged") else _nothing():
        opt.step()
    real = sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items()
               if torch.is_tensor(v) and k != "step")
    assert adam_state_bytes([p.numel() for p in params], optimizer) == real


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("compute_dtype", ["fp16", "fp32"])
def test_trainable_weights_are_counted_as_the_fp32_tensors_the_policy_holds(compute_dtype, tiny_llama_dir):
    # Under fp16 compute too (T4): LoRA and value head are fp32, so are their grads and Adam moments.
    from homerlhf.config import load_config
    from homerlhf.memory.components import Assumptions, persistent_components
    from homerlhf.memory.shapes import resolve_shape
    from homerlhf.models.policy import PolicyModel

    cfg = load_config("cpu-tiny", overrides=[f"quant.compute_dtype={compute_dtype}", "ref.backend=adapter_off",
                                             "reward.backend=hf"])
    policy = PolicyModel.from_config(cfg, str(tiny_llama_dir))
    planned = {c.name: c.bytes for c in persistent_components(cfg, resolve_shape(str(tiny_llama_dir)), Assumptions())}

    def held(params):
        return sum(p.numel() * p.element_size() for p in params)

    assert {p.dtype for p in policy.actor_parameters() + policy.critic_parameters()} == {torch.float32}
    assert planned["LoRA actor"] == held(policy.actor_parameters())
    assert planned["LoRA critic"] + planned["value head"] == held(policy.critic_parameters())


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_trainable_components_match_the_loaded_policy(tiny_llama_dir, algorithm):
    """What the plan holds for adapters, value head and optimizers is what the real policy trains:
    GRPO loads no critic LoRA, no value head and no critic optimizer."""
    from homerlhf.config import load_config
    from homerlhf.memory.components import Assumptions, persistent_components
    from homerlhf.memory.shapes import resolve_shape
    from homerlhf.models.policy import PolicyModel

    cfg = load_config("cpu-tiny", overrides=[f"algorithm={algorithm}", "ppo.group_size=2", "ref.backend=adapter_off",
                                             "reward.backend=hf"])
    comps = {c.name: c.bytes for c in persistent_components(cfg, resolve_shape(str(tiny_llama_dir)), Assumptions())}
    policy = PolicyModel.from_config(cfg, str(tiny_llama_dir))
    assert comps["LoRA actor"] == 4 * sum(p.numel() for p in policy.actor_parameters())
    critic = sum(p.numel() for p in policy.critic_parameters())
    planned_critic = comps.get("LoRA critic", 0) + comps.get("value head", 0)
    assert planned_critic == 4 * critic
    assert (critic == 0) == (algorithm == "grpo")
    assert any(name.startswith("optimizer states critic") for name in comps) == (algorithm == "ppo")


def test_an_adapter_reward_adds_its_lora_and_head_and_no_base(tiny_llama_dir, tiny_lora_rm_dir):
    """reward.backend=adapter: the plan holds the bytes the loaded reward adapter really holds (its
    LoRA and score head, fp32), and on Qwen2.5-7B the hand-counted figure; no base weights."""
    from homerlhf.config import load_config
    from homerlhf.memory.components import Assumptions, persistent_components
    from homerlhf.memory.shapes import BUILTIN_SHAPES, resolve_shape
    from homerlhf.models.policy import PolicyModel
    from homerlhf.models.reward_adapter import RewardAdapter

    cfg = load_config("cpu-tiny", overrides=["ref.backend=adapter_off", "reward.backend=adapter",
                                             f"reward.model={tiny_lora_rm_dir}"])
    planned = {c.name: c.bytes for c in persistent_components(cfg, resolve_shape(str(tiny_llama_dir)), Assumptions())}
    policy = PolicyModel.from_config(cfg, str(tiny_llama_dir))
    scorer = RewardAdapter(policy.model, tiny_lora_rm_dir / "adapter", policy.tokenizer.pad_token_id)
    held = sum(p.numel() * p.element_size() for n, p in policy.model.named_parameters() if ".reward." in n)
    held += sum(p.numel() * p.element_size() for p in scorer.head.parameters())
    assert planned["LoRA reward + score head"] == held

    # Qwen2.5-7B, rm.lora r=16 on all 7 linears: r * (in + out) per layer = 16 * (2 * (3584 + 3584) +
    # 2 * (3584 + 512) + 3 * (3584 + 18944)) = 16 * 90,112, x 28 layers = 40,370,176 params, fp32;
    # + the 3,584-wide head.
    cfg_7b = load_config("4090", overrides=["reward.backend=adapter", "reward.model=runs/rm"])
    comps = {c.name: c.bytes for c in persistent_components(cfg_7b, BUILTIN_SHAPES["Qwen/Qwen2.5-7B"], Assumptions())}
    assert comps["LoRA reward + score head"] == 40_370_176 * 4 + 3_584 * 4
    without = persistent_components(load_config("4090"), BUILTIN_SHAPES["Qwen/Qwen2.5-7B"], Assumptions())
    assert set(comps) - {c.name for c in without} == {"LoRA reward + score head"}
