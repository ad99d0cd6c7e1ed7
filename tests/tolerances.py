"""Float tolerances for comparing two computations of one result on different kernel paths (another
batch shape or padding, micro-batches, a chunked log-softmax, a merged weight against its adapter,
another CPU's kernels), derived as tests/README.md says: the dtype's epsilon x the longest reduction
the result goes through x its magnitude.

A reduction of n terms summed in another order moves by up to eps x n x the terms' size. The tiny
models (homerlhf.tiny: 128 wide, a 384-wide MLP) reduce over at most ``TINY_WIDTH`` terms per matmul.
An Intel Xeon with AMX rounds even one 384-long fp32 row product by the batch's row count (1.5e-6
relative, 13 eps; an AMD EPYC gives the same bits). Measured, a tiny Llama's fp32 per-token log-probs
in a padded batch of four against one sequence at a time: 4.8e-7 apart on an AMD EPYC, 9.5e-7 on an
Intel Xeon with AMX, where the bound for |log p| <= 10 is 4.6e-4.
"""

from __future__ import annotations

import torch

FP32_EPS = torch.finfo(torch.float32).eps  # 1.19e-7
TINY_WIDTH = 384  # the tiny models' widest reduction: their MLP (homerlhf.tiny, hidden 128 x 3)


def fp32_bound(magnitude: float, reduction: int = TINY_WIDTH, floor: float = 1.0) -> float:
    """How far two fp32 computations of a result of size ``magnitude`` may lie apart on other kernel
    paths: eps32 x ``reduction`` x ``magnitude``. The size that counts is its terms' (a value near 0 can
    sum terms of size 1), at least ``floor``: 1 for what a tiny model computes from its normalised
    activations; 0 where ``magnitude`` is the terms' own size (a step that is lr x a summed gradient)."""
    return FP32_EPS * reduction * max(floor, float(magnitude))


# llama.cpp (an f32 GGUF, f32 KV cache) against torch on the same weights: its own kernels for every op.
# For the log-probs, logits and scores the tests compare (of size <= 20: |log p| of the tiny vocabularies'
# tokens, the tiny models' logits and reward scores) the bound is fp32_bound(20) = 9.2e-4, and what the
# workers promise (homerlhf/workers/gguf/registry.py) is 1e-3.
LLAMA_CPP_F32 = 1e-3
assert fp32_bound(20) <= LLAMA_CPP_F32
