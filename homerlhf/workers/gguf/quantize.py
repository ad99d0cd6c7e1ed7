"""Quantized GGUFs made by llama.cpp's own quantizer (``llama_model_quantize``, shipped in
llama-cpp-python), never by one of ours: the k-quant mixes (which tensors get more bits) are
llama.cpp's choice, the same as its ``llama-quantize`` tool makes.

It runs in a child interpreter: a llama.cpp build for another CPU dies by SIGILL, which must become
a one-line error, not the death of the export. Its log drives the progress bar and tells which
tensors it *fell back* on: a k-quant needs rows that split into 256-value blocks, and llama.cpp
writes a tensor whose rows do not in a simpler type (q4_K -> q5_0, q6_K -> q8_0, ...).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from homerlhf.errors import UserError

# Our name -> llama.cpp's ``llama_ftype`` (llama.h: LLAMA_FTYPE_MOSTLY_*).
LLAMA_FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
                "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
QUANT_TYPES = tuple(LLAMA_FTYPES)

_CHILD = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, sys.argv[3])
params.nthread = 0
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params))
sys.stderr.flush()
sys.exit(0 if rc == 0 else 3)
"""
# "[   3/  21] token_embd.weight - [128, 512, 1, 1], type =    f16, converting to q5_0 .. size = ..."
_PROGRESS = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]\s+\S+\s+- \[[^\]]*\], type =\s*(\w+)(?:, converting to (\w+))?")
_FALLBACK = re.compile(r"^warning: (\S+)\s+- ncols .* -> falling back to\s+(\S+)")


@dataclass
class Quantized:
    """A quantized GGUF: its path, the GGML type of every tensor (counted, as llama.cpp's log says it
    wrote them), and the tensors it wrote in a fallback type (name -> type)."""

    path: Path
    types: Counter = field(default_factory=Counter)
    fallbacks: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        counts = ", ".join(f"{n} {t}" for t, n in sorted(self.types.items(), key=lambda kv: -kv[1]))
        line = f"{self.path.name}: {counts}"
        if self.fallbacks:
            line += (f"; {len(self.fallbacks)} tensor(s) whose rows are not a multiple of 256 went to "
                     f"{', '.join(sorted(set(self.fallbacks.values())))} (llama.cpp's fallback)")
        return line


def check_quant_type(name: str) -> None:
    if name not in LLAMA_FTYPES:
        raise UserError(f"quantized type {name!r} is not supported; use one of {', '.join(QUANT_TYPES)}")


def quantize_gguf(source: Path, out_path: Path, name: str) -> Quantized:
    """``source`` (an f32/f16/bf16 GGUF) quantized to ``name`` by llama.cpp, atomically at ``out_path``."""
    from tqdm import tqdm

    from homerlhf.workers.process import signal_death

    check_quant_type(name)
    out_path = Path(out_path)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(source), str(tmp), LLAMA_FTYPES[name]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace")
    fallbacks: dict[str, str] = {}
    types: Counter = Counter()
    tail: list[str] = []
    with tqdm(desc=f"quantize {out_path.name}", unit="tensor", leave=False) as bar:
        for line in proc.stderr:
            if (match := _PROGRESS.match(line)) is not None:
                bar.total = int(match.group(2))
                bar.update(int(match.group(1)) - bar.n)
                types[(match.group(4) or match.group(3)).upper()] += 1
            elif (match := _FALLBACK.match(line)) is not None:
                fallbacks[match.group(1)] = match.group(2)
            if line.strip():
                tail = (tail + [line.strip()])[-5:]
    returncode = proc.wait()
    if returncode != 0:
        tmp.unlink(missing_ok=True)
        death = signal_death(returncode)
        why = f"died by {death.name} ({death.meaning}); {death.fix}" if death else (tail[-1] if tail else f"exit code {returncode}")
        raise UserError(f"llama.cpp's quantizer failed on {Path(source).name} -> {name}: {why}")
    tmp.replace(out_path)
    return Quantized(out_path, types, fallbacks)
