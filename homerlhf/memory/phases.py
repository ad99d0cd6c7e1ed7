"""The three PPO phases as memory: the components alive at each phase's peak moment.

A phase's peak is the largest of a few moments (e.g. prefill vs. the last decode step); the
components returned are those of the peak moment, so they add up to the phase total. The
persistent components (weights, adapters, optimizer states, experience) are added by
:func:`homerlhf.memory.planner.plan`.
"""

from __future__ import annotations

from typing import Optional

from homerlhf.memory.critic_phases import critic_scoring_moments, critic_update_moments
from homerlhf.memory.recompute import update_saved
from homerlhf.memory.experts import moe_backward_per_token
from homerlhf.memory.components import (
    Component,
    dequantized_bytes,
    dtype_bytes,
    dtype_names,
    forward_layer_transient_per_token,
    held_gradients,
    kv_bytes_per_token,
    layer_saved_bytes_per_token,
    lengths,
    logprob_buffer_bytes,
    lora_on_mlp,
    planned_decoder,
    trainable_grad_bytes,
)

PHASES = ("generation", "scoring", "update")


def generation_phase(cfg, shape, assumptions, chunk: Optional[int] = None) -> tuple[str, list[Component]]:
    """Generation of one chunk (``chunk``, default the config's generation chunk) of prompts.

    Two decoders are counted and the larger taken (``assumptions.decoder`` "any"; "hf" or "static" for
    one): HF ``generate`` with a DynamicCache, which grows by ``torch.cat`` (one layer's K or V briefly
    twice), and a decode loop over a static cache preallocated for B x (P + N) tokens before the
    prefill, whose captured decode step keeps its transients in a CUDA-graph pool.
    """
    c, a, _ = dtype_bytes(cfg, assumptions)
    compute, act = dtype_names(cfg)
    b = cfg.rollout.generation_chunk_size if chunk is None else chunk
    p, n, t = lengths(cfg)
    kv = kv_bytes_per_token(shape, a)
    per_token = forward_layer_transient_per_token(shape, a, c, lora_on_mlp(cfg.actor.lora, shape))
    logits_per_row = shape.vocab_size * (16 + (12 if cfg.rollout.top_p < 1 else 0))
    prefill_act, w = _prefill_activations(cfg, shape, assumptions, b, per_token)
    dequant = Component("dequantized weight", "activations", dequantized_bytes(cfg, shape, c), dtype=compute,
                        note=_dequant_note(shape)) if cfg.quant.load_in_4bit else None
    kv_note = f"2 x {shape.num_layers} layers x {shape.kv_dim} x {a} B per token"
    static_kv = Component("KV cache (static)", "kv_cache", b * t * kv, note=f"{b} x {t} tokens, {kv_note}", dtype=act)
    logits = Component("sampling logits", "logits", b * logits_per_row, note="last position, + warpers", dtype="fp32")
    # HF generate: sdpa with a mask (left-padded rows) repeats K and V to every query head, over the whole
    # cache, in each layer of a decode step (transformers 5.17's use_gqa_in_sdpa): the step's largest
    # transient at long T. The static loop folds each KV head's query group instead
    # (homerlhf.models.decode_attention): no repeat, one token's scores over the cache (sdpa's math kernel);
    # on eager attention it repeats too, beside the scores and their softmax.
    kv_repeat = 2 * b * t * shape.q_dim * a if shape.kv_dim < shape.q_dim else 0
    step = b * per_token + kv_repeat
    scores = b * shape.num_heads * t * a
    static_step = b * per_token + (kv_repeat + 2 * scores if assumptions.attention == "eager" else scores)
    decoder = planned_decoder(cfg, assumptions)
    moments = {}
    if decoder in ("hf", "any"):
        # The logits come after the last layer (and the last decode step holds more beside them); in pieces
        # generate keeps the previous piece's output, its last position's fp32 logits, through the next.
        held = [Component("previous piece's logits", "logits", b * shape.vocab_size * 4, dtype="fp32",
                          note="the last position's, kept through the next piece")] if w < p else []
        moments["prefill"] = [Component("KV cache", "kv_cache", b * p * kv, note=f"{b} x {p} prompt tokens", dtype=act),
                              prefill_act, *held]
        moments["last decode step"] = [
            Component("KV cache", "kv_cache", b * t * kv * (shape.num_layers + 1) // shape.num_layers, dtype=act,
                      note=f"{b} x {t} tokens, {kv_note}; + one layer's while torch.cat grows it"),
            Component("decode activations", "activations", int(step), note="one layer, K/V repeated over the cache",
                      dtype=act),
            logits]
    if decoder in ("static", "any"):
        pool = static_step + b * shape.vocab_size * 4 + (dequant.bytes if dequant else 0)
        moments["prefill (static cache)"] = [static_kv, prefill_act]  # pieces but the last skip the LM head
        moments["decode step (static cache)"] = [
            static_kv, Component("CUDA-graph pool", "activations", int(pool),
                                 note="one captured decode step: layer transients, logits, dequantized weight"),
            logits]
    for name, comps in moments.items():
        in_pool = name == "decode step (static cache)"  # the captured step's dequantized weight is in its pool
        comps.extend(([dequant] if dequant and not in_pool else []) + held_gradients(cfg, shape, assumptions))
    return _largest(moments)


def _prefill_activations(cfg, shape, assumptions, b: int, per_token: float) -> tuple[Component, int]:
    """One layer's transients at the prefill of ``b`` prompts, and the columns ``w`` of its forward: a block
    of more than ``rollout.prefill_tokens`` is prefilled in pieces of ``w`` columns (both decoders), whose
    transients, and the mask's rows, are those of a piece (its keys span the block)."""
    _, a, _ = dtype_bytes(cfg, assumptions)
    p = cfg.rollout.max_prompt_len
    w = cfg.rollout.prefill_columns(b, p) or p
    prefill = b * w * per_token + b * w * p * a  # + the additive causal mask
    if assumptions.attention == "eager":
        prefill += 2 * b * shape.num_heads * w * p * a
    piece = f"{b} x {w} tokens (a piece of the {b} x {p} block: rollout.prefill_tokens)" if w < p else f"{b} x {p} tokens"
    return Component("prefill activations", "activations", int(prefill), note=f"one layer over {piece}",
                     dtype=dtype_names(cfg)[1]), w


def scoring_phase(cfg, shape, assumptions) -> tuple[str, list[Component]]:
    c, a, _ = dtype_bytes(cfg, assumptions)
    compute, act = dtype_names(cfg)
    b = cfg.rollout.chunk_size if assumptions.scoring_batch == "chunk" else cfg.ppo.micro_batch_size
    p, n, t = lengths(cfg)
    hidden = b * t * shape.hidden_size * a
    layer = b * t * forward_layer_transient_per_token(shape, a, c, lora_on_mlp(cfg.actor.lora, shape)) + b * t * t * a
    if assumptions.attention == "eager":
        layer += 2 * b * shape.num_heads * t * t * a
    outputs = b * n * 4 * 4  # log-probs, entropy, values, ref log-probs: (B, N) fp32
    moments = {
        "forward (actor/critic/ref)": [
            Component("hidden states", "activations", hidden, note=f"{b} x {t} tokens ({assumptions.scoring_batch})",
                      dtype=act),
            Component("layer activations (no grad)", "activations", int(layer), dtype=act),
        ],
        "actor log-probs": [
            Component("hidden states", "activations", hidden, note=f"{b} x {t} tokens", dtype=act),
            Component("log-prob chunk buffers", "logits", logprob_buffer_bytes(b, n, cfg, shape), dtype="fp32",
                      note=f"{b} x {min(cfg.ppo.logprob_chunk_size, n)} x {shape.vocab_size} x 4"),
            Component("scoring outputs", "buffers", outputs, dtype="fp32"),
        ],
    }
    if any(rc.backend == "adapter" for _, rc in cfg.reward.all_rewards()):
        m = cfg.ppo.micro_batch_size  # the adapter reward scores micro-batches, prompt + response unpadded
        moments["reward forward (adapter)"] = [
            Component("hidden states", "activations", m * t * shape.hidden_size * a, note=f"{m} x {t} tokens",
                      dtype=act),
            Component("layer activations (no grad)", "activations",
                      int(m * t * forward_layer_transient_per_token(shape, a, c, lora_on_mlp(cfg.rm.lora, shape))
                          + m * t * t * a), dtype=act),
        ]
    if cfg.quant.load_in_4bit:
        for name in moments:
            if name != "actor log-probs":
                moments[name].append(Component("dequantized weight", "activations", dequantized_bytes(cfg, shape, c),
                                               dtype=compute, note=_dequant_note(shape)))
    moments.update(critic_scoring_moments(cfg, assumptions))  # critic.model: its forward on its own base
    for comps in moments.values():
        comps.extend(held_gradients(cfg, shape, assumptions))
    return _largest(moments)


def update_phase(cfg, shape, assumptions) -> tuple[str, list[Component]]:
    c, a, _ = dtype_bytes(cfg, assumptions)
    compute, act = dtype_names(cfg)
    m = cfg.ppo.micro_batch_size
    p, n, t = lengths(cfg)
    tokens = m * t
    shared = cfg.has_critic and not cfg.critic.model  # a critic of its own saves its own activations
    r = max(cfg.actor.lora.r, cfg.critic.lora.r) if shared else cfg.actor.lora.r
    per_layer = layer_saved_bytes_per_token(shape, a, t, r, cfg.actor.lora.target_modules,
                                            lora_on_mlp(cfg.actor.lora, shape))
    h, i = shape.hidden_size, shape.intermediate_size
    mixed = act if a == 4 else f"{act}; norm inputs and LoRA inputs fp32"
    saved, layer_moments = update_saved(cfg, shape, m, t, per_layer, a, act, mixed)  # every-N, offload
    kept = shape.num_layers - cfg.training.checkpointed_layers(shape.num_layers)
    kept_scores = layer_scores = None
    if assumptions.attention == "eager":  # each layer not checkpointed keeps its scores; a recomputed one makes them
        scores = 2 * m * shape.num_heads * t * t * a
        kept_scores = Component("attention scores", "activations", kept * scores, dtype=act) if kept else None
        layer_scores = Component("attention scores", "activations", (kept + (kept < shape.num_layers)) * scores,
                                 dtype=act)
    bwd_per_token = moe_backward_per_token(shape, a) if shape.is_moe else (2 * i + 2 * h) * a
    bwd = Component("backward transients", "activations", int(tokens * bwd_per_token), dtype=act,
                    note="grads of one layer's MLP" + (" (its routed tokens')" if shape.is_moe else ""))
    grads = trainable_grad_bytes(cfg, shape)
    grad = Component("LoRA + value head grads" if cfg.has_critic else "LoRA grads", "gradients", grads,
                     note="accumulated over the mini-batch", dtype="fp32")
    lp = Component("log-prob chunk buffers", "logits", logprob_buffer_bytes(m, n, cfg, shape), dtype="fp32",
                   note=f"{m} x {min(cfg.ppo.logprob_chunk_size, n)} x {shape.vocab_size} x 4, recomputed per chunk")
    loss = Component("PPO loss tensors", "buffers", m * n * 4 * 12, dtype="fp32")
    moments = {"actor loss backward": [grad, *saved, lp, loss] + ([kept_scores] if kept_scores else [])}
    for name, alive in layer_moments.items():
        moments[name] = [grad, *alive, bwd] + ([layer_scores] if layer_scores else [])
    if cfg.quant.load_in_4bit:
        dq = Component("dequantized weight", "activations", dequantized_bytes(cfg, shape, c), dtype=compute,
                       note=_dequant_note(shape))
        for comps in moments.values():
            comps.append(dq)
    moments.update(critic_update_moments(cfg, assumptions, grad))  # critic.model: its own base, after the actor
    return _largest(moments)


def _dequant_note(shape) -> str:
    if shape.is_moe:
        return "the largest linear, or a chunk of experts (quant.expert_chunk_mib): the larger"
    return "largest linear, a copy per matmul"


def _largest(moments: dict[str, list[Component]]) -> tuple[str, list[Component]]:
    name = max(moments, key=lambda k: sum(x.bytes for x in moments[k]))
    return name, moments[name]



# What each phase's transient memory is, in the order a PPO iteration runs them.
PHASE_BUILDERS = {"generation": generation_phase, "scoring": scoring_phase, "update": update_phase}
