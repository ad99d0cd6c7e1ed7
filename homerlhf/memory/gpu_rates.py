"""The GPU's default throughputs: the H200 measurements and how they scale to another card and model.

A card nobody measured here gets the H200's figures scaled by its published FLOP/s and bandwidth
(:mod:`homerlhf.memory.cards`); `homerlhf bench` on it measures its own. The time model that reads
these rates is :mod:`homerlhf.memory.timing`; the figures' sources are in docs/time.md.
"""

from __future__ import annotations

from homerlhf.memory.cards import MEASURED, CardSpec, card_spec
from homerlhf.memory.experts import active_expert_params, decode_experts
from homerlhf.memory.shapes import ModelShape

GPU_SOURCE = "measured on NVIDIA H200 (2026-11-30, 2026-12-04)"
# GPU figures, measured on an NVIDIA H200 (CUDA 13, torch 2.11, bitsandbytes 0.50.2) with random-weight
# Qwen2.5 checkpoints in NF4 + LoRA r 16 on the 4090 preset's settings (docs/time.md, docs/gpu-runs/):
# - 2026-12-04, bf16 compute with TF32 (the kernels a policy sets, :mod:`homerlhf.models.cuda_kernels`),
#   Qwen2.5-7B, 32 prompts of 512 + 256 tokens: scoring 2.80 s = 3 no-grad forwards x 24,576 tokens:
#   26,300 tokens/s x 2 x 7.07 G matmul parameters = 3.72e14 FLOP/s; update 8.75 s = 2 forward + backward
#   passes: 5,620 tokens/s x 3 x 2 x 7.07 G = 2.38e14 FLOP/s. Generation, per decode step with the prefill
#   and the capture spread over its 256 steps (what an iteration's generation phase pays): the captured
#   static loop at 32 rows 6.43 s / 256 = 25.1 ms = 28 layers x 0.65 ms + the 30.45 GB of dequantized
#   weights at 4.8 TB/s (6.3 ms) + the chunk's FLOPs (0.6 ms at 16 rows; its step alone 20.5 ms); for the
#   1.5B that gives 19.7 ms a step where 64-step calls took 16.3 (an upper bound). HF generate at 16 rows
#   64.6 ms a step + 0.30 s a call = 65.8 ms: 2.35 ms a layer, launches and Python, not FLOPs or bytes.
# - 2026-11-30, the fp32 upcast of the base (``quant.upcast_non_quantized``), the same 7B run: scoring
#   4.5-4.7 s (2.27e14 FLOP/s), update 11.3 s (1.85e14), HF generate 84 ms a step (3.0 ms a layer).
# Compute-bound work scales to other models by FLOPs, generation by layers and bytes. Another card
# (:mod:`homerlhf.memory.cards`) gets these scaled by its published figures (:func:`gpu_trainer_rates`);
# `homerlhf bench` on it measures its own.
GPU_FLOPS = {"forward": 3.72e14, "train": 2.38e14}
GPU_FLOPS_UPCAST = {"forward": 2.27e14, "train": 1.85e14}
GPU_DECODE_S_PER_LAYER = {"hf": 2.35e-3, "static": 0.65e-3}
GPU_HF_DECODE_S_PER_LAYER_UPCAST = 3.0e-3
GPU_MEASURED_CHUNK = 16
# Bytes a decode step moves per weight: bitsandbytes dequantizes each NF4 linear (0.5 B read, 2 B of
# bf16 written) for a matmul that reads the 2 B again; the output projection is read once (2 B).
DECODE_BYTES_PER_LINEAR_PARAM = 4.5
DECODE_BYTES_PER_HEAD_PARAM = 2.0


def matmul_params(shape: ModelShape, lm_head: bool = True) -> int:
    """Parameters one token multiplies through: every decoder linear layer, its routed experts (a MoE) and
    (``lm_head``) the output projection (the embedding matrix when tied)."""
    return shape.linear_weight_params + active_expert_params(shape) + shape.vocab_size * shape.hidden_size * lm_head


def gpu_flops(upcast: bool) -> dict[str, float]:
    """The H200's effective FLOP/s of a no-grad forward and of forward + backward (:data:`GPU_FLOPS`;
    ``upcast``: the 4-bit base's fp32 upcast, :data:`GPU_FLOPS_UPCAST`)."""
    return GPU_FLOPS_UPCAST if upcast else GPU_FLOPS


def decode_step_s(shape: ModelShape, card: CardSpec = MEASURED, decoder: str = "static", upcast: bool = False) -> float:
    """Seconds of one decode step of :data:`GPU_MEASURED_CHUNK` rows on ``card``. ``hf`` (HF generate):
    the slowest of its per-layer launches and Python (:data:`GPU_DECODE_S_PER_LAYER`, taken as the same
    on any card: it depends on the host CPU as much), the bytes it moves at the card's bandwidth and its
    FLOPs at the H200's forward efficiency scaled by the card's FLOP/s. ``static`` (the captured loop):
    its per-layer replay cost plus the bytes plus the FLOPs (measured additive on the H200)."""
    launch_share, expert_params = decode_experts(shape, GPU_MEASURED_CHUNK)  # (0, 0) for a dense model
    head = shape.vocab_size * shape.hidden_size
    moved = DECODE_BYTES_PER_LINEAR_PARAM * (shape.linear_weight_params + expert_params) + DECODE_BYTES_PER_HEAD_PARAM * head
    flops = gpu_flops(upcast)["forward"] * card.flops / MEASURED.flops
    compute = GPU_MEASURED_CHUNK * 2.0 * matmul_params(shape) / flops
    layers = shape.num_layers * (1 + launch_share)  # a MoE layer's routed experts launch their own kernels
    if decoder == "static":
        return layers * GPU_DECODE_S_PER_LAYER["static"] + moved / card.bandwidth + compute
    per_layer = GPU_HF_DECODE_S_PER_LAYER_UPCAST if upcast else GPU_DECODE_S_PER_LAYER["hf"]
    return max(layers * per_layer, moved / card.bandwidth, compute)


def gpu_trainer_rates(shape: ModelShape, card: CardSpec = MEASURED, decoder: str = "static",
                      upcast: bool = False) -> dict[str, dict[int, float]]:
    """The trainer's tokens/s on ``card`` from the H200 measurements (:func:`gpu_flops`, :func:`decode_step_s`):
    forward and update scaled by the card's FLOP/s over the H200's (compute-bound), generation with
    ``decoder`` at :data:`GPU_MEASURED_CHUNK` prompts at once."""
    flops = 2.0 * matmul_params(shape)
    ratio = card.flops / MEASURED.flops
    rates = gpu_flops(upcast)
    return {"trainer_gen": {0: GPU_MEASURED_CHUNK / decode_step_s(shape, card, decoder, upcast)},
            "trainer_forward": {0: rates["forward"] * ratio / flops},
            "trainer_train": {0: rates["train"] * ratio / (3 * flops)}}


def gpu_source(card_name: str) -> str:
    """Where a GPU card's default figures come from, in words."""
    spec = card_spec(card_name)
    if spec is MEASURED:
        return GPU_SOURCE
    if spec is None:
        return (f"an NVIDIA H200's figures (2026-12-04), not scaled to '{card_name}' (no published figures for it "
                "in homerlhf.memory.cards): a slower card takes longer")
    return (f"H200 figures scaled to the {spec.name} by its published specs ({spec.tflops:g} vs "
            f"{MEASURED.tflops:g} TFLOPS, {spec.bandwidth_gbs / 1000:.2f} vs {MEASURED.bandwidth_gbs / 1000:.1f} TB/s), "
            f"not measured on one")
