"""A mixture of experts' fused expert weights in 4 bit: :class:`Experts4bit`.

transformers holds each MoE layer's experts as two 3-D parameters (``gate_up_proj`` and ``down_proj``,
one matrix per expert), which bitsandbytes' 4-bit replacement of ``nn.Linear`` leaves in 16 bit. Here
each expert's matrix is quantized on its own with bitsandbytes (``quantize_4bit``: NF4 or FP4 codes,
one absmax per 64 weights, double quant as the base's ``Linear4bit``), the experts stacked: the codes
``(E, n / 2)`` uint8, the absmax ``(E, n / 64)`` (uint8 under double quant, with a per-expert offset
and second-level absmax). The forward dequantizes only the experts the router chose, a chunk of them
at a time (``chunk_bytes`` of dequantized weights at most, one expert at least), and like bitsandbytes'
``MatMul4Bit`` its backward dequantizes again instead of keeping the weights: the transient is one
chunk. LoRA on the experts (:mod:`homerlhf.models.expert_lora`) is added per routed token.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

BLOCK = 64  # weights per absmax, as the base's Linear4bit
NESTED_BLOCK = 256  # absmax values per second-level constant (double quant)


class Experts4bit(nn.Module):
    """One layer's experts, 4-bit, in place of transformers' experts module ``hf_experts``.

    ``weights``: the names of its 3-D weights, (E, out, in) per expert, or (E, in, out) when
    ``transposed`` (gpt-oss); ``biases``: its (E, out) biases, kept as they are. The gating between the
    two projections is the transformers class's own (``_apply_gate``). Built on the meta device before
    weights load; :meth:`quantize` turns each full-precision weight into its 4-bit form as it loads.
    """

    def __init__(self, hf_experts: nn.Module, weights: tuple[str, str], biases: tuple[str, ...], transposed: bool,
                 quant_type: str, double_quant: bool, compute_dtype: torch.dtype, chunk_bytes: int):
        super().__init__()
        self.num_experts = int(hf_experts.num_experts)
        self.weight_names, self.bias_names = weights, biases
        self.is_transposed = transposed  # peft's ParamWrapper reads it for the (in, out) order
        self.quant_type, self.double_quant, self.compute_dtype = quant_type, double_quant, compute_dtype
        self.chunk_bytes = chunk_bytes
        self.source_class = type(hf_experts).__name__
        self._gate = type(hf_experts)._apply_gate  # the class's own gating, called with this module
        for attr in ("act_fn", "alpha", "limit"):
            if hasattr(hf_experts, attr):
                setattr(self, attr, getattr(hf_experts, attr))
        self.shapes = {name: tuple(getattr(hf_experts, name).shape) for name in weights}
        for name in weights:
            self.register_parameter(name, nn.Parameter(torch.empty(self.shapes[name], device="meta"),
                                                       requires_grad=False))
        for name in biases:
            self.register_parameter(name, getattr(hf_experts, name))
        # Factors of the active LoRA adapters per weight name, set by expert_lora's wrappers around a forward.
        self.lora: dict[str, list[tuple[Tensor, Tensor, float]]] = {}

    # -- storage ------------------------------------------------------------------------------
    @torch.no_grad()
    def quantize(self, name: str, value: Tensor) -> nn.Parameter:
        """The 4-bit codes of weight ``name`` (E, d1, d2), its statistics registered as buffers; returns the
        codes (E, ceil(d1 d2 / 2)) uint8, the parameter that takes the weight's place."""
        import bitsandbytes.functional as F

        if tuple(value.shape) != self.shapes[name]:
            raise ValueError(f"{name}: got shape {tuple(value.shape)}, expected {self.shapes[name]}")
        codes, absmax, offset, absmax2, code2 = [], [], [], [], None
        for expert in value.to(self.compute_dtype):
            packed, state = F.quantize_4bit(expert.contiguous(), blocksize=BLOCK, quant_type=self.quant_type,
                                            compress_statistics=self.double_quant)
            codes.append(packed.reshape(-1))
            absmax.append(state.absmax)
            if self.double_quant:
                offset.append(state.offset.reshape(()))
                absmax2.append(state.state2.absmax)
                code2 = state.state2.code
        self.register_buffer(f"{name}_absmax", torch.stack(absmax))
        if self.double_quant:
            self.register_buffer(f"{name}_offset", torch.stack(offset).float())
            self.register_buffer(f"{name}_absmax2", torch.stack(absmax2))
            self.register_buffer("nested_code", code2)
        return nn.Parameter(torch.stack(codes), requires_grad=False)

    def storage_bytes(self) -> int:
        """Bytes of the 4-bit weights: codes and every statistic (biases not included)."""
        tensors = [getattr(self, n) for n in self.weight_names]
        tensors += [b for n, b in self.named_buffers(recurse=False)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _absmax(self, name: str, experts: Tensor) -> Tensor:
        """The fp32 absmax (N, n / 64) of ``experts``: double quant's 8-bit codes times their block's
        constant, plus the expert's offset (bitsandbytes' ``dequantize_blockwise`` + offset, exactly)."""
        absmax = getattr(self, f"{name}_absmax")[experts]
        if not self.double_quant:
            return absmax.float()
        scales = getattr(self, f"{name}_absmax2")[experts].repeat_interleave(NESTED_BLOCK, dim=1)
        values = self.nested_code[absmax.long()] * scales[:, : absmax.shape[1]]
        return values + getattr(self, f"{name}_offset")[experts, None]

    @torch.no_grad()
    def dequantize(self, name: str, experts: Tensor) -> Tensor:
        """The weights ``name`` of ``experts`` (N,), (N, d1, d2) in the compute dtype.

        Dequantized as one flat run of 64-weight blocks, then reshaped: bitsandbytes' AVX-512 CPU kernel
        reads a shape (..., d2) as rows of d2 that each start a block, which is wrong when d2 is not a
        multiple of 64 (a down projection's (hidden, moe_intermediate) of 32, say)."""
        codes = getattr(self, name)[experts]
        absmax = self._absmax(name, experts).reshape(-1).contiguous()
        shape = (int(experts.numel()), *self.shapes[name][1:])
        flat = torch.ops.bitsandbytes.dequantize_4bit.default(codes.reshape(-1, 1), absmax, BLOCK, self.quant_type,
                                                              (codes.numel() * 2,), self.compute_dtype)
        return flat.reshape(shape)

    def chunk_experts(self) -> int:
        """Experts dequantized at once: as many as ``chunk_bytes`` holds, at least one."""
        itemsize = torch.empty((), dtype=self.compute_dtype).element_size()
        per_expert = itemsize * sum(self.shapes[n][1] * self.shapes[n][2] for n in self.weight_names)
        return max(1, self.chunk_bytes // per_expert)

    # -- forward ------------------------------------------------------------------------------
    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """hidden_states (T, H), top_k_index / top_k_weights (T, k) -> (T, H): each token's routed
        experts' outputs, weighted and summed (transformers' experts forward, 4-bit)."""
        out = torch.zeros_like(hidden_states)
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (T k,) routed slots, grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        starts = [0]
        for count in counts:
            starts.append(starts[-1] + count)
        hit = [e for e, count in enumerate(counts) if count and e < self.num_experts]
        step = self.chunk_experts()
        gate_up, down = self.weight_names
        for first in range(0, len(hit), step):
            chunk = hit[first:first + step]
            ids = torch.tensor(chunk, device=flat.device)
            weights = (self.dequantize(gate_up, ids), self.dequantize(down, ids))
            for j, expert in enumerate(chunk):
                slots = order[starts[expert]:starts[expert + 1]]
                tokens = slots // k
                y = self._expert(hidden_states, tokens, expert, weights[0][j], weights[1][j])
                out.index_add_(0, tokens, (y * top_k_weights[tokens, slots % k, None]).to(out.dtype))
                del y  # not held while the next expert runs
            del weights
        return out

    def _expert(self, hidden_states: Tensor, tokens: Tensor, expert: int, gate_up: Tensor, down: Tensor) -> Tensor:
        """One expert's MLP on its routed tokens (n,): each intermediate is let go as soon as it is used."""
        x = hidden_states[tokens]
        h = self._project(x, self.weight_names[0], expert, gate_up)
        del x
        gated = self._gate(self, h)
        del h
        return self._project(gated, self.weight_names[1], expert, down)

    def _project(self, x: Tensor, name: str, expert: int, weight: Tensor) -> Tensor:
        """x (n, in) through expert ``expert``'s weight ``name`` (+ bias, + the active LoRA), in x's dtype."""
        y = _FrozenExpertMatmul.apply(x.to(self.compute_dtype), weight, self, name, expert).to(x.dtype)
        if name + "_bias" in self.bias_names:
            y = y + getattr(self, name + "_bias")[expert]
        for lora_a, lora_b, scale in self.lora.get(name, ()):
            a = lora_a.reshape(self.num_experts, -1, lora_a.shape[-1])[expert]  # (r, in): peft's row e * r + i
            b = lora_b.reshape(lora_b.shape[0], -1, self.num_experts)[:, :, expert]  # (out, r): column i * E + e
            y = y + (scale * ((x.to(a.dtype) @ a.T) @ b.T)).to(y.dtype)
        return y


class _FrozenExpertMatmul(torch.autograd.Function):
    """``x @ W.T`` (or ``x @ W`` for transposed storage) with a frozen 4-bit expert weight: the backward
    dequantizes it again, so no dequantized weight lives from the forward to the backward."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, experts: Experts4bit, name: str, expert: int) -> Tensor:
        ctx.experts, ctx.name, ctx.expert = experts, name, expert
        return x @ weight if experts.is_transposed else x @ weight.T

    @staticmethod
    def backward(ctx, grad: Tensor):
        experts = ctx.experts
        ids = torch.tensor([ctx.expert], device=grad.device)
        weight = experts.dequantize(ctx.name, ids)[0]
        grad_x = grad.to(weight.dtype) @ (weight.T if experts.is_transposed else weight)
        return grad_x, None, None, None, None


def experts_storage(model) -> Optional[int]:
    """Bytes of every 4-bit experts module in ``model``; None when it has none."""
    found = [m.storage_bytes() for m in model.modules() if isinstance(m, Experts4bit)]
    return sum(found) if found else None
