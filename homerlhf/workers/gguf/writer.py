"""Writing one GGUF: hyperparameters, vocabulary and tensors, streamed, atomically renamed into place."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from homerlhf.errors import UserError
from homerlhf.workers.gguf.quant import check_outtype, encode, file_type, tensor_qtype
from homerlhf.workers.gguf.registry import family_for
from homerlhf.workers.gguf.tensors import LazyTensor, read_config
from homerlhf.workers.gguf.tokenizer import add_text_use, add_tokenizer, adds_bos, text_pre_tokenizer

KEY_ROLE = "homerlhf.role"
KEY_SOURCE = "homerlhf.source"


def _load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:
        raise UserError(f"{model_dir}: the tokenizer does not load ({type(exc).__name__}: {exc}); "
                        "the model dir must include it") from None


@contextmanager
def atomic_gguf_writer(out_path: Path, arch: str) -> Iterator:
    """A ``gguf.GGUFWriter`` on a temporary file beside ``out_path``: moved into place when the block
    ends, removed when it raises, so a reader never sees a half-written GGUF."""
    import gguf

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        yield writer
        writer.close()
        os.replace(tmp, out_path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise


def _stream(writer, mapped: dict[str, LazyTensor], outtype: str, label: str) -> None:
    """Tensor infos first, then the data one tensor at a time: memory of one tensor, not the model."""
    import gguf
    from tqdm import tqdm

    plan = []
    for name, tensor in mapped.items():
        qtype = tensor_qtype(outtype, name, tensor.shape)
        n_bytes = int(np.prod(gguf.quants.quant_shape_to_byte_shape(tensor.shape, qtype)))
        writer.add_tensor_info(name, tensor.shape, np.dtype(np.float32), n_bytes, raw_dtype=qtype)
        plan.append((tensor, qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor, qtype in tqdm(plan, desc=f"export {label}", unit="tensor", leave=False):
        writer.write_tensor_data(encode(tensor.load(), qtype))


def write_gguf(
    out_path: Path,
    model_dir: Path,
    tensors: dict[str, LazyTensor],
    outtype: str,
    role: str,
    skip: Callable[[str], bool] = lambda name: False,
    text_use: bool = False,
) -> Path:
    """Writes ``tensors`` (HF names) of the model in ``model_dir`` as one GGUF, atomically.

    ``text_use``: for llama.cpp, Ollama and LM Studio on text (an exported policy), not for a worker
    fed ids: the tokenizer's real pre-tokenizer, BOS setting and chat template (:func:`add_text_use`)."""
    check_outtype(outtype)
    config = read_config(model_dir)
    family = family_for(config, str(model_dir))
    tokenizer = _load_tokenizer(model_dir)
    pre, add_bos = (text_pre_tokenizer(tokenizer), adds_bos(tokenizer)) if text_use else (family.tokenizer_pre, False)
    mapped = family.map_tensors(tensors, config, skip)
    if "token_embd.weight" not in mapped:
        raise UserError(f"{model_dir}: no token embedding (model.embed_tokens.weight) in the checkpoint")
    vocab_size = mapped["token_embd.weight"].shape[0]

    out_path = Path(out_path)
    with atomic_gguf_writer(out_path, family.gguf_arch) as writer:
        # llama.cpp keys tokenizer quirks off general.name (a "phi3" in it demands Phi-3's special
        # tokens); workers never tokenize text, so the name stays neutral and the source is kept aside.
        writer.add_name(f"homerlhf-{role}")
        writer.add_string(KEY_ROLE, role)
        writer.add_string(KEY_SOURCE, str(model_dir))
        writer.add_file_type(file_type(outtype))
        mapped.update(family.add_hparams(writer, config, vocab_size, str(model_dir)))
        add_tokenizer(writer, tokenizer, vocab_size, pre, add_bos)
        if text_use:
            add_text_use(writer, tokenizer)
        _stream(writer, mapped, outtype, out_path.name)
    return out_path
