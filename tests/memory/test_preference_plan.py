"""``homerlhf plan --algorithm dpo|kto``: the memory plan of a DPO / KTO run (homerlhf.memory.preference)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from homerlhf.config import load_config, preset_names
from homerlhf.memory.preference import held_out_moments, preference_plan
from homerlhf.memory.render import shape_for


@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_every_preset_has_a_plan(method):
    for preset in preset_names():
        cfg = load_config(preset)
        plan = preference_plan(cfg, shape_for(cfg), method)
        assert [p.name for p in plan.phases] == ["reference forward", "train step", "held-out pass"], preset
        assert plan.peak_gib > 0 and plan.workers == {}
        assert plan.settings["algorithm"] == method


def test_the_train_step_counts_both_answers_of_each_pair():
    """Qwen2.5-7B (hidden 3584, MLP 18944, 28 layers, 4 KV heads of 128), the 4090 preset's LoRA r=16
    on every linear layer, dpo.batch_size 4 at dpo.max_len 1024 (answers of 512 tokens)."""
    cfg = load_config("4090")
    plan = preference_plan(cfg, shape_for(cfg, "Qwen/Qwen2.5-7B"), "dpo")
    step = {c.name: c for c in plan.phase("train step").components}
    # LoRA parameters per layer: r x (in + out) for q (3584, 3584), k and v (3584, 512), o (3584, 3584),
    # gate and up (3584, 18944), down (18944, 3584): 16 x 90112; 28 layers; fp32 gradients.
    assert step["LoRA grads"].bytes == 16 * 90112 * 28 * 4
    # The layer inputs checkpointing keeps: 2 x 4 sequences (each pair's chosen and rejected answer) x 1024
    # tokens x 3584 x 2 bytes (bf16: the preset computes in bf16, no fp32 upcast), for the 28 layers and
    # the final norm's input.
    assert step["checkpointed layer inputs"].bytes == 2 * 4 * 1024 * 3584 * 2 * 29


def test_the_held_out_pass_is_planned_by_answer_tokens_never_the_full_logits():
    """Qwen2.5-7B (152,064-row head) on the 4090 preset: the held-out pass takes the rows of one training
    forward (2 x dpo.batch_size 4 = 8) and the LM head over 8 x ppo.logprob_chunk_size 64 = 512 answer
    tokens at a time: 2 x 512 x 152,064 x 4 B (the chunk's fp32 logits and logsumexp's temporary),
    0.58 GiB, where the full fp32 logits of 8 rows of 1,024 tokens would be 4.6 GiB apiece. Its peak is then
    the no-grad forward's, as the reference forward's without the last step's gradients."""
    cfg = load_config("4090")
    shape = shape_for(cfg, "Qwen/Qwen2.5-7B")
    plan = preference_plan(cfg, shape, "dpo")
    moments = {name: {c.name: c for c in comps} for name, comps in held_out_moments(cfg, shape, "dpo").items()}
    assert moments["answer log-probs"]["log-prob chunk"].bytes == 2 * 512 * 152_064 * 4
    # The rows' 8 x 1,024 tokens of hidden states in bf16, whole in the forward, the answers' gathered after.
    assert moments["forward"]["hidden states"].bytes == 8 * 1024 * 3584 * 2
    assert moments["answer log-probs"]["answer hidden states"].bytes == 8 * 1023 * 3584 * 2
    held_out = plan.phase("held-out pass")
    assert held_out.moment == "forward" and all(c in held_out.components for c in moments["forward"].values())
    assert held_out.total_bytes < plan.phase("reference forward").total_bytes and plan.peak.name == "train step"
    assert "held-out pass: 8 rows per forward, the LM head over 512 answer tokens at a time" in " ".join(plan.notes)


def test_a_plan_that_does_not_fit_gets_a_suggestion_that_fits():
    cfg = load_config("3060-12g", overrides=["dpo.batch_size=16", "dpo.grad_accum=1"])
    plan = preference_plan(cfg, shape_for(cfg, "Qwen/Qwen2.5-7B"), "dpo")
    assert plan.fits is False and plan.suggestion is not None
    sug = plan.suggestion.overrides
    assert sug["dpo.batch_size"] < 16 and sug["dpo.batch_size"] * sug["dpo.grad_accum"] == 16  # same rows per step
    applied = load_config("3060-12g", overrides=["dpo.batch_size=16", "dpo.grad_accum=1", *plan.suggestion.set_args])
    assert preference_plan(applied, shape_for(applied, "Qwen/Qwen2.5-7B"), "dpo").fits


def test_the_cli_plans_dpo_for_the_4090():
    from homerlhf.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", "--algorithm", "dpo", "--preset", "4090", "--model", "Qwen/Qwen2.5-7B"])
    text = out.getvalue()
    assert "Memory plan (dpo): Qwen/Qwen2.5-7B" in text and "train step: peak at" in text
    assert "OK: " in text or "TIGHT: " in text or "NO: " in text
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", "--algorithm", "kto", "--preset", "4090", "--model", "Qwen/Qwen2.5-7B", "--json"])
    assert [p["name"] for p in json.loads(out.getvalue())["phases"]] == ["reference forward", "train step",
                                                                         "held-out pass"]
