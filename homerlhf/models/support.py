"""Which architectures the in-process models can load, decided from ``config.json`` alone.

The policy is ``AutoModelForCausalLM`` (4-bit base + LoRA), an in-process reward model
``AutoModelForSequenceClassification``: an architecture needs that class in transformers itself.
A checkpoint that brings its own modeling code (``auto_map``, e.g. InternLM2) runs only with
``model.trust_remote_code`` on, and then untested. A mixture of experts needs a layout
:mod:`homerlhf.models.moe` knows.
"""

from __future__ import annotations

from typing import Literal

from homerlhf.errors import UserError

Kind = Literal["causal-lm", "sequence-classifier"]


def _mapping(kind: Kind) -> dict:
    from transformers.models.auto import modeling_auto

    if kind == "causal-lm":
        return modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES


def check_loadable(config: dict, where: str, kind: Kind, trust_remote_code: bool = False) -> None:
    """A UserError unless transformers can load ``config``'s architecture as ``kind``."""
    import transformers

    from homerlhf.models.moe import check_moe

    model_type = str(config.get("model_type", "?"))
    if model_type in _mapping(kind):
        check_moe(config, where)  # a mixture of experts: a layout homerlhf knows
        return
    auto = "AutoModelForCausalLM" if kind == "causal-lm" else "AutoModelForSequenceClassification"
    remote = auto in (config.get("auto_map") or {})
    if remote and trust_remote_code:
        return
    what = "policy (a causal LM)" if kind == "causal-lm" else "in-process reward model (a sequence classifier)"
    if remote:
        raise UserError(
            f"{where}: architecture {model_type!r} is not in transformers {transformers.__version__}; its checkpoint "
            f"brings its own code, which runs only with model.trust_remote_code=true (untested); or choose a model "
            "transformers ships, e.g. llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3")
    raise UserError(
        f"{where}: architecture {model_type!r} cannot be the {what}: transformers {transformers.__version__} has no "
        f"{auto} for it; choose a decoder-only model, e.g. llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3")
