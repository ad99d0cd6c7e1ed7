"""The LM head's logits in fp32 from a 16-bit head and 16-bit hidden states.

PPO's ratio and KL read log-probs, and a bf16 logit carries 8 bits of mantissa: a logit of 20 is
known to +-0.06, so a bf16 LM head output would move log-probs by as much. With the compute dtype end
to end (``quant.upcast_non_quantized`` off) the head stays in bf16 (fp16 on a T4), and
:func:`fp32_logits` multiplies it with fp32 accumulation *and* fp32 output, keeping no fp32 copy of
the head: on CUDA one GEMM with ``out_dtype=float32`` (cuBLAS accumulates 16-bit products in fp32
anyway; only the output's rounding goes), elsewhere (CPU, which has no such kernel) blocks of the
head upcast one at a time. A product of two bf16 (or two fp16) numbers is exact in fp32, so both
give the fp32 sum of the exact products, up to the order of the additions.

:func:`install_fp32_logits` makes it the head module's own forward. Every reader of logits then gets
the same function: HF ``generate`` (the sampler and the behaviour log-probs), the static-cache decode
loop (:mod:`homerlhf.models.static_decode`, which calls the model's forward) and the chunked
log-probs of the scorer and the update (:mod:`homerlhf.models.logprobs`, which call the head).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

_HALF = (torch.bfloat16, torch.float16)
# Elements of the head upcast at once off CUDA: a 16 MiB fp32 block whatever the vocabulary.
BLOCK_ELEMENTS = 1 << 22


def _fp32_matmul(rows: Tensor, weight: Tensor) -> Tensor:
    """rows (N, H) @ weight (V, H).T -> (N, V) fp32, accumulated in fp32, without an fp32 copy of weight."""
    if rows.is_cuda and rows.dtype == weight.dtype and weight.dtype in _HALF:
        return torch.mm(rows, weight.t(), out_dtype=torch.float32)
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32, device=rows.device)
    rows32 = rows.float()
    step = max(1, BLOCK_ELEMENTS // max(weight.shape[1], 1))
    for start in range(0, weight.shape[0], step):
        torch.mm(rows32, weight[start : start + step].float().t(), out=out[:, start : start + step])
    return out


class _Fp32Logits(torch.autograd.Function):
    """``hidden @ weight.T`` in fp32 (see the module docstring); backward in the weight's dtype, as an
    autocast GEMM would run it (a 16-bit gradient of the hidden states is what flows back anyway)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(hidden, weight)
        rows = hidden.reshape(-1, hidden.shape[-1])
        return _fp32_matmul(rows, weight).view(*hidden.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor):
        hidden, weight = ctx.saved_tensors
        grad2d = grad.reshape(-1, weight.shape[0]).to(weight.dtype)
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = torch.mm(grad2d, weight).view(hidden.shape).to(hidden.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = torch.mm(grad2d.t(), hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype))
        return grad_hidden, grad_weight


def fp32_logits(hidden: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(hidden, weight, bias)`` as fp32 logits: hidden (..., H), weight (V, H) -> (..., V)
    fp32. A 16-bit head goes through :class:`_Fp32Logits`; an fp32 one is a plain fp32 linear."""
    if weight.dtype not in _HALF:
        logits = nn.functional.linear(hidden.to(weight.dtype), weight, bias)
        return logits.float()
    logits = _Fp32Logits.apply(hidden, weight)
    return logits if bias is None else logits + bias.float()


class Fp32LogitsLinear(nn.Linear):
    """An ``nn.Linear`` LM head whose forward returns fp32 logits (:func:`fp32_logits`); same weights,
    same state dict."""

    def forward(self, hidden: Tensor) -> Tensor:
        return fp32_logits(hidden, self.weight, self.bias)


def install_fp32_logits(causal_lm) -> bool:
    """Make ``causal_lm``'s output embedding return fp32 logits, in place; True when it did (an
    ``nn.Linear`` head), False for a head of another kind (left as it is)."""
    head = causal_lm.get_output_embeddings()
    if type(head) is Fp32LogitsLinear:
        return True
    if type(head) is not nn.Linear or hasattr(head, "_hf_hook"):
        return False
    head.__class__ = Fp32LogitsLinear
    return True
