"""Phi-3: llama.cpp's ``phi3`` graph.

The fused ``qkv_proj`` and ``gate_up_proj`` are written as they are (``attn_qkv``, ``ffn_up``:
llama.cpp splits them the way HF does). Long-context "longrope" scaling becomes the
``rope_factors_long`` / ``rope_factors_short`` tensors and an attention factor, as llama.cpp's own
converter writes them. llama.cpp's phi3 graph ignores the sliding window, so a Phi-3 with one
is exact only for sequences within it.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from homerlhf.errors import UserError
from homerlhf.workers.gguf.family import ArchFamily
from homerlhf.workers.gguf.rope import rope_parameters
from homerlhf.workers.gguf.tensors import LazyTensor

LONGROPE = ("longrope", "su")


class Phi3Family(ArchFamily):
    gguf_arch = "phi3"
    rope_types = ("default", *LONGROPE)

    def exact_context(self, config: dict) -> Optional[int]:
        window = config.get("sliding_window")
        return int(window) if window else None

    def check(self, config: dict, where: str) -> None:
        super().check(config, where)
        if config.get("hidden_act", "silu") != "silu":
            raise UserError(f"{where}: activation {config.get('hidden_act')!r} is not supported for GGUF export "
                            "of phi3; supported: silu")

    def rope_dims(self, config: dict) -> int:
        rope = rope_parameters(config)
        fraction = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        return int(fraction * int(config["hidden_size"])) // int(config["num_attention_heads"])

    def add_hparams(self, writer, config: dict, vocab_size: int, where: str) -> dict[str, LazyTensor]:
        self.add_common_hparams(writer, config, vocab_size)
        rope = rope_parameters(config)
        writer.add_rope_dimension_count(self.rope_dims(config))
        writer.add_rope_freq_base(rope["rope_theta"])
        original = rope.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
        writer.add_rope_scaling_orig_ctx_len(int(original or config.get("max_position_embeddings", 4096)))
        writer.add_sliding_window(int(config.get("sliding_window") or 0))
        if rope["rope_type"] not in LONGROPE:
            return {}
        return self._longrope(writer, config, rope, int(original), where)

    def _longrope(self, writer, config: dict, rope: dict, original: int, where: str) -> dict[str, LazyTensor]:
        """Long/short factors (one per rotary frequency) and the attention factor of the long context."""
        long, short = rope.get("long_factor"), rope.get("short_factor")
        half = self.rope_dims(config) // 2
        if not long or not short or len(long) != half or len(short) != half:
            raise UserError(f"{where}: longrope needs long_factor and short_factor of {half} values each")
        scale = int(config["max_position_embeddings"]) / original
        factor = rope.get("attention_factor")
        if factor is None:
            factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        writer.add_rope_scaling_attn_factors(float(factor))
        return {"rope_factors_long.weight": LazyTensor.of(np.asarray(long)),
                "rope_factors_short.weight": LazyTensor.of(np.asarray(short))}
