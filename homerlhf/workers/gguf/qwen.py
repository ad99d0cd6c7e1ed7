"""Qwen2 and Qwen3: llama.cpp's ``qwen2`` / ``qwen3`` graphs (rotate-half rope: no permutation).

Qwen3 adds per-head q/k RMSNorms and a head size that need not be hidden / heads. A Qwen2 with
``use_sliding_window`` is exact only within the window (llama.cpp's graph has none).
"""

from __future__ import annotations

from typing import Optional

from homerlhf.workers.gguf.family import ArchFamily


class Qwen2Family(ArchFamily):
    gguf_arch = "qwen2"
    tokenizer_pre = "qwen2"

    def exact_context(self, config: dict) -> Optional[int]:
        window = config.get("sliding_window")
        return int(window) if config.get("use_sliding_window") and window else None


class Qwen3Family(Qwen2Family):
    gguf_arch = "qwen3"
    always_head_dims = True
