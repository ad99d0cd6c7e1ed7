"""Which models the static decode loop can run (:func:`refusal`), and why not the others.

The loop needs transformers' self-positioning ``StaticLayer`` (>= 5.0), an attention implementation
whose mask HF builds inside the forward from the 2D mask (sdpa, eager), full or sliding-window layers
only, a forward that takes the cache, ``position_ids`` and ``logits_to_keep``, and a decode step a CUDA
graph can capture: no rotary embedding that branches on a device value (a host sync, and a graph would
freeze the branch taken at capture), no 4-bit experts (their routing is read on the host).
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from homerlhf.models.host_sync import HostSync, NoHostSync

_ATTENTION = ("sdpa", "eager")  # implementations whose masks HF builds from the 2D mask inside the forward
_LAYER_TYPES = {"full_attention", "sliding_attention"}


def cache_keyword(causal_lm) -> Optional[str]:
    """The name the model's forward takes its cache by (transformers renamed it: ``past_key_values``
    up to 5.2x, ``cache`` after), or None."""
    params = inspect.signature(causal_lm.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def _rope_refusal(causal_lm) -> Optional[str]:
    """Why the model's rotary embedding cannot be captured, or None. A dynamic RoPE picks its
    frequencies with a Python branch on a device value every forward (a host sync, and a graph would
    freeze the branch taken at capture); transformers 5.17 branches the same way for long-RoPE
    (Phi-3-128k, Phi-3.5), 5.24 uses ``torch.where``: that is probed, not assumed."""
    for module in causal_lm.modules():
        kind = getattr(module, "rope_type", None)
        kinds = kind if isinstance(kind, dict) else {None: kind}
        for layer_type, rope in kinds.items():
            if not isinstance(rope, str):
                continue
            if "dynamic" in rope:
                return f"{rope!r} RoPE (its frequencies follow the sequence length through a host-side branch)"
            if rope == "longrope" and _rotary_syncs(module, layer_type):
                return ("'longrope' RoPE (this transformers version picks its short or long factors with a host-side "
                        "branch; later ones do not)")
    return None


@torch.no_grad()
def _rotary_syncs(rotary, layer_type) -> bool:
    """Whether one forward of the rotary embedding ``rotary`` makes a host sync."""
    device = next((b.device for b in rotary.buffers()), torch.device("cpu"))
    x, positions = torch.zeros(1, 1, 1, device=device), torch.zeros(1, 1, dtype=torch.long, device=device)
    try:
        with NoHostSync(None if device.type == "cpu" else device.type):
            rotary(x, positions, **({} if layer_type is None else {"layer_type": layer_type}))
    except HostSync:
        return True
    return False


def refusal(causal_lm) -> Optional[str]:
    """Why the static loop cannot run this model, or None when it can."""
    import transformers
    from transformers.cache_utils import StaticLayer

    if not hasattr(StaticLayer(max_cache_len=1), "cumulative_length"):
        return f"transformers {transformers.__version__} has no self-positioning static cache layer (needs >= 5.0)"
    config = causal_lm.config.get_text_config()
    if getattr(causal_lm.config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported"
    impl = getattr(causal_lm.config, "_attn_implementation", None)
    if impl not in _ATTENTION:
        return f"attention implementation {impl!r} (the static loop needs one of {', '.join(_ATTENTION)})"
    other = set(getattr(config, "layer_types", None) or ()) - _LAYER_TYPES
    if other:
        return f"layer types {sorted(other)} (the static loop has full and sliding-window attention only)"
    params = inspect.signature(causal_lm.forward).parameters
    if cache_keyword(causal_lm) is None or not {"position_ids", "logits_to_keep"} <= set(params):
        return f"{type(causal_lm).__name__}.forward takes no cache, position_ids or logits_to_keep"
    if any(type(m).__name__ == "Experts4bit" for m in causal_lm.modules()):
        return "4-bit experts (each step's routing picks the experts to dequantize on the host: no graph can hold it)"
    return _rope_refusal(causal_lm)
