"""Llama and Mistral: llama.cpp's ``llama`` graph.

HF applies rotary embeddings rotate-half style, llama.cpp's ``llama`` graph interleaved: q/k rows
are permuted. Llama 3.x rope scaling (``rope_type: llama3``) becomes the ``rope_freqs`` tensor.
The graph has no sliding window, so a Mistral with one is exact only for sequences within it.
"""

from __future__ import annotations

import re
from typing import Optional

import numpy as np

from homerlhf.workers.gguf.family import ArchFamily, head_dim, n_kv_heads
from homerlhf.workers.gguf.rope import llama3_rope_factors, rope_parameters
from homerlhf.workers.gguf.tensors import LazyTensor

_QK = re.compile(r"self_attn\.([qk])_proj\.")


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half q/k rows -> llama.cpp interleaved rope order. Shape: (n_head * head_dim, ...)."""
    shape = weight.shape
    return weight.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


class LlamaFamily(ArchFamily):
    gguf_arch = "llama"
    rope_types = ("default", "linear", "yarn", "llama3")

    def exact_context(self, config: dict) -> Optional[int]:
        window = config.get("sliding_window")
        return int(window) if window else None

    def add_hparams(self, writer, config: dict, vocab_size: int, where: str) -> dict[str, LazyTensor]:
        extra = super().add_hparams(writer, config, vocab_size, where)
        writer.add_rope_dimension_count(head_dim(config))
        rope = rope_parameters(config)
        if rope["rope_type"] == "llama3":
            extra["rope_freqs.weight"] = LazyTensor.of(llama3_rope_factors(rope, head_dim(config)))
        return extra

    def convert(self, hf_name: str, tensor: LazyTensor, config: dict) -> LazyTensor:
        match = _QK.search(hf_name)
        if not match:
            return tensor
        heads = int(config["num_attention_heads"]) if match.group(1) == "q" else n_kv_heads(config)
        return tensor.then(lambda w: permute_qk(w, heads))
