"""Sharded QLoRA (FSDP + QLoRA): the 4-bit base split over several GPUs instead of copied to each.

FSDP flattens and shards parameters of one dtype per wrapped unit, so the 4-bit codes must be
*stored* in the compute dtype (``bnb_4bit_quant_storage``: packed uint8 codes viewed as bf16 / fp32
elements; the bytes are the same). Each decoder layer is a unit (peft's ``fsdp_auto_wrap_policy``
wraps the transformer blocks and the LoRA modules); ``use_orig_params`` keeps the frozen 4-bit
weights and the trainable LoRA weights in the same units.

What runs here (:func:`smoke`; ``tests/models/test_sharding.py`` on CPU with gloo): two processes load
the tiny Llama in NF4 with fp32 storage, add LoRA, wrap with FSDP, and a forward/backward gives the
loss and the LoRA gradients of the unsharded model. The PPO trainer does not run sharded yet (generation and the
actor/critic adapter switch under FSDP are not built): ``distributed.fsdp`` is for the planner and
``scripts/validate_multi_gpu.py``.
"""

from __future__ import annotations

import torch

from homerlhf.config.schema import RunConfig
from homerlhf.errors import UserError


def shard(model, device: torch.device):
    """``model`` (a peft model on a 4-bit base stored in its compute dtype) wrapped in FSDP, one unit per
    decoder layer, on ``device``; needs an initialised process group."""
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP(model, auto_wrap_policy=fsdp_auto_wrap_policy(model), use_orig_params=True, device_id=device,
                sync_module_states=False)


def check_trainable_sharded(cfg: RunConfig) -> None:
    """The PPO trainer runs data parallel only: a run asking for FSDP is told so before anything loads."""
    if cfg.distributed.fsdp:
        raise UserError("distributed.fsdp: the PPO trainer does not run sharded yet (the planner plans it and "
                        "scripts/validate_multi_gpu.py checks FSDP + QLoRA on your GPUs); set distributed.fsdp=false "
                        "and use a model one GPU holds (see docs/scaling.md)")


# -- the smoke check (tests on CPU, scripts/validate_multi_gpu.py on GPUs) -------------------------------
def _lora_model(model_dir: str, device: str, dtype: torch.dtype):
    """The model in NF4 with codes stored in ``dtype``, frozen, with a LoRA whose B is not zero (so both
    A and B get gradients), seeded alike in every process."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from homerlhf.config.schema import QuantConfig
    from homerlhf.models.base_loading import keep_cpu_4bit_differentiable, quantization_config

    quant = QuantConfig(load_in_4bit=True, quant_type="nf4", double_quant=True,
                        compute_dtype={torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, quantization_config=quantization_config(
        quant, "cuda" if device.startswith("cuda") else "cpu", dtype), device_map={"": device})
    keep_cpu_4bit_differentiable(model)
    for param in model.parameters():
        param.requires_grad_(False)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    return model


def _lora_grads(model) -> dict[str, torch.Tensor]:
    return {n.replace("_fsdp_wrapped_module.", ""): p.grad.float().cpu() for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None}


def smoke(model_dir: str, device: str, dtype: torch.dtype = torch.float32) -> dict:
    """In every process of an initialised group: one forward/backward of the unsharded model and of
    its FSDP-sharded copy on the same ids; the losses, the largest LoRA-gradient difference, the
    4-bit codes' storage, and the parameters each process holds (its shards) against the model's."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    ids = torch.tensor([[2, 5, 7, 9, 11, 13, 17, 19]], device=device)
    plain = _lora_model(model_dir, device, dtype)
    codes = next(p for n, p in plain.named_parameters() if n.endswith("q_proj.base_layer.weight"))
    storage = (type(codes).__name__, str(codes.dtype))  # before a CPU forward may repack the codes
    loss_plain = plain(input_ids=ids, labels=ids).loss
    loss_plain.backward()
    want, full = _lora_grads(plain), sum(p.numel() for p in plain.parameters())
    del plain
    sharded = shard(_lora_model(model_dir, device, dtype), torch.device(device))
    loss_sharded = sharded(input_ids=ids, labels=ids).loss
    loss_sharded.backward()
    with FSDP.summon_full_params(sharded, with_grads=True):
        got = _lora_grads(sharded)
    local = sum(m._handle.flat_param._local_shard.numel() for m in FSDP.fsdp_modules(sharded) if m._handle)
    return {"loss_plain": loss_plain.item(), "loss_sharded": loss_sharded.item(), "codes": storage,
            "grads": [len(want), len(got)], "max_grad_diff": max((want[k] - got[k]).abs().max().item() for k in want),
            "full_numel": full, "local_shard_numel": local}
