"""Log-probabilities of chosen tokens from a (n, vocab) float32 logits block, in row chunks.

A 150k-token vocabulary makes the logits of 1,024 positions a 620 MB float32 block (llama.cpp's
own output buffer, read in place); a float64 copy of it would be 1.2 GB more, and one more for
``exp``. Here each chunk of rows is copied once, in float32, and every step works in that copy: the
transient never exceeds ``chunk_bytes`` (plus per-row vectors). float32 is ample: the logits are
float32 already, and the log-sum-exp of shifted values (all <= 0) loses ~1e-6 nats at most.
"""

from __future__ import annotations

import numpy as np

from homerlhf.memory.host import LOGSOFTMAX_CHUNK_BYTES


def chunk_rows(vocab: int, chunk_bytes: int = LOGSOFTMAX_CHUNK_BYTES) -> int:
    """Rows of ``vocab`` float32 logits per chunk: as many as fit ``chunk_bytes``, at least 1."""
    return max(1, chunk_bytes // (4 * vocab))


def token_logprobs(logits: np.ndarray, targets: np.ndarray, temperature: float = 1.0,
                   chunk_bytes: int = LOGSOFTMAX_CHUNK_BYTES) -> np.ndarray:
    """``log_softmax(logits[i] / temperature)[targets[i]]`` for every row ``i``; ``logits`` is only read.

    logits: (n, V) float32 (any strides, e.g. a view of llama.cpp's buffer). targets: (n,) ints.
    Returns (n,) float64.
    """
    n, vocab = logits.shape
    targets = np.asarray(targets, dtype=np.int64)
    out = np.empty(n, dtype=np.float64)
    if n == 0:
        return out
    step = min(n, chunk_rows(vocab, chunk_bytes))
    buffer = np.empty((step, vocab), dtype=np.float32)  # the one transient block, reused by every chunk
    for start in range(0, n, step):
        end = min(n, start + step)
        x = np.divide(logits[start:end], np.float32(temperature), out=buffer[: end - start])  # (c, V)
        x -= x.max(axis=1, keepdims=True)  # log_softmax(x) = (x - m) - log(sum(exp(x - m)))
        picked = x[np.arange(end - start), targets[start:end]].astype(np.float64)  # (c,)
        np.exp(x, out=x)
        out[start:end] = picked - np.log(x.sum(axis=1, dtype=np.float64))
    return out
