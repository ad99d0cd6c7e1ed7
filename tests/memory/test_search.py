"""The search for settings that fit: the suggestion fits, nothing fits when nothing can, and speed knobs
come before shorter sequences."""

from __future__ import annotations

import pytest

from homerlhf.config import load_config
from homerlhf.memory.planner import plan
from homerlhf.memory.search import apply_overrides, suggest
from homerlhf.memory.shapes import BUILTIN_SHAPES

QWEN7 = BUILTIN_SHAPES["Qwen/Qwen2.5-7B"]


def test_suggestion_fits_where_the_preset_does_not():
    cfg = load_config("4090")
    tight = plan(cfg, QWEN7, gpu_gib=11.0)
    assert tight.fits is False and tight.suggestion is not None
    fixed = plan(apply_overrides(cfg, tight.suggestion.overrides), QWEN7, gpu_gib=11.0)
    assert fixed.fits and fixed.peak_gib == pytest.approx(tight.suggestion.peak_gib)
    assert all(arg.count("=") == 1 for arg in tight.suggestion.set_args)
    # 7B weights alone (NF4 + bf16 embeddings and LM head, 5.2 GiB) and the CUDA context leave nothing of 6 GiB:
    # nothing in the search helps.
    assert suggest(cfg, QWEN7, gpu_gib=6.0) is None
    assert plan(cfg, QWEN7, gpu_gib=6.0).suggestion is None


def test_suggestion_prefers_speed_knobs_over_shorter_sequences():
    cfg = load_config("4090", overrides=["ppo.micro_batch_size=16", "rollout.chunk_size=64", "rollout.batch_size=128",
                                         "ppo.mini_batch_size=64", "quant.upcast_non_quantized=true"])
    result = plan(cfg, QWEN7)
    assert result.fits is False
    over = result.suggestion.overrides
    assert "rollout.max_new_tokens" not in over and "rollout.max_prompt_len" not in over
    assert over.get("ppo.micro_batch_size", 16) < 16 or over.get("rollout.chunk_size", 64) < 64
