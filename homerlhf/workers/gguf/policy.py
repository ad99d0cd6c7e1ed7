"""An exported policy as GGUF for llama.cpp, Ollama and LM Studio, and the Ollama ``Modelfile`` beside it.

``f32``/``f16``/``bf16`` are written by :mod:`.writer` from the merged HF directory (each weight
rounded once, to the type); the quantized types by llama.cpp's own quantizer (:mod:`.quantize`) from
a GGUF in the merged model's dtype (f32, f16 or bf16). Unlike a worker export, the GGUF is
made for text: llama.cpp's pre-tokenizer of the tokenizer, its BOS setting and the chat template in
``tokenizer.chat_template`` (:func:`.tokenizer.add_text_use`).

The Modelfile has no ``TEMPLATE``: an Ollama template is a Go template, and nothing here can run
Go's engine to prove it renders the prompt the chat template renders (see :data:`MODELFILE_NOTE`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from homerlhf.errors import UserError
from homerlhf.workers.gguf.quantize import QUANT_TYPES, quantize_gguf
from homerlhf.workers.gguf.registry import family_for
from homerlhf.workers.gguf.tensors import checkpoint_tensors, read_config
from homerlhf.workers.gguf.tokenizer import text_pre_tokenizer
from homerlhf.workers.gguf.writer import write_gguf

WRITTEN_TYPES = ("f32", "f16", "bf16")
POLICY_GGUF_TYPES = WRITTEN_TYPES + QUANT_TYPES

MODELFILE_NOTE = (
    "# No TEMPLATE: Ollama's templates are Go templates, and homerlhf cannot prove one renders the\n"
    "# prompt this model's chat template renders. Recent Ollama versions pick a template from the\n"
    "# chat template stored in the GGUF (tokenizer.chat_template) for model families they know;\n"
    "# llama.cpp (llama-cli --jinja, llama-server --jinja) and LM Studio apply that chat template itself.\n"
)


@dataclass
class PolicyGGUF:
    """One written GGUF: its type, path, tensor types (counted) and llama.cpp's fallbacks, if any."""

    outtype: str
    path: Path
    modelfile: Path
    summary: str


def parse_types(values: Sequence[str]) -> list[str]:
    """``--gguf`` values (repeatable, or comma-separated) -> the known types, in order, once each."""
    types: list[str] = []
    for value in values:
        for name in (v.strip().lower() for v in str(value).split(",")):
            if not name:
                continue
            if name not in POLICY_GGUF_TYPES:
                raise UserError(f"--gguf {name!r} is not a type homerlhf exports; use one of {', '.join(POLICY_GGUF_TYPES)}")
            if name not in types:
                types.append(name)
    return types


def check_policy_gguf(base_dir: Path, tokenizer=None) -> None:
    """The checks a GGUF of this model needs, from its config.json and tokenizer alone: an
    architecture the writer serves (before the tokenizer loads: that reads the config through
    transformers), a tokenizer whose text llama.cpp splits as HF does."""
    family_for(read_config(base_dir), str(base_dir))
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(base_dir)
    text_pre_tokenizer(tokenizer)


def stop_tokens(tokenizer, stop_ids: Sequence[int]) -> list[str]:
    """The stop ids as the text Ollama's ``PARAMETER stop`` matches (special tokens spelled out)."""
    return [tokenizer.decode([int(i)], skip_special_tokens=False) for i in stop_ids]


def modelfile_text(gguf_name: str, stop_tokens: Sequence[str]) -> str:
    """An Ollama Modelfile for the GGUF ``gguf_name`` beside it: ``FROM`` and one ``PARAMETER stop``
    per stop token (the chat template's end of turn and the model's EOS)."""
    lines = [f"FROM ./{gguf_name}", MODELFILE_NOTE.rstrip("\n")]
    for token in stop_tokens:
        lines.append(f"PARAMETER stop {json.dumps(token, ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


def _quant_source(model_dir: Path, out_dir: Path, name: str, written: dict[str, Path]) -> tuple[Path, bool]:
    """The GGUF llama.cpp quantizes from, in the merged model's own dtype (f32 for a float32 model, f16
    for float16, else bf16): the export's own if it writes one, else a temporary one (True: remove it
    afterwards)."""
    dtype = json.loads((model_dir / "config.json").read_text()).get("dtype")
    kind = {"float32": "f32", "float16": "f16"}.get(dtype, "bf16")
    if kind in written:
        return written[kind], False
    path = out_dir / f".{name}-{kind}.source.gguf"
    return write_gguf(path, model_dir, checkpoint_tensors(model_dir), kind, role="policy", text_use=True), True


def export_policy_gguf(model_dir: Path, out_dir: Path, types: Sequence[str], name: str,
                       stop_tokens: Sequence[str], on_type=None) -> list[PolicyGGUF]:
    """Writes ``out_dir/<name>-<type>.gguf`` and ``out_dir/Modelfile.<type>`` for each type of the
    merged HF model in ``model_dir``. ``on_type(type)``: called as each type starts (progress)."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    done: list[PolicyGGUF] = []
    source: Optional[tuple[Path, bool]] = None
    try:
        for outtype in sorted(types, key=lambda t: t not in WRITTEN_TYPES):  # unquantized first: sources
            if on_type is not None:
                on_type(outtype)
            path = out_dir / f"{name}-{outtype}.gguf"
            if outtype in WRITTEN_TYPES:
                written[outtype] = write_gguf(path, model_dir, checkpoint_tensors(model_dir), outtype,
                                              role="policy", text_use=True)
                summary = f"{path.name}: {outtype.upper()} matrices, F32 norms and vectors"
            else:
                source = source or _quant_source(model_dir, out_dir, name, written)
                summary = quantize_gguf(source[0], path, outtype).summary()
            modelfile = out_dir / f"Modelfile.{outtype}"
            modelfile.write_text(modelfile_text(path.name, stop_tokens))
            done.append(PolicyGGUF(outtype, path, modelfile, summary))
    finally:
        if source is not None and source[1]:
            source[0].unlink(missing_ok=True)
    order = {t: i for i, t in enumerate(types)}
    return sorted(done, key=lambda g: order[g.outtype])
