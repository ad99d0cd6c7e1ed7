"""Checkpoint tensors known by name and shape, loaded one at a time only when written.

A 7B export then needs the memory of one tensor, not of the model. ``nf4_tensors`` swaps every
4-bit linear weight (and a mixture of experts' 4-bit experts) for its NF4 dequantization: the weights
the actor really computes with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from homerlhf.errors import UserError

if TYPE_CHECKING:  # pragma: no cover
    from homerlhf.config.schema import QuantConfig


@dataclass
class LazyTensor:
    """A tensor known by shape; ``load()`` reads it (float32 numpy) when it is written."""

    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]

    def then(self, fn: Callable[[np.ndarray], np.ndarray], shape: Optional[tuple[int, ...]] = None) -> "LazyTensor":
        """This tensor with ``fn`` applied when loaded (``shape``: the result's, if it changes)."""
        return LazyTensor(shape or self.shape, partial(_apply, fn, self.load))

    @staticmethod
    def of(array: np.ndarray) -> "LazyTensor":
        array = np.asarray(array, dtype=np.float32)
        return LazyTensor(tuple(array.shape), partial(np.array, array))


def _apply(fn, load):
    return fn(load())


def read_config(model_dir: Path) -> dict:
    """``config.json`` of a HF model directory, or a UserError saying what the directory is instead."""
    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.exists():
        if (Path(model_dir) / "adapter_config.json").exists():
            raise UserError(f"{model_dir} holds a LoRA adapter, not a model; merge it into its base first")
        raise UserError(f"{model_dir} has no config.json; pass a HF model directory")
    return json.loads(cfg_path.read_text())


def _safetensors_load(file: Path, key: str) -> np.ndarray:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        return handle.get_tensor(key).float().numpy()


def _torch_to_numpy(value) -> np.ndarray:
    return value.float().numpy()


def checkpoint_tensors(model_dir: Path) -> dict[str, LazyTensor]:
    """Every tensor of a HF checkpoint (safetensors, or .bin via ``weights_only``), lazily loaded."""
    from safetensors import safe_open

    tensors: dict[str, LazyTensor] = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                shape = tuple(handle.get_slice(key).get_shape())
                tensors[key] = LazyTensor(shape, partial(_safetensors_load, file, key))
    if not files:
        bins = sorted(Path(model_dir).glob("pytorch_model*.bin"))
        if not bins:
            raise UserError(f"{model_dir} has no weights (*.safetensors or pytorch_model*.bin)")
        import torch

        for file in bins:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            for key, value in state.items():
                tensors[key] = LazyTensor(tuple(value.shape), partial(_torch_to_numpy, value))
    return tensors


def load_nf4_model(model_dir: Path, quant: Optional["QuantConfig"] = None, device: str = "cpu"):
    """The causal LM in 4-bit with the policy's own settings and dtype (``homerlhf.models.policy``:
    ``quant`` and the dtype it implies on ``device``), on the CPU: bitsandbytes quantizes the same
    values the same way there."""
    from transformers import AutoModelForCausalLM

    from homerlhf.config.schema import QuantConfig
    from homerlhf.models.moe import check_moe, experts_in_4bit
    from homerlhf.models.policy import compute_dtype, quantization_config

    quant = quant or QuantConfig()
    with experts_in_4bit(check_moe(read_config(model_dir), str(model_dir)), quant.expert_chunk_mib):
        return AutoModelForCausalLM.from_pretrained(
            model_dir, quantization_config=quantization_config(quant, device),
            dtype=compute_dtype(quant, device), device_map="cpu",
        )


def nf4_tensors(model_dir: Path, quant: Optional["QuantConfig"] = None, device: str = "cpu",
                model=None) -> dict[str, LazyTensor]:
    """The checkpoint's tensors with every 4-bit linear weight replaced by its NF4 dequantization.

    The model is loaded as :func:`load_nf4_model` loads it (``model``: one already loaded so), so the
    dequantized weights are what the actor computes with.
    """
    import bitsandbytes as bnb
    from bitsandbytes.functional import dequantize_4bit

    model = model if model is not None else load_nf4_model(model_dir, quant, device)
    tensors = checkpoint_tensors(model_dir)
    # The tensors bitsandbytes leaves dense (embeddings, norms) as the actor holds them: in its
    # compute dtype (bf16 on most GPUs), not the checkpoint's float32.
    for key, param in model.named_parameters():
        if key in tensors and tuple(param.shape) == tensors[key].shape and param.dtype.is_floating_point:
            tensors[key] = LazyTensor(tensors[key].shape, partial(_torch_to_numpy, param.data))
    n_quantized = _dequantized_experts(model, tensors)
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = module.weight
            key = f"{name}.weight"
            if key not in tensors:
                raise UserError(f"{model_dir}: 4-bit module {name} has no weight {key} in the checkpoint")
            # Dequantized when written: the 4-bit model stays small, one dense tensor at a time.
            shape = tuple(int(d) for d in weight.quant_state.shape)
            tensors[key] = LazyTensor(shape, partial(_dequantize, weight, dequantize_4bit))
            n_quantized += 1
    if n_quantized == 0:
        raise UserError(f"{model_dir}: bitsandbytes quantized no layer; --from-nf4 needs a model with linear layers")
    return tensors


def _dequantized_experts(model, tensors: dict[str, LazyTensor]) -> int:
    """A mixture of experts' 4-bit experts (:mod:`homerlhf.models.experts4bit`) as transformers fuses them,
    ``<experts>.gate_up_proj`` / ``down_proj`` (E, d1, d2), dequantized when written, in place of the
    checkpoint's per-expert weights of that layer; returns the weights replaced."""
    from homerlhf.models.experts4bit import Experts4bit

    replaced = 0
    for name, module in model.named_modules():
        if not isinstance(module, Experts4bit):
            continue
        for key in [k for k in tensors if k.startswith(f"{name}.") and k.count(".") > name.count(".") + 1]:
            del tensors[key]  # the checkpoint's per-expert matrices (mlp.experts.<e>.*)
        for weight in module.weight_names:
            tensors[f"{name}.{weight}"] = LazyTensor(module.shapes[weight], partial(_dequantize_experts, module, weight))
            replaced += 1
    return replaced


def _dequantize_experts(module, weight: str) -> np.ndarray:
    import torch

    return module.dequantize(weight, torch.arange(module.num_experts)).float().cpu().numpy()


def _dequantize(weight, dequantize_4bit) -> np.ndarray:
    return dequantize_4bit(weight.data, weight.quant_state).float().numpy()
