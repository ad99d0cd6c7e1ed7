"""The generation chunk the memory plan affords: the 4090 / Qwen2.5-7B plan by hand, the cap at the
batch, the margin, and a run whose other phases already sit above the margin."""

from __future__ import annotations

import pytest

from homerlhf.config import load_config
from homerlhf.memory.chunks import planned_generation_chunk
from homerlhf.memory.components import GIB, kv_bytes_per_token
from homerlhf.memory.planner import plan
from homerlhf.memory.shapes import BUILTIN_SHAPES

QWEN7 = BUILTIN_SHAPES["Qwen/Qwen2.5-7B"]


def test_the_4090_plan_of_qwen25_7b_generates_the_whole_batch_at_once_within_the_card():
    cfg = load_config("4090")  # rollout.generation_chunk: auto; batch 64, 512 + 256 tokens; bf16 end to end
    # K and V x 28 layers x 4 KV heads x 128 x 2 bytes: the k/v projections of a 4-bit base return their
    # input's dtype, the bf16 residual stream. 56 KiB a token, 42 MiB a 768-token sequence.
    assert kv_bytes_per_token(QWEN7, 2) == 2 * 28 * 4 * 128 * 2 == 57_344
    assert planned_generation_chunk(cfg, QWEN7) == 64  # the batch: the cap
    p = plan(cfg, QWEN7)
    assert p.generation["chunk"] == p.settings["rollout.generation_chunk"] == 64
    gen = {c.name: c.bytes for c in p.phase("generation").components}
    # The static cache of the captured decode loop, allocated before the prefill: 64 x 768 tokens.
    assert gen["KV cache (static)"] == 64 * 768 * 57_344  # 2.62 GiB
    assert p.phase("generation").total_gib <= 0.9 * 24 and p.status == "fits"
    # The prompt block is prefilled in pieces of 4096 // 64 = 64 columns (rollout.prefill_tokens): the
    # prefill's layer transients are those of 64 x 64 tokens. Uncapped (a batch of 512) 224 at once,
    # the HF decode step's K/V repeat the limit; the next multiple of 8 would eat into the margin.
    assert gen["prefill activations"] < 1.0 * GIB
    large = load_config("4090", None, ["rollout.batch_size=512"])
    assert planned_generation_chunk(large, QWEN7) == 224
    above = plan(load_config("4090", None, ["rollout.batch_size=512", "rollout.generation_chunk=232"]), QWEN7)
    assert above.phase("generation").total_gib > 0.9 * 24
    # Prefilled in one forward (rollout.prefill_tokens=0), its transients over 72 x 512 tokens cap it at 72.
    one = ["rollout.batch_size=512", "rollout.prefill_tokens=0"]
    assert planned_generation_chunk(load_config("4090", None, one), QWEN7) == 72
    above = plan(load_config("4090", None, one + ["rollout.generation_chunk=80"]), QWEN7)
    assert above.phase("generation").total_gib > 0.9 * 24 and above.phase("generation").moment.startswith("prefill")
    # Scoring and the update keep their own sizes: the same bytes as with the chunk of 16.
    sixteen = plan(load_config("4090", None, ["rollout.generation_chunk=16"]), QWEN7)
    for name in ("scoring", "update"):
        assert p.phase(name).total_bytes == sixteen.phase(name).total_bytes


def test_with_the_fp32_upcast_and_one_prefill_forward_the_4090_plan_of_qwen25_7b_generates_40_prompts_at_once():
    # quant.upcast_non_quantized: fp32 residual stream, K/V at 4 bytes (112 KiB a token); the prompt
    # block prefilled in one forward (rollout.prefill_tokens=0): the plan before issue 35.
    named = ["quant.upcast_non_quantized=true", "rollout.prefill_tokens=0"]
    cfg = load_config("4090", None, named)
    assert planned_generation_chunk(cfg, QWEN7) == 40
    gen = {c.name: c.bytes for c in plan(cfg, QWEN7).phase("generation").components}
    assert gen["KV cache (static)"] == 40 * 768 * 114_688  # 3.28 GiB
    above = plan(load_config("4090", None, named + ["rollout.generation_chunk=48"]), QWEN7)
    assert above.phase("generation").total_gib > 0.9 * 24
    # In pieces (the default) the upcast plan reaches the batch, 64.
    assert planned_generation_chunk(load_config("4090", None, named[:1]), QWEN7) == 64


@pytest.mark.parametrize("preset, model, batch, chunk", [
    ("a100-80g", "Qwen/Qwen2.5-0.5B", 20, 20),  # everything fits: the whole batch at once, not 16
    ("4090", "Qwen/Qwen2.5-0.5B", 4, 4),  # below 8: the batch
    ("cpu-tiny", None, 32, 16),  # no GPU budget: the configured chunk
])
def test_the_chunk_is_capped_at_the_batch_and_is_the_configured_one_on_a_cpu(preset, model, batch, chunk):
    cfg = load_config(preset, None, [f"rollout.batch_size={batch}", f"ppo.mini_batch_size={min(batch, 4)}",
                                     "ppo.micro_batch_size=1", "rollout.generation_chunk=auto"])
    shape = BUILTIN_SHAPES[model] if model else None
    if shape is None:
        from homerlhf.memory.render import shape_for

        shape = shape_for(cfg)
    assert planned_generation_chunk(cfg, shape) == chunk


def test_with_other_phases_above_the_margin_the_chunk_may_reach_their_peak_but_not_raise_it():
    # Workers on llama.cpp, a 14.5 GiB card: scoring peaks at 14.09 GiB, more than 90% of the card.
    named = ["ref.backend=llamacpp", "reward.backend=llamacpp", "quant.upcast_non_quantized=true"]
    auto = load_config("4090", None, named)
    p = plan(auto, QWEN7, 14.5, with_suggestion=False)
    chunk = p.generation["chunk"]
    scoring = p.phase("scoring").total_bytes
    assert scoring > 0.9 * 14.5 * GIB and p.status == "tight"
    assert p.phase("generation").total_bytes <= scoring  # the peak stays where it was
    bigger = plan(load_config("4090", None, named + [f"rollout.generation_chunk={chunk + 8}"]), QWEN7, 14.5,
                  with_suggestion=False)
    assert bigger.phase("generation").total_bytes > scoring and chunk >= 8
