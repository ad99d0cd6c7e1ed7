"""4-bit fused experts against bitsandbytes and against transformers' own experts forward.

The 4-bit experts must compute exactly what transformers' experts compute with the NF4-rounded
weights (a float tolerance of the summation order only), and those weights must be NF4's rounding of
the originals (a bound derived from the NF4 code table), on both layouts: Qwen3-MoE (E, out, in) and
gpt-oss (E, in, out) with biases and its clamped SwiGLU.
"""

from __future__ import annotations

import pytest
import torch

from homerlhf.models.moe import LAYOUTS
from homerlhf.tiny import TINY_EXPERTS
from moe_kit import dequantized_copy, hf_experts, quantized, routed, tolerance


@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("hidden", [128, 64])
def test_dequantized_experts_are_each_experts_codes_times_its_absmax(double_quant, hidden):
    """A chunk of routed experts, dequantized at once, equals each expert's own bitsandbytes quantization
    read by hand, bit for bit: the flat weights in blocks of 64, two codes per byte (high nibble first),
    each the NF4 table's value times its block's absmax (double quant: bitsandbytes' own dequantized
    absmax plus the expert's offset). Hidden 64 makes each expert's MLP 32 wide, so ``down_proj``'s rows
    (E, 64, 32) are not whole blocks: bitsandbytes' AVX-512 CPU kernel, given that shape, starts a block
    at every row."""
    import bitsandbytes.functional as F

    code = F.get_4bit_type("nf4", device="cpu")
    hf = hf_experts("qwen3_moe", hidden=hidden)
    experts = quantized(hf, "qwen3_moe", double_quant=double_quant)
    ids = torch.tensor([6, 1, 3])
    assert experts.shapes["down_proj"][2] == hidden // 2
    for name in experts.weight_names:
        got = experts.dequantize(name, ids)
        for row, e in enumerate(ids.tolist()):
            packed, state = F.quantize_4bit(getattr(hf, name)[e].detach().contiguous(), blocksize=64,
                                            quant_type="nf4", compress_statistics=double_quant)
            absmax = (F.dequantize_blockwise(state.absmax, state.state2) + state.offset if double_quant
                      else state.absmax)
            nibbles = torch.stack([packed.reshape(-1) >> 4, packed.reshape(-1) & 15], dim=1).reshape(-1).long()
            by_hand = (code[nibbles].reshape(-1, 64) * absmax.float()[:, None]).reshape(got.shape[1:])
            assert torch.equal(got[row], by_hand), (name, e)


def test_each_weight_is_within_nf4_rounding_of_the_original():
    """NF4 stores w as c x absmax', c the code nearest w / absmax (absmax: the block's true maximum,
    absmax' its stored, double-quantized value). So |w - c absmax'| <= |w - c absmax| + |absmax - absmax'|
    <= absmax x (half the widest gap between NF4 codes) + |absmax - absmax'|."""
    from bitsandbytes.functional import get_4bit_type

    code = get_4bit_type("nf4", device="cpu").sort().values
    half_gap = float((code[1:] - code[:-1]).max()) / 2  # (1 - 0.7230) / 2 = 0.1385
    for arch in LAYOUTS:
        hf = hf_experts(arch)
        experts = quantized(hf, arch)
        every = torch.arange(TINY_EXPERTS)
        for name in experts.weight_names:
            original = getattr(hf, name).detach().reshape(TINY_EXPERTS, -1, 64)
            stored = experts._absmax(name, every)  # (E, n / 64)
            true = original.abs().amax(-1)
            bound = true * half_gap + (true - stored).abs()
            error = (experts.dequantize(name, every).reshape(original.shape) - original).abs().amax(-1)
            assert (error <= bound * (1 + 1e-6)).all(), (arch, name)
            assert (error > 0).any()  # the weights really are rounded


@pytest.mark.parametrize("arch", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_backward_equal_transformers_experts_on_the_dequantized_weights(arch, dtype):
    """Outputs and the gradients to the hidden states and routing weights, against transformers' own
    experts forward (eager) holding the dequantized weights, in fp32 and in bf16 compute."""
    hf = hf_experts(arch, dtype)
    experts = quantized(hf, arch, compute=dtype)
    dense = dequantized_copy(hf, experts)
    hidden, index, weights = routed(dtype)
    results = []
    for module in (experts, dense):
        h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        out = module(h, index, w)
        (out.float() * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        results.append((out.detach().float(), h.grad.float(), w.grad.float()))
    reduction = experts.shapes["gate_up_proj"][1] + experts.shapes["down_proj"][1]
    for got, want in zip(*results):
        assert (got - want).abs().max() <= tolerance(dtype, reduction, want.abs().max().item()), arch
    assert results[0][0].abs().max() > 0


def test_chunks_of_any_size_give_the_same_outputs():
    """One expert dequantized at a time, or all at once: the same numbers (dequantization is elementwise)."""
    hf = hf_experts("gpt_oss")
    hidden, index, weights = routed()
    one = quantized(hf, "gpt_oss", chunk_bytes=1)
    every = quantized(hf, "gpt_oss")
    assert one.chunk_experts() == 1 and every.chunk_experts() >= TINY_EXPERTS
    with torch.no_grad():
        assert torch.equal(one(hidden, index, weights), every(hidden, index, weights))


def test_the_backward_keeps_no_dequantized_weight():
    """Like bitsandbytes' MatMul4Bit: what autograd saves holds no expert weight (the backward dequantizes again)."""
    hf = hf_experts("qwen3_moe")
    experts = quantized(hf, "qwen3_moe")
    hidden, index, weights = routed()
    shapes = {tuple(s[1:]) for s in experts.shapes.values()} | {tuple(s[1:][::-1]) for s in experts.shapes.values()}
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        experts(hidden.requires_grad_(), index, weights).sum()
    assert saved and not shapes & set(saved)


def test_only_routed_experts_are_dequantized(monkeypatch):
    """Expert 5 is routed no token: it is never dequantized; the others in chunks of ``chunk_experts``."""
    hf = hf_experts("qwen3_moe")
    per_expert = 4 * sum(s[1] * s[2] for s in quantized(hf, "qwen3_moe").shapes.values())
    experts = quantized(hf, "qwen3_moe", chunk_bytes=3 * per_expert)
    calls = []
    original = experts.dequantize
    monkeypatch.setattr(experts, "dequantize", lambda name, ids: calls.append((name, ids.tolist())) or original(name, ids))
    hidden, index, weights = routed()
    with torch.no_grad():
        experts(hidden, index, weights)
    gate_up = [ids for name, ids in calls if name == "gate_up_proj"]
    assert experts.chunk_experts() == 3
    assert gate_up == [[0, 1, 2], [3, 4, 6], [7]]
