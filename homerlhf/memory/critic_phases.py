"""The critic on a base of its own (``critic.model``) in the scoring and update phases.

Its forward and backward run on its own base, one after the actor's (the actor's graph is freed by
then: :func:`homerlhf.ppo.loop.micro_batch_loss`), so each is a moment of its own, counted
on the critic's shape (:func:`homerlhf.memory.shapes.critic_shape`) with the formulas the policy's
moments use (:mod:`homerlhf.memory.phases`); its activation checkpointing is the run's, as the policy's
(every n-th of its own layers, their inputs in host memory under ``training.activation_offload``). Its
weights, LoRA, value head, optimizer states and gradients are persistent components
(:mod:`homerlhf.memory.components`).
"""

from __future__ import annotations

from dataclasses import replace

from homerlhf.memory.components import (
    Component,
    dtype_bytes,
    dtype_names,
    forward_layer_transient_per_token,
    layer_saved_bytes_per_token,
    lengths,
    lora_on_mlp,
)
from homerlhf.memory.recompute import update_saved
from homerlhf.memory.shapes import critic_shape

SCORING = "critic forward (own base)"
UPDATE = "critic layer backward (own base)"
# update_saved's moments of the policy, as the critic's own.
MOMENTS = {"layer backward": UPDATE, "recomputed layer backward": "critic recomputed layer backward (own base)"}


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
    """The critic's backward on its own base, beside every gradient (``grads``): what its forward kept and,
    at a recomputed layer, that layer's activations, with the run's checkpointing as the policy's
    (``training.checkpoint_every_n_layers`` on the critic's own layer count, ``activation_offload``:
    :func:`homerlhf.memory.recompute.update_saved`, its components named ``critic ...``); {} without
    ``critic.model``."""
    own = critic_shape(cfg)
    if own is None:
        return {}
    c, a, _ = dtype_bytes(cfg, assumptions)
    act = dtype_names(cfg)[1]
    m = cfg.ppo.micro_batch_size
    _, n, t = lengths(cfg)
    tokens = m * t
    per_layer = layer_saved_bytes_per_token(own, a, t, cfg.critic.lora.r, cfg.critic.lora.target_modules)
    mixed = act if a == 4 else f"{act}; norm inputs and LoRA inputs fp32"
    _, layer_moments = update_saved(cfg, own, m, t, per_layer, a, act, mixed)
    kept = own.num_layers - cfg.training.checkpointed_layers(own.num_layers)
    # Eager attention: each layer not checkpointed keeps its scores, a recomputed one makes them again.
    scores = [Component("critic attention scores", "activations",
                        (kept + (kept < own.num_layers)) * 2 * m * own.num_heads * t * t * a,
                        dtype=act)] if assumptions.attention == "eager" else []
    common = [Component("critic backward transients", "activations", tokens * (2 * own.intermediate_size
                                                                              + 2 * own.hidden_size) * a, dtype=act),
              Component("value loss tensors", "buffers", m * n * 4 * 12, dtype="fp32"), *scores,
              *_dequantized(cfg, own, c)]
    return {MOMENTS[name]: [grads, *(_critic_named(x, own.name) for x in alive), *common]
            for name, alive in layer_moments.items()}


def _critic_named(component: Component, model: str) -> Component:
    """One of :func:`~homerlhf.memory.recompute.update_saved`'s components as the critic's own."""
    return replace(component, name=f"critic {component.name}", note=f"{component.note} on {model}".strip())
