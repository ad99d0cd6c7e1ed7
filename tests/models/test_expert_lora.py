"""LoRA on 4-bit experts against peft's own ``ParamWrapper`` on the dense (dequantized) experts, and
the targets a MoE policy's adapters get."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from homerlhf.config.schema import LoraConfig
from homerlhf.errors import UserError
from homerlhf.models.expert_lora import lora_targets, register_experts
from homerlhf.models.moe import LAYOUTS
from moe_kit import dequantized_copy, hf_experts, quantized, routed, tolerance

TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def holder(experts: nn.Module) -> nn.Module:
    """``mlp.experts`` inside a module: peft targets no parameter of its top-level module."""
    mlp = nn.Module()
    mlp.experts = experts
    outer = nn.Module()
    outer.mlp = mlp
    return outer


@pytest.mark.parametrize("arch", sorted(LAYOUTS))
def test_lora_on_4bit_experts_equals_peft_on_the_dense_experts(arch):
    """The same adapter (peft's file layout: one state dict loads into both) gives the same outputs and
    the same gradients to every LoRA factor on the 4-bit experts as peft's ParamWrapper, which folds
    ``W + scale B A`` into the dequantized weights."""
    from peft import LoraConfig as PeftLoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    hf = hf_experts(arch)
    experts = quantized(hf, arch)
    dense = dequantized_copy(hf, experts)
    torch.manual_seed(3)
    reference = get_peft_model(holder(dense), PeftLoraConfig(r=4, lora_alpha=8, target_parameters=TARGETS,
                                                             init_lora_weights=False))
    config = PeftLoraConfig(r=4, lora_alpha=8, target_parameters=TARGETS)
    register_experts(config)
    ours = get_peft_model(holder(experts), config)
    state = get_peft_model_state_dict(reference)
    assert set(state) == set(get_peft_model_state_dict(ours))  # peft's layout, key for key
    set_peft_model_state_dict(ours, state)
    hidden, index, weights = routed()
    outputs, grads = [], []
    for model in (ours, reference):
        out = model.base_model.model.mlp.experts(hidden, index, weights)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        outputs.append(out.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if "lora_" in n})
    reduction = sum(experts.shapes[n][1] for n in experts.weight_names)
    assert (outputs[0] - outputs[1]).abs().max() <= tolerance(torch.float32, reduction, outputs[1].abs().max().item())
    with torch.no_grad():
        plain = experts(hidden, index, weights)
    assert (outputs[1] - plain).abs().max() > 100 * tolerance(torch.float32, reduction, plain.abs().max().item())
    assert set(grads[0]) == set(grads[1]) and len(grads[0]) == 4
    for name, want in grads[1].items():
        assert (grads[0][name] - want).abs().max() <= tolerance(torch.float32, reduction, want.abs().max().item()), name


def test_disabled_adapters_give_the_4bit_experts_alone():
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    hf = hf_experts("qwen3_moe")
    experts = quantized(hf, "qwen3_moe")
    hidden, index, weights = routed()
    with torch.no_grad():
        plain = experts(hidden, index, weights)
    config = PeftLoraConfig(r=4, target_parameters=TARGETS, init_lora_weights=False)
    register_experts(config)
    model = get_peft_model(holder(experts), config)
    with torch.no_grad():
        adapted = model.base_model.model.mlp.experts(hidden, index, weights)
        with model.disable_adapter():
            off = model.base_model.model.mlp.experts(hidden, index, weights)
    assert torch.equal(off, plain) and not torch.equal(adapted, plain)
    with pytest.raises(UserError, match="export policy"):
        model.merge_and_unload()


def test_targets_on_a_moe_leave_the_router_and_experts_alone_unless_asked():
    layout = LAYOUTS["qwen3_moe"]
    assert lora_targets(LoraConfig(), layout) == {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    assert lora_targets(LoraConfig(experts=True), layout)["target_parameters"] == TARGETS
    with pytest.raises(UserError, match="lora.experts=true"):
        lora_targets(LoraConfig(target_modules=["q_proj", "down_proj"]), layout)
    with pytest.raises(UserError, match="no dropout"):
        lora_targets(LoraConfig(experts=True, dropout=0.1), layout)
