"""The critic on a base of its own (``critic.model``) in the scoring and update phases.

Its forward and backward run on its own base, one after the actor's (the actor's graph is freed by
then: :func:`homerlhf.ppo.update.backward_separate_adapters`), so each is a moment of its own, counted
on the critic's shape (:func:`homerlhf.memory.shapes.critic_shape`) with the formulas the policy's
moments use (:mod:`homerlhf.memory.phases`). Its weights, LoRA, value head, optimizer states and
gradients are persistent components (:mod:`homerlhf.memory.components`).
"""

from __future__ import annotations

from homerlhf.memory.components import (
    Component,
    dtype_bytes,
    dtype_names,
    forward_layer_transient_per_token,
    layer_saved_bytes_per_token,
    lengths,
    lora_on_mlp,
)
from homerlhf.memory.shapes import critic_shape

SCORING = "critic forward (own base)"
UPDATE = "critic layer backward (own base)"


def _dequantized(cfg, shape, c: int) -> list[Component]:
    """bitsandbytes' copy of the largest linear of ``shape``, made for each matmul."""
    if not cfg.quant.load_in_4bit:
        return []
    return [Component("critic dequantized weight", "activations", shape.largest_linear_params * c,
                      dtype=dtype_names(cfg)[0])]


def critic_scoring_moments(cfg, assumptions) -> dict[str, list[Component]]:
    """The critic's no-grad forward over a scoring batch on its own base; {} without ``critic.model``."""
    own = critic_shape(cfg)
    if own is None:
        return {}
    c, a, _ = dtype_bytes(cfg, assumptions)
    act = dtype_names(cfg)[1]
    b = cfg.rollout.chunk_size if assumptions.scoring_batch == "chunk" else cfg.ppo.micro_batch_size
    _, _, t = lengths(cfg)
    layer = b * t * forward_layer_transient_per_token(own, a, c, lora_on_mlp(cfg.critic.lora)) + b * t * t * a
    if assumptions.attention == "eager":
        layer += 2 * b * own.num_heads * t * t * a
    return {SCORING: [
        Component("critic hidden states", "activations", b * t * own.hidden_size * a, dtype=act,
                  note=f"{b} x {t} tokens ({assumptions.scoring_batch}) on {own.name}"),
        Component("critic layer activations (no grad)", "activations", int(layer), dtype=act),
        *_dequantized(cfg, own, c)]}


def critic_update_moments(cfg, assumptions, grads: Component) -> dict[str, list[Component]]:
    """The critic's backward through one of its layers (checkpointed: its layer inputs saved, one layer
    recomputed), beside every gradient (``grads``); {} without ``critic.model``."""
    own = critic_shape(cfg)
    if own is None:
        return {}
    c, a, _ = dtype_bytes(cfg, assumptions)
    act = dtype_names(cfg)[1]
    m = cfg.ppo.micro_batch_size
    _, n, t = lengths(cfg)
    tokens = m * t
    per_layer = layer_saved_bytes_per_token(own, a, t, cfg.critic.lora.r, cfg.critic.lora.target_modules)
    h, i, layers = own.hidden_size, own.intermediate_size, own.num_layers
    if cfg.training.gradient_checkpointing:
        saved = [Component("critic checkpointed layer inputs", "activations", tokens * h * a * (layers + 1),
                           note=f"{m} x {t} tokens x {layers + 1} x h on {own.name}", dtype=act),
                 Component("critic recomputed layer", "activations", int(tokens * per_layer), note="one layer")]
    else:
        saved = [Component("critic saved activations", "activations", int(tokens * per_layer * layers + tokens * h * a),
                           note=f"{m} x {t} tokens x {layers} layers on {own.name}, no checkpointing")]
    count = 1 if cfg.training.gradient_checkpointing else layers
    scores = [Component("critic attention scores", "activations", 2 * count * m * own.num_heads * t * t * a,
                        dtype=act)] if assumptions.attention == "eager" else []
    return {UPDATE: [grads, *saved, Component("critic backward transients", "activations",
                                              tokens * (2 * i + 2 * h) * a, dtype=act),
                     Component("value loss tensors", "buffers", m * n * 4 * 12, dtype="fp32"),
                     *scores, *_dequantized(cfg, own, c)]}
