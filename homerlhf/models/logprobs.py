"""Log-probs of taken tokens (and the entropy of each next-token distribution), over sequence chunks.

Real vocabularies have 128k-256k entries: the fp32 logits of a (B, L, V) batch would dwarf the rest
of a step. We run the backbone once for hidden states, then apply the LM head and a log-softmax to
``chunk_size`` positions at a time. When gradients are on, each chunk is checkpointed so backward
recomputes its logits instead of keeping every chunk's logits alive until then.

Each chunk's logits go through what the sampler saw: the model's own post-processing of its LM head
output (:func:`output_logit_transform`, e.g. Gemma-2's final soft-capping), then the sampling
temperature. The log-probs are those of the distribution the rollout sampled from.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as generation assigns them.

    attention_mask: (B, L) 1 on real tokens. Returns (B, L) long; padded slots get 0 (ignored).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution given by ``logits``, ``-sum_v p_v log p_v``.

    Args:
        logits: ``[..., V]``; ``-inf`` entries (top-k / top-p filtered) count as probability 0.

    Returns: ``[...]``, in float32 for 16-bit logits (their softmax is too coarse), else in the
    logits' dtype. Feed it chunks of positions: it holds two copies of ``logits``.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    # p = 0 where logp = -inf; the clamp keeps 0 * -inf from turning into nan.
    logp = logp.clamp(min=torch.finfo(logp.dtype).min)
    return -(logp.exp() * logp).sum(dim=-1)


LogitTransform = Callable[[Tensor], Tensor]


def output_logit_transform(config) -> Optional[LogitTransform]:
    """What the model's ``*ForCausalLM.forward`` does to ``lm_head(hidden)`` before returning logits,
    as a function on fp32 logits; None when it returns them as they are (Llama, Qwen, Mistral, ...).

    Read from the (text) config as transformers applies it: ``final_logit_softcapping`` (Gemma-2,
    Gemma-3: ``tanh(logits / cap) * cap``), ``logit_scale`` (Cohere: ``logits * scale``),
    ``logits_scaling`` (Granite: ``logits / scaling``).
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None) if config.model_type.startswith("cohere") else None
    divisor = getattr(config, "logits_scaling", None) if config.model_type.startswith("granite") else None
    if cap is not None:
        return lambda logits: torch.tanh(logits / cap) * cap
    if scale is not None:
        return lambda logits: logits * scale
    if divisor is not None:
        return lambda logits: logits / divisor
    return None


def _chunk_logprobs(
    lm_head: Callable[[Tensor], Tensor],
    hidden: Tensor,
    targets: Tensor,
    temperature: float,
    transform: Optional[LogitTransform],
) -> tuple[Tensor, Tensor]:
    logits = lm_head(hidden).float()  # (B, c, V): the only full-vocab tensor, one chunk at a time
    if transform is not None:
        logits = transform(logits)
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # Entropy is a metric, never a loss term here: no graph for it.
    entropy = entropy_from_logits(logits.detach())
    return logprobs, entropy


def chunked_logprobs(
    lm_head: Callable[[Tensor], Tensor],
    hidden: Tensor,
    targets: Tensor,
    chunk_size: int,
    *,
    temperature: float = 1.0,
    transform: Optional[LogitTransform] = None,
) -> tuple[Tensor, Tensor]:
    """Log-prob and entropy of the next-token distribution at each position, chunk by chunk.

    hidden: (B, T, H) hidden states whose next-token prediction is ``targets``.
    targets: (B, T) long, the taken token at each position.
    temperature: the sampling temperature; the distribution is ``softmax(logits / temperature)``.
    transform: the model's own logit post-processing (:func:`output_logit_transform`), applied first.
    Returns ``(logprobs, entropy)``, both (B, T) fp32; equal to
    ``log_softmax(transform(lm_head(hidden)) / temperature).gather(targets)`` computed in one piece.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    logprobs, entropies = [], []
    grad = torch.is_grad_enabled() and hidden.requires_grad
    for start in range(0, hidden.shape[1], chunk_size):
        h = hidden[:, start : start + chunk_size]
        t = targets[:, start : start + chunk_size]
        if grad:
            lp, ent = checkpoint(_chunk_logprobs, lm_head, h, t, temperature, transform, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(lm_head, h, t, temperature, transform)
        logprobs.append(lp)
        entropies.append(ent)
    return torch.cat(logprobs, dim=1), torch.cat(entropies, dim=1)


def response_hidden(hidden: Tensor, response_len: int) -> Tensor:
    """The hidden states that predict the response tokens.

    hidden: (B, P + T, H) for a left-padded prompt followed by a right-padded response of length T.
    Position ``P + t - 1`` predicts response token ``t``. Returns (B, T, H).
    """
    total = hidden.shape[1]
    return hidden[:, total - response_len - 1 : total - 1]

