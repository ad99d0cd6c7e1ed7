"""A mixture of experts' memory: its 4-bit experts, the chunk of them dequantized at once, the routed
tokens' activations, LoRA on the experts (:mod:`homerlhf.models.experts4bit` is what is counted).

The experts' weights are bitsandbytes NF4 per expert matrix (exact bytes: :func:`experts_nf4_bytes`).
A forward dequantizes the routed experts in chunks of :func:`chunk_experts` (``quant.expert_chunk_mib``)
and runs each expert on its tokens: its no-grad transient (:func:`moe_layer_transient`) is the layer's
output buffer, the routing, the chunk and the intermediates of one expert's tokens. Those are the most
tokens any one expert gets: :data:`ROUTING_SKEW` times the balanced share ``T k / E`` (a random router
on the tiny MoEs sends its busiest expert 1.2-1.5x the share). What autograd saves per token
(:func:`moe_saved_per_token`) is counted exactly, matched against saved-tensor hooks in the tests.
"""

from __future__ import annotations

import math

from homerlhf.memory.shapes import ModelShape

ROUTING_SKEW = 1.5
# A routed expert's kernel launches in a decode step, as a share of a dense layer's (not measured): its two
# fused matmuls with their dequantization, the gather, gate and scatter, about three of seven linears.
EXPERT_LAUNCH_SHARE = 3 / 7
# Bytes autograd keeps per intermediate width I of one routed token for the gate between the projections:
# SwiGLU keeps gate_up's output (2 I) and act(gate) (I); gpt-oss's clamped SwiGLU two clamps' inputs,
# the sigmoid, the clamped gate, up + 1 and their product besides.
GATE_SAVED = {"softmax-topk": 3, "topk-softmax": 6}
# ... and what the gate holds at once in a no-grad forward, per I of one routed token: gate_up's output
# (2 I) and act(gate) with its product with up; the clamped SwiGLU its clamped gate and up, their glu,
# up + 1 and the product besides.
GATE_TRANSIENT = {"softmax-topk": 4, "topk-softmax": 7}


def experts_nf4_bytes(shape: ModelShape, double_quant: bool) -> int:
    """Every layer's 4-bit experts as :class:`~homerlhf.models.experts4bit.Experts4bit` holds them: per expert
    matrix of n weights, n / 2 bytes of codes and an absmax per 64 (fp32; under double quant 8-bit, a fp32
    constant per 256 of them and the expert's fp32 offset), and per layer double quant's 256-entry code."""
    per_layer = 256 * 4 if double_quant else 0
    for out, inp in shape.expert_matrices():
        n = out * inp
        blocks = math.ceil(n / 64)
        stats = blocks + 4 * math.ceil(blocks / 256) + 4 if double_quant else 4 * blocks
        per_layer += shape.num_experts * (math.ceil(n / 2) + stats)
    return shape.num_layers * per_layer


def per_expert_params(shape: ModelShape) -> int:
    return sum(out * inp for out, inp in shape.expert_matrices())


def active_expert_params(shape: ModelShape) -> int:
    """Expert parameters one token multiplies through: its routed experts in every layer (0: dense)."""
    return shape.num_layers * shape.experts_per_token * per_expert_params(shape)


def decode_experts(shape: ModelShape, rows: int) -> tuple[float, int]:
    """A decode step of ``rows`` rows runs up to ``rows x k`` experts per layer, each dequantized whole:
    (their kernel launches as a share of a dense layer's, :data:`EXPERT_LAUNCH_SHARE` each; the expert
    weights the step reads). (0, 0) for a dense model."""
    experts = min(shape.num_experts, rows * shape.experts_per_token)
    return experts * EXPERT_LAUNCH_SHARE, shape.num_layers * experts * per_expert_params(shape)


def chunk_experts(shape: ModelShape, chunk_mib: float, c: int) -> int:
    """Experts dequantized at once (``Experts4bit.chunk_experts``), at most every expert."""
    return min(shape.num_experts, max(1, int(chunk_mib * 2**20) // (c * per_expert_params(shape))))


def chunk_bytes(cfg, shape: ModelShape, c: int) -> int:
    """The dequantized chunk of experts, in the compute dtype: the largest weight transient of a MoE layer."""
    return chunk_experts(shape, cfg.quant.expert_chunk_mib, c) * per_expert_params(shape) * c


def busiest_expert_tokens(shape: ModelShape, tokens: float) -> float:
    """The tokens the busiest expert gets of ``tokens``: :data:`ROUTING_SKEW` x the balanced share."""
    return min(tokens, ROUTING_SKEW * tokens * shape.experts_per_token / shape.num_experts)


def expert_token_bytes(shape: ModelShape, a: int, c: int, lora: bool) -> int:
    """Most bytes one routed token's intermediates hold at once in an expert's no-grad forward: its input
    with the gate-and-up projection in the compute dtype and back in ``a``; then act(gate) and its product
    with up beside that projection; then the down projection of that product. LoRA on the experts (fp32)
    adds, beside a projection's input and output, LoRA B's fp32 output and it scaled."""
    h, i = shape.hidden_size, shape.expert_intermediate_size
    cast = a != c
    gate_up = a * h + 2 * i * c + (2 * i * a if cast else 0)
    gate = GATE_TRANSIENT[shape.router] * i * a
    down = i * a + (i * c if cast else 0) + h * c + (h * a if cast else 0)
    if lora:
        gate_up = max(gate_up, a * h + 2 * i * a + 2 * (2 * i * 4))
        down = max(down, i * a + h * a + 2 * (h * 4))
    return max(gate_up, gate, down)


def moe_layer_transient(shape: ModelShape, tokens: float, a: int, c: int, lora: bool) -> float:
    """Bytes one MoE layer holds beyond its input in a no-grad forward of ``tokens`` tokens, but the
    dequantized chunk (:func:`chunk_bytes`): the output buffer (T h a), the router's logits (T E a, which
    transformers' MoE block keeps to its end), the routing (weights, ids and their sort: T k (a + 16)) and
    the busiest expert's tokens; or the router's own moment, were it larger (logits, their fp32 softmax, top-k)."""
    e, k = shape.num_experts, shape.experts_per_token
    experts = tokens * (shape.hidden_size * a + e * a + k * (a + 16))
    experts += busiest_expert_tokens(shape, tokens) * expert_token_bytes(shape, a, c, lora)
    router = tokens * (e * a + 4 * e + k * 12)
    return max(experts, router)


def moe_saved_per_token(shape: ModelShape, a: int, lora_r: int, lora: bool) -> float:
    """Bytes one MoE layer saves for backward per token (4-bit experts: no weight saved). Per routed token
    (k of them): the gate's tensors (:data:`GATE_SAVED` x I x a), the down projection's output and its
    routing weight ((2 h + 1) a), the ids of its gather, weighting and scatter (16); with LoRA on the experts
    the fp32 inputs of both projections and their low-rank outputs (4 (h + I) + 8 r). The router: Qwen3-MoE's
    fp32 softmax over the experts, the top-k ids and values and their sum (4 E + 12 k + 4); gpt-oss's top-k
    ids and its softmax over them (8 k + a k)."""
    h, i, e, k = shape.hidden_size, shape.expert_intermediate_size, shape.num_experts, shape.experts_per_token
    routed = a * (GATE_SAVED[shape.router] * i + 2 * h + 1) + 16 + (4 * (h + i) + 8 * lora_r if lora else 0)
    router = 4 * e + 12 * k + 4 if shape.router == "softmax-topk" else 8 * k + a * k
    return k * routed + router


def moe_backward_per_token(shape: ModelShape, a: int) -> float:
    """The backward's transients of one MoE layer per token: the gradients of the routed tokens'
    intermediates (2 I per routed token) and of the layer's input and output (2 h)."""
    return a * (2 * shape.experts_per_token * shape.expert_intermediate_size + 2 * shape.hidden_size)
