"""A peft LoRA adapter of the policy as a llama.cpp GGUF LoRA adapter.

llama.cpp's format (its ``convert_lora_to_gguf.py``): ``general.type = adapter``,
``adapter.type = lora``, ``adapter.lora.alpha``, and per adapted weight ``<gguf name>.lora_a``
(peft's ``lora_A``, ``[r, in]``) and ``<gguf name>.lora_b`` (peft's ``lora_B``, ``[out, r]``); the
graph adds ``scale * B (A x)`` to ``W x``, with ``scale = user_scale * alpha / r`` when alpha is
non-zero and ``user_scale`` when it is 0. peft's per-module ``scaling`` (alpha / r, or rsLoRA's
alpha / sqrt(r), or a per-module pattern) is folded into ``lora_b`` and alpha written as 0, so
every module gets exactly peft's factor at user scale 1.

``lora_b`` gets the same row conversion as the base weight (Llama's q/k rope permutation: the
rows of ``W + B A`` are permuted by permuting the rows of ``B``). Tensors stay F32: an adapter is
small, and the engine should compute what the trainer computes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from homerlhf.errors import UserError
from homerlhf.models.expert_lora import expert_lora_weights
from homerlhf.workers.gguf.registry import family_for
from homerlhf.workers.gguf.tensors import LazyTensor
from homerlhf.workers.gguf.writer import atomic_gguf_writer

_PEFT_PREFIX = "base_model.model."


def lora_weights(model, adapter: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """HF weight name -> ``(A [r, in], scaling * B [out, r])``, float32, for every module of the peft
    ``model`` that carries ``adapter``."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            continue
        if isinstance(module, ParamWrapper):  # fused experts: expert_lora.expert_lora_weights
            continue
        if module.use_dora.get(adapter, False):
            raise UserError(f"{name}: DoRA adapters have no llama.cpp LoRA form; use rollout.engine=hf")
        a = module.lora_A[adapter].weight.detach().float().cpu().numpy()
        b = module.lora_B[adapter].weight.detach().float().cpu().numpy() * float(module.scaling[adapter])
        base = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
        out[f"{base}.weight"] = (np.ascontiguousarray(a), np.ascontiguousarray(b))
    if not out and not expert_lora_weights(model, adapter):
        raise UserError(f"the policy has no LoRA modules for adapter {adapter!r}")
    return out


def write_lora_gguf(model, adapter: str, config: dict, out_path: str | Path) -> Path:
    """Writes ``adapter`` of the peft ``model`` (base ``config``: its parsed config.json) as a GGUF
    LoRA adapter at ``out_path``, atomically."""
    import gguf

    family = family_for(config, str(config.get("_name_or_path", "the policy")))
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == family.gguf_arch)
    name_map = gguf.get_tensor_name_map(arch_enum, int(config["num_hidden_layers"]))
    if expert_lora_weights(model, adapter):
        raise UserError("LoRA on the experts has no llama.cpp adapter form here; use rollout.engine=hf "
                        "(or actor.lora.experts=false)")
    out_path = Path(out_path)
    with atomic_gguf_writer(out_path, family.gguf_arch) as writer:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 0.0)  # scaling is folded into lora_b
        for hf_name, (a, b) in lora_weights(model, adapter).items():
            name = name_map.get_name(hf_name, try_suffixes=(".weight",))
            if name is None:
                raise UserError(f"LoRA on {hf_name!r} has no llama.cpp tensor; limit actor.lora.target_modules "
                                "to the decoder's linear layers or use rollout.engine=hf")
            b = family.convert(hf_name, LazyTensor.of(b), config).load()
            writer.add_tensor(f"{name}.lora_a", a.astype(np.float32))
            writer.add_tensor(f"{name}.lora_b", np.ascontiguousarray(b, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    return out_path
