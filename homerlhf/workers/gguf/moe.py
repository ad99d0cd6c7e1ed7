"""Qwen3-MoE: llama.cpp's ``qwen3moe`` graph, its experts in llama.cpp's layout.

llama.cpp holds each layer's experts as three 3-D tensors, ``ffn_gate_exps`` and ``ffn_up_exps``
(E, I, h) and ``ffn_down_exps`` (E, h, I) (numpy order), and the router as ``ffn_gate_inp`` (E, h).
A checkpoint stores one matrix per expert (``mlp.experts.<e>.gate_proj.weight``, ...: stacked here);
the dequantized NF4 experts of the policy (:func:`.tensors.nf4_tensors`) come as transformers fuses
them, ``mlp.experts.gate_up_proj`` (E, 2 I, h) with gate then up, and ``down_proj`` (E, h, I): split
here. The graph softmaxes the router over all experts, takes the top k and renormalizes them: a
checkpoint with ``norm_topk_prob`` off computes otherwise and is refused.
"""

from __future__ import annotations

import re
from functools import partial

import numpy as np

from homerlhf.errors import UserError
from homerlhf.workers.gguf.qwen import Qwen3Family
from homerlhf.workers.gguf.tensors import LazyTensor

_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_GGUF = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def _rows(first: int, last: int, weight: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(weight[:, first:last])


def _stack(parts: list[LazyTensor]) -> np.ndarray:
    return np.stack([part.load() for part in parts])


def expert_tensors(tensors: dict[str, LazyTensor], config: dict) -> dict[str, LazyTensor]:
    """The expert tensors of ``tensors`` (HF names, removed from it) as llama.cpp's, by GGUF name."""
    experts = int(config.get("num_experts") or config["num_local_experts"])
    inter = int(config["moe_intermediate_size"])
    out: dict[str, LazyTensor] = {}
    singles: dict[tuple[int, str], dict[int, LazyTensor]] = {}
    for name in list(tensors):
        fused, single = _FUSED.match(name), _PER_EXPERT.match(name)
        if fused:
            layer, kind = int(fused.group(1)), fused.group(2)
            tensor = tensors.pop(name)
            if kind == "down_proj":
                out[f"blk.{layer}.ffn_down_exps.weight"] = tensor
                continue
            half = (experts, inter, tensor.shape[2])
            out[f"blk.{layer}.ffn_gate_exps.weight"] = tensor.then(partial(_rows, 0, inter), half)
            out[f"blk.{layer}.ffn_up_exps.weight"] = tensor.then(partial(_rows, inter, 2 * inter), half)
        elif single:
            layer, expert, kind = int(single.group(1)), int(single.group(2)), single.group(3)
            singles.setdefault((layer, kind), {})[expert] = tensors.pop(name)
    for (layer, kind), parts in singles.items():
        if sorted(parts) != list(range(experts)):
            raise UserError(f"layer {layer}: {kind} of {len(parts)} experts in the checkpoint, the config says {experts}")
        ordered = [parts[e] for e in range(experts)]
        out[f"blk.{layer}.{_GGUF[kind]}.weight"] = LazyTensor((experts, *ordered[0].shape), partial(_stack, ordered))
    return out


class Qwen3MoeFamily(Qwen3Family):
    gguf_arch = "qwen3moe"

    def check(self, config: dict, where: str) -> None:
        super().check(config, where)
        if config.get("norm_topk_prob") is False:
            raise UserError(f"{where}: norm_topk_prob is off, but llama.cpp's qwen3moe graph renormalizes the "
                            "top-k router weights; its log-probs would differ")
        if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step") or 1) != 1:
            raise UserError(f"{where}: dense MLP layers among the experts' (mlp_only_layers, decoder_sparse_step) "
                            "have no place in llama.cpp's qwen3moe graph")

    def add_hparams(self, writer, config: dict, vocab_size: int, where: str) -> dict[str, LazyTensor]:
        extra = super().add_hparams(writer, config, vocab_size, where)
        writer.add_expert_count(int(config.get("num_experts") or config["num_local_experts"]))
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
        writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
        return extra

    def map_tensors(self, tensors: dict[str, LazyTensor], config: dict, skip=lambda name: False) -> dict[str, LazyTensor]:
        rest = dict(tensors)
        experts = expert_tensors(rest, config)
        return {**super().map_tensors(rest, config, skip), **experts}
