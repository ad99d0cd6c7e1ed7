"""GGUF export of the reference and reward models for the llama.cpp workers.

llama.cpp's own converter is not shipped in any wheel and does not take ``*ForSequenceClassification``
checkpoints, so the GGUF is written here with ``gguf.GGUFWriter`` and gguf's own tensor-name maps.

- :mod:`.export`: ``export_ref`` / ``export_reward``, the public API;
- :mod:`.registry`: HF ``model_type`` -> architecture family, one module per family
  (:mod:`.llama`, :mod:`.qwen`, :mod:`.gemma`, :mod:`.phi3`) on :mod:`.family`;
- :mod:`.writer` (one GGUF, streamed), :mod:`.tokenizer`, :mod:`.quant`, :mod:`.tensors`, :mod:`.rope`.
"""

from homerlhf.workers.gguf.export import FORMAT_VERSION, export_ref, export_reward, reward_model_dir
from homerlhf.workers.gguf.llama import permute_qk
from homerlhf.workers.gguf.quant import OUTTYPES
from homerlhf.workers.gguf.registry import SUPPORTED_ARCHS, family_for
from homerlhf.workers.gguf.tensors import checkpoint_tensors, nf4_tensors

__all__ = [
    "FORMAT_VERSION", "OUTTYPES", "SUPPORTED_ARCHS", "checkpoint_tensors", "export_ref", "export_reward",
    "family_for", "nf4_tensors", "permute_qk", "reward_model_dir",
]
