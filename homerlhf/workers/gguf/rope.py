"""Rotary-embedding settings of a HF config, written the way llama.cpp reads them.

transformers 5 keeps them in ``rope_parameters`` (older configs: ``rope_scaling`` + ``rope_theta``);
Gemma 3 nests one set per layer kind (``full_attention``, ``sliding_attention``).
"""

from __future__ import annotations

import math

import numpy as np

from homerlhf.errors import UserError


def rope_parameters(config: dict, kind: str = "full_attention") -> dict:
    """The rope settings of ``kind`` layers, with ``rope_theta`` and ``rope_type`` always present."""
    raw = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if kind in raw or "full_attention" in raw:
        raw = dict(raw.get(kind) or raw.get("full_attention") or {})
    theta = raw.get("rope_theta", config.get("rope_theta", 10000.0))
    raw["rope_theta"] = float(theta)
    raw["rope_type"] = raw.get("rope_type") or raw.get("type") or "default"
    return raw


def add_rope_scaling(writer, rope: dict, supported: tuple[str, ...], where: str) -> None:
    """Writes linear / yarn scaling keys; other supported types are written by their family."""
    import gguf

    rope_type = rope["rope_type"]
    if rope_type not in supported:
        raise UserError(f"{where}: rope scaling {rope_type!r} is not supported for GGUF export of this "
                        f"architecture; supported: {', '.join(supported)}")
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif rope_type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """Per-frequency divisors of Llama 3.x rope scaling, as llama.cpp's ``rope_freqs`` tensor holds them.

    Shape: (head_dim / 2,). Wavelengths shorter than ``old_ctx / high_freq_factor`` keep their
    frequency (1), longer than ``old_ctx / low_freq_factor`` are divided by ``factor``, and the band
    between is interpolated smoothly (transformers' ``_compute_llama3_parameters``).
    """
    theta = rope["rope_theta"]
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)
