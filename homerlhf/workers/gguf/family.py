"""What every architecture family shares: the common hyperparameters and the tensor-name mapping.

A family says how HF checkpoints of some ``model_type`` become a llama.cpp GGUF: its GGUF
architecture, the variants it refuses (:meth:`ArchFamily.check`), its extra hyperparameters and
tensors (:meth:`ArchFamily.add_hparams`) and how a tensor's values change on the way
(:meth:`ArchFamily.convert`). Families register in :mod:`homerlhf.workers.gguf.registry`.
"""

from __future__ import annotations

from typing import Optional

from homerlhf.errors import UserError
from homerlhf.workers.gguf.rope import add_rope_scaling, rope_parameters
from homerlhf.workers.gguf.tensors import LazyTensor


def head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def n_kv_heads(config: dict) -> int:
    return int(config.get("num_key_value_heads") or config["num_attention_heads"])


class ArchFamily:
    """A HF architecture family exported as llama.cpp architecture ``gguf_arch``."""

    gguf_arch: str = ""
    tokenizer_pre: str = "default"  # informational: workers never tokenize text
    rope_types: tuple[str, ...] = ("default", "linear", "yarn")
    always_head_dims: bool = False  # write key/value length even when it is hidden / heads

    def check(self, config: dict, where: str) -> None:
        """Raises a UserError for a variant this family cannot write faithfully."""
        rope = rope_parameters(config)
        if rope["rope_type"] not in self.rope_types:
            raise UserError(f"{where}: rope scaling {rope['rope_type']!r} is not supported for GGUF export of "
                            f"{config.get('model_type')}; supported: {', '.join(self.rope_types)}")

    def exact_context(self, config: dict) -> Optional[int]:
        """The longest sequence llama.cpp computes as HF does (a sliding window it does not apply), or None."""
        return None

    def add_hparams(self, writer, config: dict, vocab_size: int, where: str) -> dict[str, LazyTensor]:
        """Writes the hyperparameters; returns extra tensors (GGUF name -> tensor) the graph needs."""
        self.add_common_hparams(writer, config, vocab_size)
        rope = rope_parameters(config)
        writer.add_rope_freq_base(rope["rope_theta"])
        add_rope_scaling(writer, rope, self.rope_types, where)
        return {}

    def add_common_hparams(self, writer, config: dict, vocab_size: int) -> None:
        hidden, n_head = int(config["hidden_size"]), int(config["num_attention_heads"])
        writer.add_context_length(int(config.get("max_position_embeddings", 4096)))
        writer.add_embedding_length(hidden)
        writer.add_block_count(int(config["num_hidden_layers"]))
        writer.add_feed_forward_length(int(config["intermediate_size"]))
        writer.add_head_count(n_head)
        writer.add_head_count_kv(n_kv_heads(config))
        writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
        writer.add_vocab_size(vocab_size)
        if self.always_head_dims or head_dim(config) != hidden // n_head:
            writer.add_key_length(head_dim(config))
            writer.add_value_length(head_dim(config))

    def skip(self, hf_name: str, config: dict) -> bool:
        """Checkpoint tensors the GGUF leaves out (the tied LM head, rotary caches)."""
        tied = bool(config.get("tie_word_embeddings", False))
        return hf_name.endswith("rotary_emb.inv_freq") or (tied and hf_name == "lm_head.weight")

    def convert(self, hf_name: str, tensor: LazyTensor, config: dict) -> LazyTensor:
        """The tensor as llama.cpp's graph expects it (default: unchanged)."""
        return tensor

    def map_tensors(self, tensors: dict[str, LazyTensor], config: dict,
                    skip=lambda name: False) -> dict[str, LazyTensor]:
        """HF names -> GGUF names, each tensor converted lazily."""
        import gguf

        arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == self.gguf_arch)
        name_map = gguf.get_tensor_name_map(arch_enum, int(config["num_hidden_layers"]))
        out: dict[str, LazyTensor] = {}
        for hf_name, tensor in tensors.items():
            if skip(hf_name) or self.skip(hf_name, config):
                continue
            name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise UserError(f"tensor {hf_name!r} has no GGUF name for architecture {self.gguf_arch}; "
                                f"the checkpoint is not a plain {config.get('model_type')} model")
            out[name] = self.convert(hf_name, tensor, config)
        return out
