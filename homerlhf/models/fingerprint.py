"""Which base a model directory holds: its shape and a fingerprint of its weights, read from files.

A LoRA adapter is only meaningful on the weights it was trained on. ``homerlhf reward`` records the
fingerprint of its base (``reward_run.json``: ``base_fingerprint``), and ``reward.backend: adapter``
compares it with the policy base's before any weight is loaded.

The weights part hashes, per ``*.safetensors`` file, its header (every tensor's name, dtype, shape
and offsets) and the first and middle :data:`SAMPLE_BYTES` of every tensor's data: a fine-tune or a
merged LoRA rewrites whole matrices, so it changes those bytes, while a 7B checkpoint costs a few
hundred small reads instead of 15 GB. Other weight files (``*.bin``, ``*.pt``) are hashed by size
and :data:`FILE_SAMPLES` blocks spread over the file.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Optional

from homerlhf.errors import UserError

# Config fields that fix the base's shape (read from the text config of a multimodal checkpoint).
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "num_attention_heads")
SAMPLE_BYTES = 64
FILE_SAMPLES = 16
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _safetensors_digest(path: Path, digest) -> None:
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = f.read(header_len)
        digest.update(header)
        data_start = 8 + header_len
        for name, entry in sorted(json.loads(header).items()):
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            for offset in (begin, begin + (end - begin) // 2):
                f.seek(data_start + offset)
                digest.update(f.read(min(SAMPLE_BYTES, end - offset)))


def _sampled_file_digest(path: Path, digest) -> None:
    size = path.stat().st_size
    digest.update(str(size).encode())
    with path.open("rb") as f:
        for k in range(FILE_SAMPLES):
            f.seek(size * k // FILE_SAMPLES)
            digest.update(f.read(4096))


def weights_hash(model_dir: Path) -> str:
    """sha256 (hex, 16 chars) of the weight files of ``model_dir``, sampled as the module says."""
    files = sorted(p for p in Path(model_dir).iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    if not files:
        raise UserError(f"{model_dir} holds no weight files (*.safetensors or *.bin); give a model directory")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        if path.suffix == ".safetensors":
            _safetensors_digest(path, digest)
        else:
            _sampled_file_digest(path, digest)
    return digest.hexdigest()[:16]


def base_fingerprint(model_dir: str | Path) -> dict:
    """``{model_type, <SHAPE_KEYS>, weights}`` of the model in ``model_dir`` (a local directory)."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise UserError(f"{model_dir} has no config.json; give a model directory")
    raw = json.loads(config_path.read_text())
    text = raw.get("text_config") or raw
    shape = {key: text.get(key) for key in SHAPE_KEYS}
    return {"model_type": raw.get("model_type"), **shape, "weights": weights_hash(model_dir)}


def difference(a: dict, b: dict) -> Optional[str]:
    """The first field that differs between two fingerprints, as ``"<field> <a> vs <b>"``, or None."""
    for key in ("model_type", *SHAPE_KEYS, "weights"):
        if a.get(key) != b.get(key):
            return f"{key} {a.get(key)} vs {b.get(key)}"
    return None
