"""One registry: HF ``model_type`` -> the family that exports it to llama.cpp.

Every entry is verified the same way (tests/workers/test_export_archs.py): a tiny random-init
model of that architecture, exported F32, served by the real worker with an F32 KV cache, gives
HF's log-probs and reward scores within 1e-3.
"""

from __future__ import annotations

from homerlhf.errors import UserError
from homerlhf.workers.gguf.family import ArchFamily
from homerlhf.workers.gguf.gemma import Gemma2Family, Gemma3Family
from homerlhf.workers.gguf.llama import LlamaFamily
from homerlhf.workers.gguf.moe import Qwen3MoeFamily
from homerlhf.workers.gguf.phi3 import Phi3Family
from homerlhf.workers.gguf.qwen import Qwen2Family, Qwen3Family

FAMILIES: dict[str, ArchFamily] = {
    "gemma2": Gemma2Family(),
    "gemma3_text": Gemma3Family(),
    "llama": LlamaFamily(),
    "mistral": LlamaFamily(),
    "phi3": Phi3Family(),
    "qwen2": Qwen2Family(),
    "qwen3": Qwen3Family(),
    "qwen3_moe": Qwen3MoeFamily(),
}
SUPPORTED_ARCHS = tuple(FAMILIES)


def unsupported_message(model_type: str) -> str:
    return f"architecture {model_type!r} is not supported for GGUF export; supported: {', '.join(SUPPORTED_ARCHS)}"


def family_for(config: dict, where: str) -> ArchFamily:
    """The family exporting ``config`` (a parsed config.json), after its variant checks."""
    model_type = str(config.get("model_type", "?"))
    family = FAMILIES.get(model_type)
    if family is None:
        raise UserError(f"{where}: {unsupported_message(model_type)}")
    family.check(config, str(where))
    return family
