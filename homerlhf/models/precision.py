"""Mixed precision: which weights train in which dtype, and when the loss is scaled.

The *compute dtype* is what the frozen base computes in: bitsandbytes' 4-bit matmuls
(``quant.compute_dtype``) or a full-precision base's weights. It is bf16 on cards that have it,
fp16 on cards that do not (T4, Colab) and fp32 on the CPU. The rules:

- **fp16 compute:** every trainable weight is fp32, and a loss scaler (:func:`loss_scaler`) keeps small
  gradients from flushing to zero in the fp16 backward (fp16 cannot hold Adam's small updates).
- **bf16 compute:** no scaler. The SFT and reward stages keep TRL's QLoRA choice of bf16 trainable
  weights; PPO's are fp32.
- **fp32 compute (CPU):** everything fp32.

PPO's adapters and value head are fp32 under every compute dtype (:func:`adapters_to_fp32`); the rest
of a 4-bit base is :func:`prepare_frozen_base`'s; TF32 and the SDPA backends :mod:`homerlhf.models.cuda_kernels`'.
"""

from __future__ import annotations

from typing import Iterable

import torch


def trainable_dtype(compute: torch.dtype) -> torch.dtype:
    """The dtype trainable weights of a TRL stage are kept in under ``compute``: fp32 for fp16
    compute (grad scaler), the compute dtype otherwise."""
    return torch.float32 if compute == torch.float16 else compute


def cast_trainable(model, compute: torch.dtype, *, all_trainable: bool) -> list[str]:
    """Cast ``model``'s trainable floating-point weights for ``compute``; returns the names cast.

    ``all_trainable``: cast every trainable weight to :func:`trainable_dtype` (TRL casts a 4-bit
    model's trainable weights to bf16, which must follow the compute dtype); otherwise only fp16
    ones go up to fp32 and fp32 LoRA weights (peft's default) stay as they are.
    """
    target = trainable_dtype(compute)
    cast = []
    for name, param in model.named_parameters():
        if not (param.requires_grad and param.is_floating_point()) or param.dtype == target:
            continue
        if all_trainable or param.dtype == torch.float16:
            param.data = param.data.to(target)
            cast.append(name)
    return cast


def prepare_frozen_base(model, *, load_in_4bit: bool, upcast: bool, checkpointing):
    """The frozen base made ready for LoRA training, as peft's ``prepare_model_for_kbit_training`` does it
    (gradient checkpointing, non-reentrant, so no input-grad hook is needed), its fp32 upcast only with
    ``upcast`` (a 4-bit base; ``quant.upcast_non_quantized``): on, the embeddings, LM head, norms and
    biases are cast to fp32, and since a bitsandbytes ``Linear4bit`` returns its input's dtype, the
    residual stream, the KV cache and attention are fp32 too; off (the GPU presets), they stay in the
    compute dtype (HF's RMSNorm still computes in fp32 inside; the LM head returns fp32 logits,
    :mod:`homerlhf.models.lm_head`). A full-precision base keeps its dtype and
    gets the input-grad hook the checkpointed forward of a frozen embedding needs. Returns the model.

    ``checkpointing``: a bool (every decoder layer, or none), or the run's ``training`` section, whose
    ``checkpoint_every_n_layers`` and ``activation_offload`` choose the layers and where their inputs wait
    (:func:`homerlhf.models.activations.enable_checkpointing`; an unresolved ``auto``: every layer, no offload)."""
    from peft import prepare_model_for_kbit_training

    from homerlhf.models.activations import enable_checkpointing

    every_n, offload = 1, False
    if not isinstance(checkpointing, bool):
        every_n, offload, checkpointing = checkpointing.every_n, checkpointing.offload, checkpointing.gradient_checkpointing
    if load_in_4bit and upcast:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    else:
        for param in model.parameters():
            param.requires_grad_(False)
    if checkpointing:
        enable_checkpointing(model, every_n, offload)
        if not load_in_4bit:
            model.enable_input_require_grads()
    return model


def adapters_to_fp32(params: Iterable[torch.nn.Parameter]) -> None:
    """PPO's trainable weights in fp32 whatever the compute dtype (peft's ``autocast_adapter_dtype``
    already does this for LoRA; this makes it a rule rather than a default)."""
    for param in params:
        if param.dtype != torch.float32:
            param.data = param.data.float()


def trainer_precision_flags(compute: torch.dtype, on_cuda: bool) -> dict[str, bool]:
    """``bf16``/``fp16`` for HF ``TrainingArguments``: autocast in the compute dtype on CUDA, and a
    grad scaler with it for fp16. On the CPU both are off (accelerate runs no fp16 autocast there)."""
    return {"bf16": on_cuda and compute == torch.bfloat16, "fp16": on_cuda and compute == torch.float16}


def loss_scaler(compute: torch.dtype, device: str | torch.device) -> torch.amp.GradScaler:
    """A ``GradScaler`` for ``device``, enabled only under fp16 compute (disabled, every call is a
    no-op: ``scale`` returns the loss, ``step`` calls ``optimizer.step()``)."""
    device_type = torch.device(device).type
    return torch.amp.GradScaler(device_type, enabled=compute == torch.float16)


def release_finished_accelerate_state(mixed_precision: str) -> None:
    """Let a stage start with its own ``mixed_precision`` in a process where another already ran.

    accelerate keeps one process-wide state and refuses a second ``Accelerator`` with another mixed
    precision: a reward stage on CUDA (``fp16``/``bf16`` autocast, TRL) followed by PPO
    (``mixed_precision="no"``, ours) in one Python process, as in a notebook, stopped at PPO's start
    with "AcceleratorState has already been initialized". Stages run one after another, so the
    earlier stage's state is finished and is dropped. Under a distributed group (data parallel)
    nothing is dropped: that state is the group's, and every stage of a rank uses one precision."""
    from accelerate.state import AcceleratorState

    shared = AcceleratorState._shared_state
    if not shared or shared.get("_mixed_precision", "no") == mixed_precision:
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    AcceleratorState._reset_state()


def unmixed_accelerator(cpu: bool):
    """PPO's ``accelerate.Accelerator``: backward and clipping only, ``mixed_precision="no"`` since
    mixed precision is ours (this module; accelerate's would scale the loss a second time)."""
    from accelerate import Accelerator

    release_finished_accelerate_state("no")
    return Accelerator(cpu=cpu, mixed_precision="no")
