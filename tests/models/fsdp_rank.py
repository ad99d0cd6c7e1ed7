"""One process of the FSDP + QLoRA smoke run (launched twice by tests/models/test_sharding.py):
the same forward/backward on the unsharded and the sharded peft model; rank 0 writes the figures."""

from __future__ import annotations

import json
import sys

import torch


def load(model_dir: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from homerlhf.config.schema import QuantConfig
    from homerlhf.models.policy import quantization_config

    quant = QuantConfig(load_in_4bit=True, quant_type="nf4", double_quant=True, compute_dtype="fp32")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device_map="cpu",
                                                 quantization_config=quantization_config(quant, "cpu", torch.float32))
    for param in model.parameters():
        param.requires_grad_(False)
    torch.manual_seed(0)  # the same LoRA init in both copies (B is zero: perturb it so A gets a gradient)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    return model


def lora_grads(model) -> dict[str, torch.Tensor]:
    return {n.replace("_fsdp_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None}


def main(model_dir: str, out_path: str) -> None:
    import torch.distributed as dist
    from accelerate import PartialState
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from homerlhf.models.sharding import shard

    state = PartialState(cpu=True)
    ids = torch.tensor([[2, 5, 7, 9, 11, 13, 17, 19]])
    plain = load(model_dir)
    codes = next(p for n, p in plain.named_parameters() if n.endswith("q_proj.base_layer.weight"))
    codes_dtype, codes_class = str(codes.dtype), type(codes).__name__  # before a CPU forward may repack them
    loss_plain = plain(input_ids=ids, labels=ids).loss
    loss_plain.backward()
    want = lora_grads(plain)
    full_numel = sum(p.numel() for p in plain.parameters())

    sharded = shard(load(model_dir), torch.device("cpu"))
    loss_sharded = sharded(input_ids=ids, labels=ids).loss
    loss_sharded.backward()
    with FSDP.summon_full_params(sharded, with_grads=True):
        got = lora_grads(sharded)
    diff = max((want[k] - got[k]).abs().max().item() for k in want)
    # Each process holds only its shard of every flat parameter (4-bit codes, norms, LoRA alike).
    local = sum(m._handle.flat_param._local_shard.numel() for m in FSDP.fsdp_modules(sharded) if m._handle)
    if state.process_index == 0:
        json.dump({"world": state.num_processes, "loss_plain": loss_plain.item(), "loss_sharded": loss_sharded.item(),
                   "grad_keys_want": len(want), "grad_keys_got": len(got), "max_grad_diff": diff,
                   "codes_dtype": codes_dtype, "codes_class": codes_class,
                   "full_numel": full_numel, "local_shard_numel": local}, open(out_path, "w"))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
