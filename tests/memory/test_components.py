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
