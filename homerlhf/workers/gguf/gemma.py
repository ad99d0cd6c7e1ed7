"""Gemma 2 and Gemma 3 (text): llama.cpp's ``gemma2`` / ``gemma3`` graphs.

What differs from Llama, and how the export carries it (as llama.cpp's own converter does):

- RMSNorm: HF computes ``norm(x) * (1 + w)``, llama.cpp ``norm(x) * w``: every norm weight is
  written as ``1 + w``.
- Embeddings are scaled by sqrt(hidden) and the final logits soft-capped (``cap * tanh(x / cap)``):
  both are in llama.cpp's graph; the caps are written. Gemma 2 also soft-caps attention scores.
- Sliding-window layers: the window and, per layer, whether it slides (HF ``layer_types``) are
  written; Gemma 3's sliding layers have their own rope base.
- The query scale: HF uses ``query_pre_attn_scalar ** -0.5``; llama.cpp hard-codes
  1/sqrt(head_dim), or 1/sqrt(hidden / heads) for a model it recognises as the 27B by its layer
  count. Any ratio between the two is folded into the weights (Gemma 3: the q-norm weight;
  Gemma 2: the q projection), so the product is HF's.
"""

from __future__ import annotations

import math

from homerlhf.errors import UserError
from homerlhf.workers.gguf.family import ArchFamily, head_dim
from homerlhf.workers.gguf.rope import add_rope_scaling, rope_parameters
from homerlhf.workers.gguf.tensors import LazyTensor

# A cap so large that cap * tanh(x / cap) == x in float32 for any logit: llama.cpp's Gemma 2 graph
# always soft-caps, so a config without a cap gets this one.
NO_CAP = 1.0e6
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


class _Gemma(ArchFamily):
    always_head_dims = True
    layers_of_27b = 0  # the layer count llama.cpp reads as the 27B model
    default_pattern = 2  # every n-th layer is global when the config has no layer_types

    def check(self, config: dict, where: str) -> None:
        super().check(config, where)
        act = config.get("hidden_activation") or config.get("hidden_act")
        if act not in GELU_TANH:
            raise UserError(f"{where}: activation {act!r} is not supported for GGUF export of {config.get('model_type')} "
                            f"(llama.cpp computes GELU with the tanh approximation); supported: {', '.join(GELU_TANH)}")

    def sliding_layers(self, config: dict) -> list[bool]:
        """Per layer: does it attend within the sliding window?"""
        types = config.get("layer_types")
        if types:
            return [t == "sliding_attention" for t in types]
        pattern = int(config.get("sliding_window_pattern") or self.default_pattern)
        return [(i + 1) % pattern != 0 for i in range(int(config["num_hidden_layers"]))]

    def query_correction(self, config: dict) -> float:
        """HF's query scale over llama.cpp's: the factor folded into the weights (1 when equal)."""
        hidden, n_head = int(config["hidden_size"]), int(config["num_attention_heads"])
        scalar = float(config.get("query_pre_attn_scalar") or head_dim(config))
        llama_cpp = hidden // n_head if int(config["num_hidden_layers"]) == self.layers_of_27b else head_dim(config)
        return math.sqrt(llama_cpp / scalar)

    def add_window(self, writer, config: dict) -> None:
        window = config.get("sliding_window")
        layers = self.sliding_layers(config)
        writer.add_sliding_window(int(window) if window else 2**30)
        writer.add_sliding_window_pattern(layers if window else [False] * len(layers))

    def convert(self, hf_name: str, tensor: LazyTensor, config: dict) -> LazyTensor:
        if hf_name.endswith("norm.weight"):
            tensor = tensor.then(lambda w: w + 1.0)
        scale = self.query_correction(config)
        if scale != 1.0 and self.query_scaled(hf_name):
            tensor = tensor.then(lambda w: w * scale)
        return tensor

    def query_scaled(self, hf_name: str) -> bool:
        raise NotImplementedError


class Gemma2Family(_Gemma):
    gguf_arch = "gemma2"
    rope_types = ("default",)
    layers_of_27b = 46

    def check(self, config: dict, where: str) -> None:
        super().check(config, where)
        if not config.get("tie_word_embeddings", True):
            raise UserError(f"{where}: a Gemma 2 with its own lm_head (tie_word_embeddings false) is not supported for "
                            "GGUF export; llama.cpp's gemma2 graph always uses the embedding as the output layer")

    def add_hparams(self, writer, config: dict, vocab_size: int, where: str) -> dict[str, LazyTensor]:
        extra = super().add_hparams(writer, config, vocab_size, where)
        writer.add_attn_logit_softcapping(float(config.get("attn_logit_softcapping") or NO_CAP))
        writer.add_final_logit_softcapping(float(config.get("final_logit_softcapping") or NO_CAP))
        self.add_window(writer, config)
        return extra

    def skip(self, hf_name: str, config: dict) -> bool:
        return super().skip(hf_name, config) or hf_name == "lm_head.weight"

    def query_scaled(self, hf_name: str) -> bool:
        # q = W x (+ b) is linear and rope is a rotation: scaling W and b scales q.
        return ".self_attn.q_proj." in hf_name


class Gemma3Family(_Gemma):
    gguf_arch = "gemma3"
    rope_types = ("default", "linear")
    layers_of_27b = 62
    default_pattern = 6

    def check(self, config: dict, where: str) -> None:
        super().check(config, where)
        if config.get("attn_logit_softcapping"):
            raise UserError(f"{where}: attention soft-capping is not in llama.cpp's gemma3 graph; "
                            "this checkpoint cannot be exported to GGUF")
        sliding = rope_parameters(config, "sliding_attention")
        if "sliding_attention" in (config.get("rope_parameters") or {}) and sliding["rope_type"] != "default":
            raise UserError(f"{where}: rope scaling {sliding['rope_type']!r} on sliding layers is not supported "
                            "for GGUF export; llama.cpp scales only the global layers")

    def add_hparams(self, writer, config: dict, vocab_size: int, where: str) -> dict[str, LazyTensor]:
        self.add_common_hparams(writer, config, vocab_size)
        full = rope_parameters(config, "full_attention")
        writer.add_rope_freq_base(full["rope_theta"])
        add_rope_scaling(writer, full, self.rope_types, where)
        if "sliding_attention" in (config.get("rope_parameters") or {}):
            writer.add_rope_freq_base_swa(rope_parameters(config, "sliding_attention")["rope_theta"])
        else:
            writer.add_rope_freq_base_swa(float(config.get("rope_local_base_freq", 10000.0)))
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
        self.add_window(writer, config)
        return {}

    def query_scaled(self, hf_name: str) -> bool:
        # Gemma 3 normalises q per head right after the projection: only the q-norm weight scales q.
        return hf_name.endswith(".self_attn.q_norm.weight")
