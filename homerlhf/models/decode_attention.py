"""Attention for a one-token query against a static cache without repeating K/V to every query head.

With a static cache and a one-token query transformers always builds the mask, and in 5.17 (the GPU
machine's) its sdpa path then repeats K and V to all query heads: every layer of every decode step
copies the whole cache ``num_attention_heads / num_key_value_heads`` times (for a 7B at chunk 32, more
bytes per step than the weights). For one query token the exact alternative folds each KV head's query
group into the query axis, (B, H, 1, D) -> (B, H_kv, H / H_kv, D), and attends to the cache once
(transformers 5.24 does the same, ``pack_gqa``). :func:`folded_decode_attention` switches a model on
``sdpa`` to :func:`folded_sdpa_attention` while the static loop runs.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

NAME = "homerlhf_sdpa_folded"  # the attention implementation name while the static loop runs
_FOLD_DEVICES = ("cuda", "cpu")  # HF's sdpa has device-specific workarounds elsewhere (mps, npu): kept


def folded_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                          is_causal=None, **kwargs):
    """HF's attention-function signature: query (B, H, q, D), key/value (B, H_kv, L, D), mask
    (B, 1, q, L) bool or additive, or None. Returns (attention output (B, q, H, D), None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_len, _ = query.shape
    per_head_mask = attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[1] != 1)
    if q_len != 1 or groups == 1 or per_head_mask or query.device.type not in _FOLD_DEVICES:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    folded = query.reshape(batch, heads // groups, groups, query.shape[-1])  # (B, H_kv, H / H_kv, D)
    # The folded axis holds one token's queries, not positions: never causal. The mask broadcasts.
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, is_causal=False)
    return out.reshape(batch, heads, 1, out.shape[-1]).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, folded_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def _configs(config) -> list:
    """The config and its sub-configs (a multimodal model's text config), each once."""
    out = [config]
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and all(sub is not c for c in out):
            out.append(sub)
    return out


@contextmanager
def folded_decode_attention(causal_lm) -> Iterator[bool]:
    """Within the block, every (sub-)config of ``causal_lm`` on ``sdpa`` uses :data:`NAME`; yields
    whether any did (eager and other implementations are left as they are).

    It is registered with transformers' ``AttentionInterface`` and, with HF's own sdpa mask builder,
    its ``AttentionMaskInterface`` (so the masks, sliding windows included, are HF's), and falls back to
    HF's ``sdpa_attention_forward`` for anything but a one-token query of a GQA layer: another thread's
    forward on the same model meanwhile (a prefill, a scoring pass) computes as on sdpa."""
    configs = [c for c in _configs(causal_lm.config) if getattr(c, "_attn_implementation_internal", None) == "sdpa"]
    if configs:
        _register()
    for config in configs:
        config._attn_implementation_internal = NAME
    try:
        yield bool(configs)
    finally:
        for config in configs:
            config._attn_implementation_internal = "sdpa"
