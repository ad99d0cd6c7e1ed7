"""Sharded QLoRA (FSDP + QLoRA): the 4-bit base split over several GPUs instead of copied to each.

FSDP flattens and shards parameters of one dtype per wrapped unit, so the 4-bit codes must be
*stored* in the compute dtype (``bnb_4bit_quant_storage``: packed uint8 codes viewed as bf16 / fp32
elements; the bytes are the same). Each decoder layer is a unit (peft's ``fsdp_auto_wrap_policy``
wraps the transformer blocks and the LoRA modules); ``use_orig_params`` keeps the frozen 4-bit
weights and the trainable LoRA weights in the same units.

What runs here (``tests/models/test_sharding.py``, CPU, gloo): two processes load the tiny Llama in
NF4 with fp32 storage, add LoRA, wrap with FSDP, and a forward/backward gives the loss and the LoRA
gradients of the unsharded model. The PPO trainer does not run sharded yet (generation and the
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
