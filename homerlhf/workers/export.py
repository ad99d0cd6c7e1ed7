"""GGUF export of the reference and reward models for the llama.cpp workers.

llama.cpp's own converter is not shipped in any wheel and does not take ``*ForSequenceClassification``
checkpoints, so the GGUF is written here with ``gguf.GGUFWriter`` and gguf's own tensor-name maps.
Tensors are streamed one at a time (tensor infos first, then data), so a 7B export needs the memory
of one tensor, not of the model.

- :func:`export_ref`: a causal LM as one GGUF. ``from_nf4=True`` exports the *dequantized NF4
  weights* the actor trains on, so the reference is KL-consistent with the actor at step 0.
- :func:`export_reward`: a sequence classifier (num_labels 1) as ``backbone.gguf`` (the decoder
  without its LM head), ``score_head.safetensors`` (weight ``[1, H]``, bias ``[1]`` if any) and
  ``manifest.json``; the worker computes ``score_head · h_last (+ bias)``.

Supported: Llama, Mistral (llama arch in GGUF), Qwen2, Qwen3. Tokenizers: byte-level BPE ("gpt2"
with merges) and SentencePiece-style ("llama": byte-fallback BPE or Unigram).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from homerlhf.errors import UserError
from homerlhf.models.registry import resolve_model_dir
from homerlhf.workers.vocab import tokenizer_tokens, vocab_fingerprint

if TYPE_CHECKING:  # pragma: no cover
    from homerlhf.config.schema import QuantConfig

FORMAT_VERSION = 1
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
# HF model_type -> gguf architecture name; mistral is the llama graph in llama.cpp.
SUPPORTED_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Custom GGUF keys the worker reads back.
KEY_TOKENIZER_SIZE = "homerlhf.tokenizer_size"
KEY_ROLE = "homerlhf.role"
KEY_SOURCE = "homerlhf.source"


@dataclass
class _Tensor:
    """A checkpoint tensor known by shape, loaded only when written."""

    shape: tuple[int, ...]
    load: Callable[[], "np.ndarray"]


def _read_config(model_dir: Path) -> dict:
    cfg_path = model_dir / "config.json"
    if not cfg_path.exists():
        if (model_dir / "adapter_config.json").exists():
            raise UserError(f"{model_dir} holds a LoRA adapter, not a model; merge it into its base first")
        raise UserError(f"{model_dir} has no config.json; pass a HF model directory")
    return json.loads(cfg_path.read_text())


def _gguf_arch(config: dict, model_dir: Path) -> str:
    model_type = config.get("model_type", "?")
    if model_type not in SUPPORTED_ARCHS:
        raise UserError(
            f"{model_dir}: architecture {model_type!r} is not supported for GGUF export; "
            f"supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    return SUPPORTED_ARCHS[model_type]


# --------------------------------------------------------------------------- checkpoint tensors


def _safetensors_load(file: Path, key: str) -> np.ndarray:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        return handle.get_tensor(key).float().numpy()


def checkpoint_tensors(model_dir: Path) -> dict[str, _Tensor]:
    """Every tensor of a HF checkpoint (safetensors, or .bin via ``weights_only``), lazily loaded."""
    from safetensors import safe_open

    tensors: dict[str, _Tensor] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                shape = tuple(handle.get_slice(key).get_shape())
                tensors[key] = _Tensor(shape, partial(_safetensors_load, file, key))
    if not files:
        bins = sorted(model_dir.glob("pytorch_model*.bin"))
        if not bins:
            raise UserError(f"{model_dir} has no weights (*.safetensors or pytorch_model*.bin)")
        import torch

        for file in bins:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            for key, value in state.items():
                tensors[key] = _Tensor(tuple(value.shape), partial(lambda v: v.float().numpy(), value))
    return tensors


def nf4_tensors(model_dir: Path, quant: Optional["QuantConfig"] = None, device: str = "cpu") -> dict[str, _Tensor]:
    """The checkpoint's tensors with every 4-bit linear weight replaced by its NF4 dequantization.

    The model is loaded with the policy's own 4-bit settings and dtype (``homerlhf.models.policy``:
    ``quant`` and the dtype it implies on ``device``), so the dequantized weights are what the actor
    computes with. Loading happens on CPU: bitsandbytes quantizes the same values the same way.
    """
    import bitsandbytes as bnb
    from bitsandbytes.functional import dequantize_4bit
    from transformers import AutoModelForCausalLM

    from homerlhf.config.schema import QuantConfig
    from homerlhf.models.policy import compute_dtype, quantization_config

    quant = quant or QuantConfig()
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=quantization_config(quant, device),
        dtype=compute_dtype(quant, device), device_map="cpu",
    )
    tensors = checkpoint_tensors(model_dir)
    n_quantized = 0
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = module.weight
            key = f"{name}.weight"
            if key not in tensors:
                raise UserError(f"{model_dir}: 4-bit module {name} has no weight {key} in the checkpoint")
            # Dequantized when written: the 4-bit model stays small, one dense tensor at a time.
            shape = tuple(int(d) for d in weight.quant_state.shape)
            tensors[key] = _Tensor(shape, partial(_dequantize, weight, dequantize_4bit))
            n_quantized += 1
    if n_quantized == 0:
        raise UserError(f"{model_dir}: bitsandbytes quantized no layer; --from-nf4 needs a model with linear layers")
    return tensors


def _dequantize(weight, dequantize_4bit) -> np.ndarray:
    return dequantize_4bit(weight.data, weight.quant_state).float().numpy()


# --------------------------------------------------------------------------- tensor conversion


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half q/k rows -> llama.cpp interleaved rope order. Shape: (n_head * head_dim, ...)."""
    shape = weight.shape
    return weight.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _qtype(outtype: str, name: str, shape: tuple[int, ...]):
    import gguf

    q = gguf.GGMLQuantizationType
    # Norms, biases and other vectors stay F32, as llama.cpp's converter keeps them.
    if len(shape) < 2 or outtype == "f32" or name.endswith("_norm.weight") or name == "rope_freqs.weight":
        return q.F32
    if outtype == "f16":
        return q.F16
    if outtype == "bf16":
        return q.BF16
    block = gguf.GGML_QUANT_SIZES[q.Q8_0][0]
    return q.Q8_0 if shape[-1] % block == 0 else q.F16


def _encode(array: np.ndarray, qtype) -> np.ndarray:
    import gguf

    q = gguf.GGMLQuantizationType
    array = np.ascontiguousarray(array, dtype=np.float32)
    if qtype == q.F32:
        return array
    if qtype == q.F16:
        return array.astype(np.float16)
    return gguf.quants.quantize(array, qtype)


def _file_type(outtype: str):
    import gguf

    f = gguf.LlamaFileType
    return {"f32": f.ALL_F32, "f16": f.MOSTLY_F16, "bf16": f.MOSTLY_BF16, "q8_0": f.MOSTLY_Q8_0}[outtype]


# --------------------------------------------------------------------------- hyperparameters


def _rope(config: dict) -> tuple[float, dict]:
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    return theta, rope


def _llama3_rope_factors(config: dict, rope: dict, theta: float, head_dim: int) -> np.ndarray:
    """Per-frequency rope factors of Llama 3.x (as llama.cpp's converter writes ``rope_freqs``)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _add_hparams(writer, config: dict, arch: str, vocab_size: int, outtype: str, extra: dict[str, _Tensor]) -> None:
    import gguf

    hidden, n_head = config["hidden_size"], config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_head
    head_dim = config.get("head_dim") or hidden // n_head
    writer.add_context_length(int(config.get("max_position_embeddings", 4096)))
    writer.add_embedding_length(hidden)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(vocab_size)
    writer.add_file_type(_file_type(outtype))
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if head_dim != hidden // n_head or arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    theta, rope = _rope(config)
    writer.add_rope_freq_base(theta)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type == "default":
        return
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif rope_type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif rope_type == "llama3" and arch == "llama":
        factors = _llama3_rope_factors(config, rope, theta, head_dim)
        extra["rope_freqs.weight"] = _Tensor(factors.shape, partial(lambda a: a, factors))
    else:
        raise UserError(f"rope scaling {rope_type!r} is not supported for GGUF export; supported: default, linear, yarn, llama3")


# --------------------------------------------------------------------------- tokenizer

_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def _add_tokenizer(writer, tokenizer, arch: str, vocab_size: int) -> int:
    """Writes the vocabulary; returns the number of real (non-padding) tokens."""
    import gguf

    if not getattr(tokenizer, "is_fast", False):
        raise UserError("GGUF export needs a fast tokenizer (tokenizer.json); install `tokenizers` and re-save it")
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    tokens = tokenizer_tokens(tokenizer)
    n_real = len(tokens)
    if n_real > vocab_size:
        raise UserError(f"the tokenizer has {n_real} tokens but the model's embedding only {vocab_size}")
    added = {i: t for i, t in tokenizer.added_tokens_decoder.items()}
    spm = model["type"] == "Unigram" or (model["type"] == "BPE" and model.get("byte_fallback"))
    if model["type"] not in ("BPE", "Unigram"):
        raise UserError(f"tokenizer model {model['type']!r} is not supported; supported: BPE (byte-level or byte-fallback), Unigram")
    unk_id = tokenizer.unk_token_id
    types = []
    for i, tok in enumerate(tokens):
        if spm and i == unk_id:
            types.append(gguf.TokenType.UNKNOWN)
        elif spm and _BYTE_TOKEN.match(tok):  # byte-fallback pieces, even when listed as added tokens
            types.append(gguf.TokenType.BYTE)
        elif i in added:
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    # The embedding may be padded past the tokenizer (e.g. to a multiple of 64): unused ids.
    for i in range(n_real, vocab_size):
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
    if spm:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        if model["type"] == "Unigram":
            scores = [float(s) for _, s in model["vocab"]] + [0.0] * (vocab_size - len(model["vocab"]))
        else:
            scores = [-float(i) for i in range(vocab_size)]
        writer.add_token_scores(scores[:vocab_size])
    else:
        # The pre-tokenizer only matters for text, and workers never tokenize: ids come over the wire.
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2" if arch in ("qwen2", "qwen3") else "default")
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
        writer.add_token_merges(merges)
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    for key, token_id in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id),
                          ("unk", unk_id), ("pad", tokenizer.pad_token_id)):
        if token_id is not None:
            getattr(writer, f"add_{key}_token_id")(int(token_id))
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_uint32(KEY_TOKENIZER_SIZE, n_real)
    return n_real


# --------------------------------------------------------------------------- the writer


def _map_tensors(tensors: dict[str, _Tensor], config: dict, arch: str, skip: Callable[[str], bool]) -> dict[str, _Tensor]:
    """HF names -> GGUF names, with the llama q/k permutation applied lazily."""
    import gguf

    arch_enum = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}[arch]
    name_map = gguf.get_tensor_name_map(arch_enum, config["num_hidden_layers"])
    n_head = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_head
    tied = bool(config.get("tie_word_embeddings", False))
    out: dict[str, _Tensor] = {}
    for hf_name, tensor in tensors.items():
        if skip(hf_name) or hf_name.endswith("rotary_emb.inv_freq") or (tied and hf_name == "lm_head.weight"):
            continue
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise UserError(f"tensor {hf_name!r} has no GGUF name for architecture {arch}; the checkpoint is not a plain {arch} model")
        load = tensor.load
        if arch == "llama" and re.search(r"self_attn\.[qk]_proj\.", hf_name):
            heads = n_head if ".q_proj." in hf_name else n_kv
            load = partial(lambda f, h: permute_qk(f(), h), tensor.load, heads)
        out[name] = _Tensor(tensor.shape, load)
    return out


def write_gguf(
    out_path: Path,
    model_dir: Path,
    tensors: dict[str, _Tensor],
    outtype: str,
    role: str,
    skip: Callable[[str], bool] = lambda name: False,
) -> Path:
    """Writes ``tensors`` (HF names) of the model in ``model_dir`` as one GGUF, atomically."""
    import gguf
    from tqdm import tqdm
    from transformers import AutoTokenizer

    if outtype not in OUTTYPES:
        raise UserError(f"outtype {outtype!r} is not supported; use one of {', '.join(OUTTYPES)}")
    config = _read_config(model_dir)
    arch = _gguf_arch(config, model_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:
        raise UserError(f"{model_dir}: the tokenizer does not load ({type(exc).__name__}: {exc}); the model dir must include it") from None
    mapped = _map_tensors(tensors, config, arch, skip)
    if "token_embd.weight" not in mapped:
        raise UserError(f"{model_dir}: no token embedding (model.embed_tokens.weight) in the checkpoint")
    vocab_size = mapped["token_embd.weight"].shape[0]

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        writer.add_name(model_dir.name)
        writer.add_string(KEY_ROLE, role)
        writer.add_string(KEY_SOURCE, str(model_dir))
        extra: dict[str, _Tensor] = {}
        _add_hparams(writer, config, arch, vocab_size, outtype, extra)
        _add_tokenizer(writer, tokenizer, arch, vocab_size)
        mapped.update(extra)
        plan = []
        for name, tensor in mapped.items():
            qtype = _qtype(outtype, name, tensor.shape)
            n_bytes = int(np.prod(gguf.quants.quant_shape_to_byte_shape(tensor.shape, qtype)))
            writer.add_tensor_info(name, tensor.shape, np.dtype(np.float32), n_bytes, raw_dtype=qtype)
            plan.append((name, tensor, qtype))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, tensor, qtype in tqdm(plan, desc=f"export {out_path.name}", unit="tensor", leave=False):
            writer.write_tensor_data(_encode(tensor.load(), qtype))
        writer.close()
        os.replace(tmp, out_path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out_path


# --------------------------------------------------------------------------- public API


def export_ref(
    model: str,
    out_path: str | Path,
    outtype: str = "f16",
    from_nf4: bool = False,
    quant: Optional["QuantConfig"] = None,
    device: str = "cpu",
) -> Path:
    """Exports a causal LM as the reference GGUF; with ``from_nf4`` its dequantized NF4 weights.

    ``quant``/``device``: the policy's 4-bit settings and training device (they fix the dtype the
    base is quantized from). With ``quant.load_in_4bit`` off the actor is not quantized, so neither
    is the export.
    """
    if outtype not in OUTTYPES:
        raise UserError(f"outtype {outtype!r} is not supported; use one of {', '.join(OUTTYPES)}")
    model_dir = resolve_model_dir(str(model))
    config = _read_config(model_dir)
    _gguf_arch(config, model_dir)
    if any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or []):
        raise UserError(f"{model_dir} is a sequence classifier; export it with `homerlhf export reward`")
    if from_nf4 and quant is not None and not quant.load_in_4bit:
        from_nf4 = False
    tensors = nf4_tensors(model_dir, quant, device) if from_nf4 else checkpoint_tensors(model_dir)
    if "lm_head.weight" not in tensors and not config.get("tie_word_embeddings", False):
        raise UserError(f"{model_dir} has no lm_head.weight; export ref needs a causal LM checkpoint")
    return write_gguf(Path(out_path), model_dir, tensors, outtype, role="ref")


def reward_model_dir(model: str) -> Path:
    """The HF seqcls checkpoint for ``model``: the dir itself, or ``RUN_DIR/model`` of a reward run."""
    path = resolve_model_dir(str(model))
    if not (path / "config.json").exists() and (path / "model" / "config.json").exists():
        return path / "model"
    return path


def export_reward(model: str, out_dir: str | Path, outtype: str = "f16") -> Path:
    """Exports a reward model to ``out_dir`` (backbone.gguf, score_head.safetensors, manifest.json)."""
    from safetensors.numpy import save_file

    if outtype not in OUTTYPES:
        raise UserError(f"outtype {outtype!r} is not supported; use one of {', '.join(OUTTYPES)}")
    model_dir = reward_model_dir(model)
    config = _read_config(model_dir)
    arch = _gguf_arch(config, model_dir)
    if not any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or []):
        raise UserError(f"{model_dir} is not a *ForSequenceClassification checkpoint; a reward model needs a score head")
    num_labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
    tensors = checkpoint_tensors(model_dir)
    if "score.weight" not in tensors:
        raise UserError(f"{model_dir} has no score.weight; a reward model needs a score head")
    if num_labels != 1 or tensors["score.weight"].shape[0] != 1:
        raise UserError(f"{model_dir} has {tensors['score.weight'].shape[0]} labels; a reward model has exactly one (num_labels 1)")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    backbone = write_gguf(out / "backbone.gguf", model_dir, tensors, outtype, role="reward",
                          skip=lambda name: name.startswith("score.") or name == "lm_head.weight")
    head = {"weight": tensors["score.weight"].load().astype(np.float32)}
    if "score.bias" in tensors:
        head["bias"] = tensors["score.bias"].load().astype(np.float32).reshape(1)
    tmp = out / f".score_head.tmp-{os.getpid()}"
    save_file(head, str(tmp))
    os.replace(tmp, out / "score_head.safetensors")

    from transformers import AutoTokenizer

    manifest = {
        "format_version": FORMAT_VERSION,
        "kind": "reward",
        "architecture": arch,
        "model_type": config.get("model_type"),
        "hidden_size": int(config["hidden_size"]),
        "vocab_fingerprint": vocab_fingerprint(tokenizer_tokens(AutoTokenizer.from_pretrained(model_dir))),
        "source": str(model_dir),
        "outtype": outtype,
        "backbone": backbone.name,
        "score_head": "score_head.safetensors",
        "has_bias": "bias" in head,
        # HF's sequence classifier scores the last token that is not padding: the worker does too.
        "pad_token_id": config.get("pad_token_id"),
    }
    tmp = out / f".manifest.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out / "manifest.json")
    return out
