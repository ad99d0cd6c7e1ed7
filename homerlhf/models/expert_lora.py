"""LoRA on 4-bit fused experts, through peft's parameter targeting (``target_parameters``).

peft adapts a fused 3-D expert weight with its ``lora.ParamWrapper``: per expert ``r x in`` and
``out x r`` factors, folded into the weight by a parametrization on every forward. That needs the
full-precision weight (a 4-bit one cannot take ``W + B A``) and makes the whole dense stack each
forward. So on :class:`~homerlhf.models.experts4bit.Experts4bit` a subclass of it keeps peft's factors,
adapter bookkeeping and file format (an adapter trained here loads into plain peft on the 16-bit
model), and instead hands the active adapters' factors to the experts module, which adds
``scale * (x A_e^T) B_e^T`` to each routed token's projection.

On a MoE, peft (0.21, transformers 5) rewrites ``all-linear`` into the experts *and the router* of the
families it converts from transformers 4's names (Qwen3-MoE among them); :func:`lora_targets` names
the targets itself, so the router stays frozen and the experts are adapted only when asked.
"""

from __future__ import annotations

from typing import Optional

import torch
from peft.tuners.lora.layer import ParamWrapper as _PeftParamWrapper

from homerlhf.errors import UserError
from homerlhf.models.experts4bit import Experts4bit

# transformers' attention projections in every known MoE layout: what LoRA adapts by default.
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# Names peft reads as the experts or router of a converted family (transformers 4's nn.Linear names).
_PEFT_EXPERT_NAMES = {"gate", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3", "router", "experts"}


class ParamWrapper(_PeftParamWrapper):
    """peft's wrapper of one fused expert weight, on a 4-bit experts module. (peft recognises these
    wrappers by class name when it nests the second weight's wrapper and adds adapters, hence the name.)"""

    def get_param(self):
        # A stand-in of the weight's logical shape and compute dtype, no storage: what peft sizes
        # the factors from (its own code reads the shape, device and dtype of the 3-D weight).
        experts = self.get_base_layer()
        codes = getattr(experts, self.parameter_name)
        return torch.empty((), device=codes.device, dtype=experts.compute_dtype).expand(
            experts.shapes[self.parameter_name])

    def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device=None) -> None:
        # Device only: the factors stay fp32 whatever the compute dtype.
        target = self.get_param().device
        for name in self.adapter_layer_names:
            layer = getattr(self, name, None)
            if isinstance(layer, torch.nn.ModuleDict) and adapter_name in layer:
                layer[adapter_name] = layer[adapter_name].to(target)

    def merge(self, safe_merge: bool = False, adapter_names: Optional[list[str]] = None) -> None:
        raise UserError("LoRA on 4-bit experts cannot be merged into them; export the policy "
                        "(homerlhf export policy) to merge it into the dequantized weights")

    def forward(self, x, *args, **kwargs):
        experts = self.get_base_layer()
        if self.disable_adapters or self.merged:
            return self.base_layer(x, *args, **kwargs)
        factors = [(self.lora_A[a].weight, self.lora_B[a].weight, float(self.scaling[a]))
                   for a in self.active_adapters if a in self.lora_A]
        experts.lora[self.parameter_name] = factors
        try:
            return self.base_layer(x, *args, **kwargs)
        finally:
            experts.lora.pop(self.parameter_name, None)


def lora_targets(lora, layout) -> dict:
    """peft LoraConfig arguments for LoRA section ``lora`` on a MoE of ``layout``: ``target_modules``
    (``all-linear``: the attention projections) and, with ``lora.experts``, ``target_parameters`` (the
    experts' fused weights). Names peft would take for experts or the router are refused."""
    if lora.target_modules == "all-linear":
        modules = list(ATTENTION)
    else:
        modules = list(lora.target_modules)
        taken = sorted(set(modules) & _PEFT_EXPERT_NAMES)
        if taken:
            raise UserError(f"lora.target_modules {taken}: on a mixture of experts these name the experts or the "
                            "router; adapt the experts with lora.experts=true (the router stays frozen)")
    out: dict = {"target_modules": modules}
    if lora.experts:
        if lora.dropout:
            raise UserError("lora.experts: LoRA on fused experts has no dropout (peft); set lora.dropout=0")
        out["target_parameters"] = [f"mlp.experts.{name}" for name in layout.weights]
    return out


def register_experts(peft_config) -> None:
    """Make peft wrap 4-bit experts with :class:`ParamWrapper` (its custom-module dispatch)."""
    peft_config._register_custom_module({Experts4bit: ParamWrapper})


def expert_factors(wrapper, adapter: str) -> tuple:
    """One fused expert weight's LoRA of ``adapter`` per expert: (A (E, r, in), scaling x B (E, out, r)),
    float32 numpy, from peft's layout (A's rows expert-major, B's columns expert-minor)."""
    experts = wrapper.num_experts
    a = wrapper.lora_A[adapter].weight.detach().float().cpu()
    b = wrapper.lora_B[adapter].weight.detach().float().cpu() * float(wrapper.scaling[adapter])
    return (a.reshape(experts, -1, a.shape[-1]).numpy(), b.reshape(b.shape[0], -1, experts).permute(2, 0, 1).numpy())


def expert_lora_weights(model, adapter: str) -> dict[str, tuple]:
    """HF weight name (``...mlp.experts.gate_up_proj``) -> :func:`expert_factors`, for every fused expert
    weight of the peft ``model`` that carries ``adapter`` (peft's wrapper or ours)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, _PeftParamWrapper) and adapter in module.lora_A:
            experts = name.replace(".base_layer", "")
            base = experts[len("base_model.model."):] if experts.startswith("base_model.model.") else experts
            out[f"{base}.{module.parameter_name}"] = expert_factors(module, adapter)
    return out


def adapter_config(adapter_dir, model):
    """The peft config saved in ``adapter_dir``, with :func:`register_experts` when ``model`` holds 4-bit
    experts (the wrapper is code, not in the saved config)."""
    from peft import PeftConfig

    config = PeftConfig.from_pretrained(str(adapter_dir))
    if any(isinstance(m, Experts4bit) for m in model.modules()):
        register_experts(config)
    return config
