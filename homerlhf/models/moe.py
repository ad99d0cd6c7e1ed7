"""Mixtures of experts homerlhf knows, and loading their experts in 4 bit.

A known MoE (:data:`LAYOUTS`, by ``model_type``) names its experts class, the fused 3-D weights it
holds, whether they are stored (E, in, out) and its router's class. Anything else with experts is
refused from ``config.json`` alone (:func:`check_moe`), and a known type whose modules are not what
its layout says is refused while its skeleton is built, before a weight is read.

:func:`experts_in_4bit` loads with transformers' own bitsandbytes 4-bit quantizer, extended to the
fused experts: each experts module becomes an :class:`~homerlhf.models.experts4bit.Experts4bit` before
the weights load, and each expert weight is quantized as it arrives (transformers loads one tensor at a
time when it quantizes on the fly), so a 30B MoE never sits in 16 bit on the card.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from homerlhf.errors import UserError

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok")


@dataclass(frozen=True)
class ExpertsLayout:
    """How one MoE family holds its experts in transformers."""

    experts_class: str
    router_class: str
    transposed: bool  # weights stored (E, in, out), not (E, out, in)
    weights: tuple[str, str] = ("gate_up_proj", "down_proj")
    biases: tuple[str, ...] = ()


LAYOUTS: dict[str, ExpertsLayout] = {
    "qwen3_moe": ExpertsLayout("Qwen3MoeExperts", "Qwen3MoeTopKRouter", transposed=False),
    "gpt_oss": ExpertsLayout("GptOssExperts", "GptOssTopKRouter", transposed=True,
                             biases=("gate_up_proj_bias", "down_proj_bias")),
}


def _text_config(config: dict) -> dict:
    inner = config.get("text_config")
    return {**inner, "model_type": inner.get("model_type", config.get("model_type"))} if isinstance(inner, dict) else config


def is_moe(config: dict) -> bool:
    """Whether a ``config.json`` mapping describes a mixture of experts."""
    cfg = _text_config(config)
    return any(cfg.get(key) for key in EXPERT_KEYS) or cfg.get("model_type") in LAYOUTS


def check_moe(config: dict, where: str) -> Optional[ExpertsLayout]:
    """The layout of a MoE ``config`` (None for a dense model); a UserError for an MoE homerlhf does not know."""
    if not is_moe(config):
        return None
    cfg = _text_config(config)
    model_type = str(cfg.get("model_type", "?"))
    layout = LAYOUTS.get(model_type)
    if layout is None:
        raise UserError(f"{where}: mixture of experts {model_type!r} is not supported (its expert layout and router "
                        f"are unknown to homerlhf); supported MoE: {', '.join(LAYOUTS)}, or a dense model")
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") not in (None, "bitsandbytes"):
        raise UserError(f"{where}: the checkpoint's experts are stored {quant.get('quant_method')}-quantized; give a "
                        "16-bit copy of it (e.g. its BF16 upload, or one dequantized with transformers)")
    return layout


def _swap_experts(model, layout: ExpertsLayout, settings: dict) -> set[str]:
    """Replace every experts module of ``model`` (a skeleton on the meta device) by an ``Experts4bit``;
    returns the names of the weights to quantize. Refuses modules the layout does not describe."""
    from homerlhf.models.experts4bit import Experts4bit

    names: set[str] = set()
    for name, module in list(model.named_modules()):
        kind = type(module).__name__
        if kind.endswith("Router") and kind != layout.router_class:
            raise UserError(f"{name}: router {kind} is not the {layout.router_class} homerlhf knows for this model")
        if kind != layout.experts_class:
            fused = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
            if fused:
                raise UserError(f"{name}: {kind} holds fused expert weights {', '.join(fused)} in a layout homerlhf "
                                f"does not know (expected {layout.experts_class})")
            continue
        parent_name, _, child = name.rpartition(".")
        swapped = Experts4bit(module, layout.weights, layout.biases, layout.transposed, **settings)
        setattr(model.get_submodule(parent_name), child, swapped)
        names.update(f"{name}.{w}" for w in layout.weights)
    if not names:
        raise UserError(f"{type(model).__name__}: no {layout.experts_class} found; the MoE's layout is not the one "
                        "homerlhf knows")
    return names


def _quantizer_class(layout: ExpertsLayout, chunk_bytes: int):
    """transformers' bitsandbytes 4-bit quantizer, which also quantizes ``layout``'s experts."""
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    class ExpertsBnb4BitHfQuantizer(Bnb4BitHfQuantizer):
        def _process_model_before_weight_loading(self, model, device_map, **kwargs):
            super()._process_model_before_weight_loading(model, device_map, **kwargs)
            config = self.quantization_config
            self.expert_weights = _swap_experts(model, layout, dict(
                quant_type=config.bnb_4bit_quant_type, double_quant=config.bnb_4bit_use_double_quant,
                compute_dtype=config.bnb_4bit_compute_dtype, chunk_bytes=chunk_bytes))

        def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
            return param_name in self.expert_weights or super().param_needs_quantization(model, param_name, **kwargs)

        def get_quantize_ops(self):
            return _ExpertsQuantize(self, super().get_quantize_ops())

    return ExpertsBnb4BitHfQuantizer


class _ExpertsQuantize:
    """The quantize op of one loaded tensor: an expert weight to ``Experts4bit.quantize``, the rest to
    bitsandbytes' own op."""

    def __init__(self, quantizer, linear_op):
        self.quantizer, self.linear_op = quantizer, linear_op

    def __getattr__(self, name):  # the rest of transformers' ConversionOps interface
        return getattr(self.linear_op, name)

    def convert(self, input_dict: dict, model=None, **kwargs) -> dict:
        result, rest = {}, {}
        for name, value in input_dict.items():
            if name in self.quantizer.expert_weights:
                module_name, _, weight = name.rpartition(".")
                value = value[0] if isinstance(value, list) else value
                result[name] = model.get_submodule(module_name).quantize(weight, value)
                model.get_submodule(module_name)._is_hf_initialized = True
            else:
                rest[name] = value
        if rest:
            result.update(self.linear_op.convert(rest, model=model, **kwargs))
        return result


@contextmanager
def experts_in_4bit(layout: Optional[ExpertsLayout], chunk_mib: float) -> Iterator[None]:
    """Within it, ``from_pretrained`` with a bitsandbytes 4-bit config also quantizes ``layout``'s experts
    (nothing changes for a dense model: ``layout`` None); ``chunk_mib``: the forward's dequantized chunk."""
    if layout is None:
        yield
        return
    from transformers.quantizers import auto

    key = "bitsandbytes_4bit"
    original = auto.AUTO_QUANTIZER_MAPPING[key]
    auto.AUTO_QUANTIZER_MAPPING[key] = _quantizer_class(layout, int(chunk_mib * 2**20))
    try:
        yield
    finally:
        auto.AUTO_QUANTIZER_MAPPING[key] = original


def router_modules(model, layout: ExpertsLayout) -> list[torch.nn.Module]:
    """The routers of ``model`` (frozen in every run: their weights are the base's)."""
    return [m for m in model.modules() if type(m).__name__ == layout.router_class]


def moe_shape_fields(cfg: dict, name: str) -> dict:
    """The ModelShape fields of a mixture of experts (none for a dense model); a UserError for one
    homerlhf cannot load, or one with dense MLP layers among its experts' (not planned)."""
    layout = check_moe(cfg, name)
    if layout is None:
        return {}
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1:
        raise UserError(f"{name}: dense MLP layers among the experts' (mlp_only_layers, decoder_sparse_step) are "
                        "not planned; every layer of a planned MoE routes to experts")
    fields = dict(num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),
                  experts_per_token=int(cfg.get("num_experts_per_tok") or cfg["experts_per_token"]))
    if cfg.get("model_type") == "gpt_oss":
        return dict(fields, expert_intermediate_size=int(cfg["intermediate_size"]), expert_biases=True,
                    router="topk-softmax", attention_sinks=True, o_proj_bias=bool(cfg.get("attention_bias", True)),
                    eager_attention=True)
    return dict(fields, expert_intermediate_size=int(cfg["moe_intermediate_size"]))
