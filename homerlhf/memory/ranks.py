"""Per-GPU memory of a run over several GPUs (``distributed.gpus``): what each process holds.

- **Data parallel (DDP, the default):** every GPU holds the whole 4-bit base, both adapters, the
  value head and their optimizer states, and runs the same chunk and micro-batch sizes; only the
  experience buffer is split (each process keeps its ``rollout.batch_size / gpus`` rows). The
  gradient all-reduce packs the trainable gradients into one flat fp32 tensor and receives the sum
  in another (:meth:`homerlhf.ppo.distributed.Ranks.all_reduce_grads`): two copies of the LoRA + value-head
  gradients at the end of each optimizer step's accumulation.
- **Sharded QLoRA (``distributed.fsdp``):** FSDP splits every wrapped decoder layer's parameters,
  4-bit weights (stored in the compute dtype's bytes, ``bnb_4bit_quant_storage``) and LoRA alike, over
  the GPUs, so each holds ``1 / gpus`` of the linear weights, adapters and optimizer states; a layer
  is gathered whole while it runs, and the next is prefetched: two layers' weights on top.
  Embeddings, LM head and norms are counted unsharded (the root unit; conservative).
"""

from __future__ import annotations

from dataclasses import replace

from homerlhf.config.schema import RunConfig
from homerlhf.memory.components import Component, nf4_bytes_per_param
from homerlhf.memory.shapes import ModelShape

# Persistent components FSDP shards over the GPUs (by name prefix).
_SHARDED = ("base linear weights", "LoRA actor", "LoRA critic", "optimizer states")


def per_gpu_persistent(cfg: RunConfig, shape: ModelShape, comps: list[Component]) -> list[Component]:
    """The persistent components one GPU holds with ``cfg.distributed.gpus`` processes."""
    n = cfg.distributed.gpus
    if n <= 1:
        return comps
    out = []
    for comp in comps:
        if comp.name == "experience buffer":
            per = cfg.rollout.batch_size // n
            comp = replace(comp, bytes=comp.bytes // n, note=f"{per} of the global {cfg.rollout.batch_size} samples")
        elif cfg.distributed.fsdp and comp.name.startswith(_SHARDED):
            comp = replace(comp, bytes=comp.bytes // n, note=f"1/{n} shard (FSDP); " + comp.note)
        out.append(comp)
    if cfg.distributed.fsdp:
        out.append(Component("gathered layers (FSDP)", "weights", 2 * _layer_weight_bytes(cfg, shape),
                             note="the running decoder layer, gathered whole, and the next one prefetched"))
    return out


def gradient_sync_components(cfg: RunConfig, shape: ModelShape) -> list[Component]:
    """The update phase's extra with several processes: the flat gradient buffers of the all-reduce
    (DDP); FSDP reduce-scatters into the shards it already holds (nothing extra counted)."""
    if cfg.distributed.gpus <= 1 or cfg.distributed.fsdp:
        return []
    trainable = shape.lora_params(cfg.actor.lora.r, cfg.actor.lora.target_modules)
    if cfg.has_critic:
        trainable += shape.hidden_size + 1
        if not cfg.critic.shared_adapter:
            trainable += shape.lora_params(cfg.critic.lora.r, cfg.critic.lora.target_modules)
    return [Component("gradient all-reduce buffers", "gradients", 2 * 4 * trainable,
                      note=f"flat fp32 LoRA + value-head grads, sent and summed over {cfg.distributed.gpus} GPUs")]


def _layer_weight_bytes(cfg: RunConfig, shape: ModelShape) -> int:
    """One decoder layer's linear weights as stored (4-bit codes in compute-dtype storage, or full)."""
    per_layer = shape.linear_weight_params / shape.num_layers
    if cfg.quant.load_in_4bit:
        return int(per_layer * nf4_bytes_per_param(cfg.quant.double_quant))
    return int(per_layer * (4 if cfg.quant.compute_dtype == "fp32" else 2))


def distributed_summary(cfg: RunConfig) -> dict:
    """The plan's figures of a multi-GPU run: GPUs, sharding, global and per-GPU batch."""
    n = cfg.distributed.gpus
    return {"gpus": n, "fsdp": cfg.distributed.fsdp, "global_batch": cfg.rollout.batch_size,
            "per_gpu_batch": cfg.rollout.batch_size // n}
