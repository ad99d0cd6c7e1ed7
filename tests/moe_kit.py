"""Tiny experts modules for the 4-bit experts tests: transformers' own, quantized, dequantized, routed."""

from __future__ import annotations

import copy

import torch
from torch import nn

from homerlhf.models.experts4bit import Experts4bit
from homerlhf.models.moe import LAYOUTS
from homerlhf.tiny import TINY_EXPERTS, TINY_TOP_K, model_config

TOKENS = 24


def hf_experts(arch: str, dtype=torch.float32, seed: int = 0, hidden: int = 128):
    """Layer 0's transformers experts module of a tiny ``arch`` (hidden 128: each expert's MLP 64 wide),
    its own eager forward."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = model_config(arch, 512, hidden=hidden, layers=1)
    config._experts_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.model.layers[0].mlp.experts


def quantized(hf: nn.Module, arch: str, compute=torch.float32, chunk_bytes: int = 1 << 30,
              double_quant: bool = True) -> Experts4bit:
    layout = LAYOUTS[arch]
    experts = Experts4bit(hf, layout.weights, layout.biases, layout.transposed, "nf4", double_quant, compute, chunk_bytes)
    for name in layout.weights:
        setattr(experts, name, experts.quantize(name, getattr(hf, name).detach()))
    return experts


def dequantized_copy(hf: nn.Module, experts: Experts4bit) -> nn.Module:
    """transformers' experts module holding the 4-bit weights, dequantized: the dense reference."""
    dense = copy.deepcopy(hf)
    every = torch.arange(experts.num_experts)
    for name in experts.weight_names:
        getattr(dense, name).data = experts.dequantize(name, every).to(getattr(hf, name).dtype)
    return dense


def routed(dtype=torch.float32, seed: int = 1):
    """Hidden states (T, 128) and a top-2 routing over the 8 experts that leaves expert 5 unused."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, 128, generator=g).to(dtype)
    scores = torch.rand(TOKENS, TINY_EXPERTS, generator=g)
    scores[:, 5] = -1
    weights, index = torch.topk(scores.softmax(-1), TINY_TOP_K, dim=-1)
    return hidden, index, (weights / weights.sum(-1, keepdim=True)).to(dtype)


def tolerance(dtype, reduction: int, magnitude: float) -> float:
    """Two summation orders of the same products, accumulated in fp32 (fp32 eps x reduction length),
    each op's result rounded to ``dtype`` once (its eps), 10x margin, relative to the output's magnitude."""
    return 10 * (torch.finfo(torch.float32).eps * reduction + torch.finfo(dtype).eps) * magnitude


def moe_block(arch: str, a: int, c: int, lora: bool, seed: int = 0) -> nn.Module:
    """Layer 0's MoE block of a tiny ``arch`` as the policy runs it: hidden states and router in ``a``
    bytes (fp32 under the upcast), its experts 4-bit in compute dtype ``c`` (one expert per chunk), and with
    ``lora`` peft LoRA (r 8, its B random) on the experts through homerlhf's wrapper."""
    from peft import LoraConfig, get_peft_model

    from homerlhf.models.expert_lora import register_experts
    from transformers import AutoModelForCausalLM

    dtypes = {4: torch.float32, 2: torch.bfloat16}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(arch, 512, hidden=128, layers=1), dtype=dtypes[a])
    block = model.model.layers[0].mlp
    block.experts = quantized(block.experts, arch, compute=dtypes[c], chunk_bytes=1)
    for p in block.parameters():
        p.requires_grad_(False)
    if lora:
        config = LoraConfig(r=8, target_parameters=[f"mlp.experts.{n}" for n in LAYOUTS[arch].weights])
        register_experts(config)
        outer = nn.Module()
        outer.mlp = block
        get_peft_model(outer, config)
        for name, p in outer.named_parameters():
            if "lora_B" in name:
                nn.init.normal_(p, std=0.02)
    return block


def busiest_expert(block: nn.Module, hidden: torch.Tensor) -> int:
    """The most tokens any one expert of ``block`` gets of ``hidden`` (T, h)."""
    router = getattr(block, "gate", None) or block.router
    with torch.no_grad():
        index = router(hidden)[2]
    return int(torch.bincount(index.reshape(-1)).max())
