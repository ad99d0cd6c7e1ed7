"""The trained policy as one model: the actor's LoRA adapter folded into the weights it trained on.

By default those are the *dequantized NF4 base* (:func:`.tensors.nf4_tensors`, as ``export ref
--from-nf4`` reads them): the weights the actor computed with, so the merged model is the trained
policy up to the rounding of the dtype it is saved in. Merging into the original full-precision
weights instead (``base="original"``) gives another model, off by the base's quantization error
(the lossy QLoRA merge of trl#3466); :func:`logprob_gap` measures by how much.

The merge streams: one tensor at a time is dequantized, merged (``W + scaling * B @ A`` in float32,
peft's own per-module ``scaling``: :func:`.lora.lora_weights`), cast and written into safetensors
shards, so memory is the 4-bit model plus one shard.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from homerlhf.errors import UserError
from homerlhf.models.expert_lora import adapter_config, expert_lora_weights
from homerlhf.workers.gguf.lora import lora_weights
from homerlhf.workers.gguf.tensors import LazyTensor, checkpoint_tensors, load_nf4_model, nf4_tensors

if TYPE_CHECKING:  # pragma: no cover
    from homerlhf.config.schema import QuantConfig

ACTOR = "actor"
SHARD_BYTES = 2 << 30  # safetensors shard size: a 7B in bf16 is 7 files
BASES = ("nf4", "original")


@dataclass
class TrainedPolicy:
    """The actor as it trained: ``model`` (peft: the base loaded as the policy loads it + the
    adapter), the base weights it computed on (HF names, lazily loaded), its LoRA factors."""

    model: Any
    base_tensors: dict[str, LazyTensor]
    lora: dict[str, tuple[np.ndarray, np.ndarray]]
    quantized: bool
    experts: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # LoRA on fused experts


def load_trained_policy(base_dir: Path, adapter_dir: Path, quant: "QuantConfig", device: str) -> TrainedPolicy:
    """The base with the policy's own 4-bit settings and dtype (on the CPU) and the adapter on it,
    computing as the run's policy computes (no bitsandbytes repacking into its bf16 CPU kernel)."""
    from peft import PeftModel

    from homerlhf.models.base_loading import keep_cpu_4bit_differentiable

    if quant.load_in_4bit:
        base = load_nf4_model(base_dir, quant, device)
        tensors = nf4_tensors(base_dir, quant, device, model=base)  # before peft wraps the 4-bit modules
        keep_cpu_4bit_differentiable(base)  # as base_loading.load_base: else an AVX512-BF16 CPU computes in bf16
    else:  # the actor trained on the checkpoint's own weights
        from transformers import AutoModelForCausalLM

        from homerlhf.models.policy import compute_dtype

        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=compute_dtype(quant, device), device_map="cpu")
        tensors = checkpoint_tensors(base_dir)
    model = PeftModel.from_pretrained(base, str(adapter_dir), adapter_name=ACTOR, config=adapter_config(adapter_dir, base))
    model.eval()
    _check_plain_lora(model)
    return TrainedPolicy(model, tensors, lora_weights(model, ACTOR), quant.load_in_4bit, expert_lora_weights(model, ACTOR))


def _check_plain_lora(model) -> None:
    """LoRA on embeddings (and DoRA, refused by :func:`lora_weights`) has no ``B @ A`` form here."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ACTOR in getattr(module, "lora_embedding_A", {}):
            raise UserError(f"the actor adapts the embedding {name}; only linear layers can be merged here")


def merged_tensors(base: dict[str, LazyTensor], lora: dict[str, tuple[np.ndarray, np.ndarray]],
                   config: dict, experts: Optional[dict] = None) -> dict[str, LazyTensor]:
    """``base`` with ``B @ A`` added to every adapted weight, when each is loaded; ``experts``: LoRA on fused
    expert weights (E, out, in), or (E, in, out) for gpt-oss's layout, ``B_e @ A_e`` added to each expert's."""
    out = dict(base)
    for name, (a, b) in (experts or {}).items():
        if name not in out:
            raise UserError(f"the actor adapts the experts {name}, which the base tensors do not hold fused; "
                            "merge into the NF4 base (--base nf4)")
        transposed = config.get("model_type") == "gpt_oss"
        out[name] = out[name].then(partial(_add_expert_lora, a, b, transposed))
    for name, (a, b) in lora.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            raise UserError("the actor adapts the LM head, which this model ties to its embedding; "
                            "merging would untie them: leave lm_head out of actor.lora.target_modules")
        if name not in out:
            raise UserError(f"the actor adapts {name}, which the base checkpoint does not have; "
                            "export with the run's own base model")
        out[name] = out[name].then(partial(_add_lora, a, b))
    return out


def _add_expert_lora(a: np.ndarray, b: np.ndarray, transposed: bool, weight: np.ndarray) -> np.ndarray:
    # W_e [out, in] + B_e [out, r] @ A_e [r, in] for every expert e; stored (E, in, out): its transpose.
    delta = np.matmul(b, a)
    return np.asarray(weight, dtype=np.float32) + (delta.transpose(0, 2, 1) if transposed else delta)


def _add_lora(a: np.ndarray, b: np.ndarray, weight: np.ndarray) -> np.ndarray:
    # W [out, in] + B [out, r] @ A [r, in]; B carries peft's scaling already.
    return np.asarray(weight, dtype=np.float32) + b @ a


def policy_tensors(policy: TrainedPolicy, base_dir: Path, base: str) -> dict[str, LazyTensor]:
    """The merged weights: on the trained-on base (``nf4``) or on the checkpoint's own (``original``)."""
    if base not in BASES:
        raise UserError(f"--base {base!r} is not known; use nf4 or original")
    weights = checkpoint_tensors(base_dir) if base == "original" else policy.base_tensors
    config = json.loads((Path(base_dir) / "config.json").read_text())
    return merged_tensors(weights, policy.lora, config, policy.experts)


def write_safetensors(tensors: dict[str, LazyTensor], out_dir: Path, dtype, shard_bytes: int = SHARD_BYTES) -> list[Path]:
    """Writes ``tensors`` cast to torch ``dtype`` as HF safetensors shards (with the index HF reads
    when there is more than one), one shard in memory at a time."""
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        n_bytes = int(np.prod(tensor.shape)) * itemsize
        if shards[-1] and size + n_bytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n_bytes
    names = (["model.safetensors"] if len(shards) == 1
             else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    bar = tqdm(total=len(tensors), desc="merge", unit="tensor", leave=False)
    weight_map = {}
    for file, shard in zip(names, shards):
        data = {}
        for name in shard:
            data[name] = torch.from_numpy(np.ascontiguousarray(tensors[name].load())).to(dtype)
            weight_map[name] = file
            bar.update(1)
        save_file(data, str(Path(out_dir) / file), metadata={"format": "pt"})
        os.chmod(Path(out_dir) / file, 0o666 & ~_umask())  # safetensors writes 0600; a model is for sharing
    bar.close()
    if len(shards) > 1:
        total = sum(int(np.prod(t.shape)) * itemsize for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (Path(out_dir) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [Path(out_dir) / file for file in names]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def sequence_logprobs(model, sequences: Sequence[Sequence[int]], chunk_tokens: int = 256) -> list[np.ndarray]:
    """Per token ``log p(ids[t] | ids[:t])`` (t >= 1), float64, one unpadded sequence at a time, the LM head
    over ``chunk_tokens`` positions at a time (:func:`homerlhf.models.sequence_logprobs.answer_logprobs`)."""
    import torch

    from homerlhf.models.sequence_logprobs import answer_logprobs

    return [answer_logprobs(model, [list(ids)], [1], 0, chunk_tokens, dtype=torch.float64)[0].numpy()
            for ids in sequences]


def logprob_gap(reference: list[np.ndarray], other: list[np.ndarray]) -> dict[str, float]:
    """Largest and mean absolute per-token log-prob difference (nats) between two scorings."""
    diff = np.concatenate([np.abs(a - b) for a, b in zip(reference, other)])
    return {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()), "tokens": int(diff.size)}


def write_model_files(base_dir: Path, out_dir: Path, dtype: str, stop_ids: Sequence[int]) -> None:
    """config.json (in ``dtype``, no quantization config), the base's own tokenizer with its chat
    template, and a generation config that stops where the run's rollouts stopped."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(base_dir)
    config.dtype = dtype
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    tokenizer.save_pretrained(out_dir)
    try:
        generation = GenerationConfig.from_pretrained(base_dir)
    except OSError:  # no generation_config.json: the model config's defaults
        generation = GenerationConfig.from_model_config(config)
    generation.eos_token_id = list(stop_ids) if len(stop_ids) > 1 else int(stop_ids[0])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    generation.pad_token_id = pad
    generation.save_pretrained(out_dir)
