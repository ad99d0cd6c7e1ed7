"""The two exports the workers serve.

- :func:`export_ref`: a causal LM as one GGUF. ``from_nf4=True`` exports the *dequantized NF4
  weights* the actor trains on, so the reference is KL-consistent with the actor at step 0.
- :func:`export_reward`: a sequence classifier (num_labels 1) as ``backbone.gguf`` (the decoder
  without its LM head), ``score_head.safetensors`` (weight ``[1, H]``, bias ``[1]`` if any) and
  ``manifest.json``; the worker computes ``score_head · h_last (+ bias)``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np

from homerlhf.errors import UserError
from homerlhf.workers.gguf.quant import check_outtype
from homerlhf.workers.gguf.registry import family_for
from homerlhf.workers.gguf.tensors import checkpoint_tensors, nf4_tensors, read_config
from homerlhf.workers.gguf.writer import write_gguf
from homerlhf.workers.vocab import tokenizer_tokens, vocab_fingerprint

if TYPE_CHECKING:  # pragma: no cover
    from homerlhf.config.schema import QuantConfig

FORMAT_VERSION = 1


def _is_classifier(config: dict) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or [])


def _model_dir(model: str) -> Path:
    from homerlhf.models.registry import resolve_model_dir

    return resolve_model_dir(str(model))


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
    check_outtype(outtype)
    model_dir = _model_dir(model)
    config = read_config(model_dir)
    family_for(config, str(model_dir))  # before any weight is read
    if _is_classifier(config):
        raise UserError(f"{model_dir} is a sequence classifier; export it with `homerlhf export reward`")
    if from_nf4 and quant is not None and not quant.load_in_4bit:
        from_nf4 = False
    tensors = nf4_tensors(model_dir, quant, device) if from_nf4 else checkpoint_tensors(model_dir)
    if "lm_head.weight" not in tensors and not config.get("tie_word_embeddings", False):
        raise UserError(f"{model_dir} has no lm_head.weight; export ref needs a causal LM checkpoint")
    return write_gguf(Path(out_path), model_dir, tensors, outtype, role="ref")


def reward_model_dir(model: str) -> Path:
    """The HF seqcls checkpoint for ``model``: the dir itself, or ``RUN_DIR/model`` of a reward run."""
    path = _model_dir(model)
    if not (path / "config.json").exists() and (path / "model" / "config.json").exists():
        return path / "model"
    return path


def _write_head(out: Path, tensors) -> dict:
    from safetensors.numpy import save_file

    head = {"weight": tensors["score.weight"].load().astype(np.float32)}
    if "score.bias" in tensors:
        head["bias"] = tensors["score.bias"].load().astype(np.float32).reshape(1)
    tmp = out / f".score_head.tmp-{os.getpid()}"
    save_file(head, str(tmp))
    os.replace(tmp, out / "score_head.safetensors")
    return head


def export_reward(model: str, out_dir: str | Path, outtype: str = "f16") -> Path:
    """Exports a reward model to ``out_dir`` (backbone.gguf, score_head.safetensors, manifest.json)."""
    from transformers import AutoTokenizer

    check_outtype(outtype)
    model_dir = reward_model_dir(model)
    config = read_config(model_dir)
    family = family_for(config, str(model_dir))
    if not _is_classifier(config):
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
    head = _write_head(out, tensors)
    manifest = {
        "format_version": FORMAT_VERSION,
        "kind": "reward",
        "architecture": family.gguf_arch,
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
