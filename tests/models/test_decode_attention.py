"""The decode step's attention (:mod:`homerlhf.models.decode_attention`): each KV head's query group
folded into the query axis gives HF's attention on padded and unpadded rows (fp32, GQA: 4 query heads
on 2 KV heads, tiny Llama and Qwen2), and the step allocates nothing the size of the cache repeated
to every query head (transformers 5.17's sdpa does, on every layer, whenever a mask is given)."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from homerlhf.models.decode_attention import NAME, folded_decode_attention
from homerlhf.models.static_decode import DecodeBuffers, decode_step, prefill
from tolerances import fp32_bound

PROMPTS = {"unpadded": ([[5, 6, 7, 8], [9, 10, 11, 12]], [[1, 1, 1, 1], [1, 1, 1, 1]]),
           "padded": ([[0, 0, 7, 8], [9, 10, 11, 12]], [[0, 0, 1, 1], [1, 1, 1, 1]])}
CACHE = 64  # slots: the repeated cache (B x 4 heads x 64 x 16 fp32) is larger than any other tensor of a step


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def gqa_model(request):
    from transformers import AutoModelForCausalLM

    from homerlhf.tiny import model_config

    config = model_config(request.param, 512, hidden=64, layers=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@torch.no_grad()
def _step_logits(model, ids, mask, attention: str, steps=((20, 21), (30, 31))):
    """The fp32 logits (B, V) of each decode step after a prefill of ``ids``, feeding ``steps``' tokens,
    with ``attention``: "folded" (the static loop's), or HF's "sdpa" / "eager" (repeat_kv + matmul)."""
    config = model.config
    saved = config._attn_implementation
    config._attn_implementation = "sdpa" if attention == "folded" else attention
    try:
        with folded_decode_attention(model) if attention == "folded" else torch.no_grad():
            assert config._attn_implementation == (NAME if attention == "folded" else attention)
            bufs = DecodeBuffers(model, ids.shape[0], CACHE, ids.device)
            out = [prefill(model, bufs, ids, mask)]
            step = decode_step(model, bufs)
            for t, tokens in enumerate(steps):
                bufs.feed(torch.tensor(tokens), ids.shape[1] + t)
                step()
                bufs.positions.add_(1)
                out.append(bufs.logits.clone())
    finally:
        config._attn_implementation = saved
    return torch.stack(out)


@pytest.mark.parametrize("rows", sorted(PROMPTS))
def test_folded_attention_equals_hf_attention(gqa_model, rows):
    ids, mask = (torch.tensor(x) for x in PROMPTS[rows])
    folded = _step_logits(gqa_model, ids, mask, "folded")
    for reference in ("eager", "sdpa"):
        want = _step_logits(gqa_model, ids, mask, reference)
        gap = (folded - want).abs().max().item()
        print(f"{gqa_model.config.model_type} {rows}: max |folded - {reference}| {gap:.2e}")
        assert gap <= fp32_bound(want.abs().max())  # other attention kernels (tests/tolerances.py)
    assert gqa_model.config._attn_implementation == "sdpa"  # switched back


class LargestAllocation(TorchDispatchMode):
    """The largest storage an op allocates (not a view or an in-place result: those share an input's)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:  # new memory
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def _largest_in_step(model, fold: bool) -> int:
    ids, mask = (torch.tensor(x) for x in PROMPTS["padded"])
    bufs = DecodeBuffers(model, 2, CACHE, ids.device)
    with torch.no_grad(), folded_decode_attention(model) if fold else torch.no_grad():
        prefill(model, bufs, ids, mask)
        bufs.feed(torch.tensor([20, 21]), ids.shape[1])
        with LargestAllocation() as meter:
            decode_step(model, bufs)()
    return meter.largest


def test_the_step_never_repeats_the_cache_to_every_query_head(gqa_model):
    import transformers.integrations.sdpa_attention as hf_sdpa

    config = gqa_model.config
    head_dim = config.hidden_size // config.num_attention_heads
    repeated = 2 * config.num_attention_heads * CACHE * head_dim * 4  # (B, H, L, D) fp32
    largest = _largest_in_step(gqa_model, fold=True)
    print(f"largest allocation of a folded step: {largest} B; the repeated cache: {repeated} B")
    assert largest < repeated
    if not hasattr(hf_sdpa, "pack_gqa"):  # transformers < 5.2x: HF's own sdpa repeats K/V under a mask
        assert _largest_in_step(gqa_model, fold=False) >= repeated
