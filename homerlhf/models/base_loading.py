"""Loading the shared base: the compute dtype, the 4-bit quantization config, LoRA configs, the tokenizer,
the frozen base itself and the checks on its logits path. Below both :mod:`homerlhf.models.policy` (the
actor, its critic and value head on this base) and :mod:`homerlhf.models.critic_model` (a critic on a base
of its own), which each load a base through these."""

from __future__ import annotations

from typing import Optional

import torch

from homerlhf.config.schema import LoraConfig, QuantConfig, RunConfig
from homerlhf.errors import UserError
from homerlhf.models import cuda_kernels
from homerlhf.models.generation import checkpoint_defaults_off
from homerlhf.models.lm_head import install_fp32_logits
from homerlhf.models.logprobs import output_logit_transform
from homerlhf.models.precision import prepare_frozen_base

ACTOR = "actor"

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def compute_dtype(quant: QuantConfig, device: str) -> torch.dtype:
    """``auto`` is bf16 on CUDA (fp16 on cards without bf16, e.g. T4) and fp32 on CPU (bf16 matmuls
    are slow there)."""
    if quant.compute_dtype == "auto":
        if device != "cuda":
            return torch.float32
        return torch.bfloat16 if not torch.cuda.is_available() or torch.cuda.is_bf16_supported() else torch.float16
    return _DTYPES[quant.compute_dtype]


def kernels_for(cfg: RunConfig, device: torch.device) -> cuda_kernels.KernelSettings:
    """Set the TF32 and SDPA flags of a policy of ``cfg`` on ``device`` (:mod:`homerlhf.models.cuda_kernels`)."""
    upcast = cfg.quant.load_in_4bit and cfg.quant.upcast_non_quantized
    return cuda_kernels.set_for_policy(compute_dtype(cfg.quant, cfg.card.device), upcast, device)


def quantization_config(quant: QuantConfig, device: str, storage: torch.dtype = torch.uint8):
    """The bitsandbytes 4-bit config, or None when ``quant.load_in_4bit`` is off. ``storage``: the
    dtype the 4-bit codes are stored in (the compute dtype for FSDP: :mod:`homerlhf.models.sharding`)."""
    if not quant.load_in_4bit:
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant.quant_type,
        bnb_4bit_use_double_quant=quant.double_quant,
        bnb_4bit_compute_dtype=compute_dtype(quant, device),
        bnb_4bit_quant_storage=storage,
    )


def peft_lora_config(lora: LoraConfig, task_type: str = "CAUSAL_LM", layout=None):
    """peft's LoraConfig from a ``LoraConfig`` section; ``SEQ_CLS`` also trains the score head in full.
    ``layout``: the base's experts layout (:func:`moe_layout`) for a mixture of experts: the targets
    are named per :func:`homerlhf.models.expert_lora.lora_targets`, 4-bit experts wrapped by its wrapper."""
    from peft import LoraConfig as PeftLoraConfig

    if layout is None:
        if lora.experts:
            raise UserError("lora.experts is set but the model has no experts; unset it for a dense model")
        targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
        return PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                              bias="none", task_type=task_type)
    from homerlhf.models.expert_lora import lora_targets, register_experts

    config = PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                            task_type=task_type, **lora_targets(lora, layout))
    register_experts(config)
    return config


def load_tokenizer(model_path: str, *, trust_remote_code: bool = False, revision: Optional[str] = None,
                   padding_side: Optional[str] = "left"):
    """The model's tokenizer with a pad token (eos when the model has none).

    ``padding_side``: "left" for generation (the policy); None keeps the tokenizer's own (TRL's
    trainers pad as the tokenizer says).
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code, revision=revision)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"cannot load a tokenizer from '{model_path}': {str(exc).strip().splitlines()[0][:200]} "
            "(give a local HF model dir, a cached hub id, or builtin:<name>)"
        ) from None
    if tokenizer.pad_token_id is None:  # many base models ship without one; eos is the usual stand-in
        tokenizer.pad_token = tokenizer.eos_token
    if padding_side is not None:
        tokenizer.padding_side = padding_side
    return tokenizer


def moe_layout(model_path: str, cfg: RunConfig):
    """The experts layout of ``model_path``'s config (None for a dense model), or a UserError for an
    MoE homerlhf does not know: read from the config alone, before any weight."""
    from transformers import AutoConfig

    from homerlhf.models.moe import check_moe

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code,
                                            revision=cfg.model.revision)
    except (OSError, ValueError):  # said by from_pretrained, with its own message
        return None
    return check_moe(config.to_dict(), model_path)


def load_base(model_path: str, cfg: RunConfig):
    """The causal LM in 4-bit (or full precision when ``quant.load_in_4bit`` is off), frozen. A mixture
    of experts has its fused experts in 4-bit too (:mod:`homerlhf.models.moe`); its router's load-balancing
    loss stays off (``output_router_logits``)."""
    from transformers import AutoModelForCausalLM

    from homerlhf.models.moe import experts_in_4bit

    device = cfg.card.device
    dtype = compute_dtype(cfg.quant, device)
    layout = moe_layout(model_path, cfg)
    try:
        with experts_in_4bit(layout if cfg.quant.load_in_4bit else None, cfg.quant.expert_chunk_mib):
            model = AutoModelForCausalLM.from_pretrained(
                model_path,
                quantization_config=quantization_config(cfg.quant, device),
                device_map={"": torch.cuda.current_device()} if device == "cuda" else "cpu",  # a rank's own GPU
                dtype=dtype,
                trust_remote_code=cfg.model.trust_remote_code,
                revision=cfg.model.revision,
            )
    except OSError as exc:
        raise UserError(
            f"cannot load model '{model_path}': {str(exc).splitlines()[0]} "
            "(give a local HF model dir, a cached hub id, or builtin:<name>)"
        ) from None
    for param in model.parameters():
        param.requires_grad_(False)
    if layout is not None:
        model.config.output_router_logits = False
    keep_cpu_4bit_differentiable(model)
    return model


def keep_cpu_4bit_differentiable(model) -> None:
    """Stop bitsandbytes from repacking CPU 4-bit weights for inference.

    On a CPU with AVX512-BF16, a ``Linear4bit`` forward in eval mode without grad repacks its weight
    into a layout served by ``gemv_4bit``, for good. That op has no autograd formula, so a later
    training forward would silently drop the gradient through the frozen base into earlier LoRA
    layers. We alternate rollout (eval) and update (train), so the repacking must never happen.
    """
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:  # no bitsandbytes: nothing is 4-bit
        return
    for module in model.modules():
        if isinstance(module, Linear4bit) and hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


@torch.no_grad()
def check_logits_path(causal_lm, where: str) -> None:
    """The chunked log-probs compute ``output_logit_transform(lm_head(final hidden state))``: refuse a
    model whose own forward does something else to its logits, on a probe of 8 tokens."""
    ids = torch.arange(8, device=causal_lm.device).unsqueeze(0) % causal_lm.config.get_text_config().vocab_size
    backbone = getattr(causal_lm, causal_lm.base_model_prefix)
    ours = causal_lm.get_output_embeddings()(backbone(input_ids=ids).last_hidden_state).float()
    transform = output_logit_transform(causal_lm.config)
    if transform is not None:
        ours = transform(ours)
    theirs = causal_lm(input_ids=ids).logits.float()
    gap = (ours - theirs).abs().max().item()
    if not gap <= 1e-3 * (1.0 + theirs.abs().max().item()):
        raise UserError(f"{where}: architecture {causal_lm.config.model_type!r} computes its logits beyond the LM head "
                        f"of the last hidden state (probe differs by {gap:.3g}); homerlhf's log-probs cannot follow it")
