"""The GGUF tensor types an export writes, and the encoding of float32 data into them."""

from __future__ import annotations

import numpy as np

from homerlhf.errors import UserError

OUTTYPES = ("f32", "f16", "bf16", "q8_0")


def check_outtype(outtype: str) -> None:
    if outtype not in OUTTYPES:
        raise UserError(f"outtype {outtype!r} is not supported; use one of {', '.join(OUTTYPES)}")


def tensor_qtype(outtype: str, name: str, shape: tuple[int, ...]):
    """The GGML type of GGUF tensor ``name`` in an ``outtype`` export."""
    import gguf

    q = gguf.GGMLQuantizationType
    # Norms, biases, rope factors and other vectors stay F32, as llama.cpp's converter keeps them.
    if len(shape) < 2 or outtype == "f32" or name.endswith("_norm.weight") or name.startswith("rope_"):
        return q.F32
    if outtype == "f16":
        return q.F16
    if outtype == "bf16":
        return q.BF16
    block = gguf.GGML_QUANT_SIZES[q.Q8_0][0]
    return q.Q8_0 if shape[-1] % block == 0 else q.F16


def encode(array: np.ndarray, qtype) -> np.ndarray:
    """float32 data -> the bytes (or array) ``GGUFWriter.write_tensor_data`` takes for ``qtype``."""
    import gguf

    q = gguf.GGMLQuantizationType
    array = np.ascontiguousarray(array, dtype=np.float32)
    if qtype == q.F32:
        return array
    if qtype == q.F16:
        return array.astype(np.float16)
    return gguf.quants.quantize(array, qtype)


def file_type(outtype: str):
    import gguf

    f = gguf.LlamaFileType
    return {"f32": f.ALL_F32, "f16": f.MOSTLY_F16, "bf16": f.MOSTLY_BF16, "q8_0": f.MOSTLY_Q8_0}[outtype]
