"""The held-out pass of ``homerlhf dpo`` / ``kto`` (homerlhf.stages.preference_eval): its peak on the CPU
allocator within what ``homerlhf plan --algorithm dpo`` counts for it, with a 102,400-row head and rows of
1,024 tokens, and its out-of-memory backoff."""

from __future__ import annotations

import json
import tempfile

import pytest
import torch

from homerlhf.config import load_config
from homerlhf.errors import UserError
from homerlhf.memory.oom import inject_oom_at
from homerlhf.memory.preference import held_out_batch, held_out_phase, preference_plan
from homerlhf.memory.shapes import shape_from_config
from homerlhf.stages.preference_eval import completion_logprobs


def _allocator_peak(fn) -> int:
    """The most bytes CPU tensors made inside ``fn`` held at once: the profiler's allocator events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(open(f"{tmp}/trace.json").read())["traceEvents"]
    return max([e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"] + [0])


def _lora_model(config):
    """The policy as the held-out pass gets it: a peft LoRA (actor.lora of cpu-tiny) on a full-precision base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))


def _rows(n: int, prompt: int, answer: int, vocab: int, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    ids = lambda k: torch.randint(3, vocab, (k,), generator=gen).tolist()  # noqa: E731
    return [{"prompt_ids": ids(prompt), "chosen_ids": ids(answer)} for _ in range(n)]


def test_the_pass_peaks_within_its_plan_with_a_wide_vocabulary_and_1k_token_rows():
    """A 102,400-row head, 2 pairs' chosen answers of 512 tokens after 512-token prompts (dpo.batch_size 1:
    2 rows per forward, ppo.logprob_chunk_size 64: the head over 128 answer tokens at a time). The full
    fp32 logits of one forward would be 2 x 1,024 x 102,400 x 4 B = 800 MiB, and a log-softmax of them as
    much again; the plan's peak is the chunk's logits and logsumexp's temporary, 2 x 128 x 102,400 x 4 B
    = 100 MiB, beside hidden states and indices under 1 MiB. The measured peak is at most the plan's, and
    within 5% of it (the plan counts the chunk's two buffers; smaller tensors move the rest)."""
    from homerlhf.tiny import model_config

    config = model_config("llama", 102_400, hidden=64, layers=1)
    config.max_position_embeddings = 1024
    cfg = load_config("cpu-tiny", overrides=["quant.load_in_4bit=false", "dpo.method=lora", "dpo.batch_size=1",
                                             "dpo.max_len=1024", "ppo.logprob_chunk_size=64"])
    shape = shape_from_config(config, "wide", "local")
    rows, chunk = held_out_batch(cfg, "dpo")
    assert (rows, chunk) == (2, 128)
    moment, transient = held_out_phase(cfg, shape, "dpo")
    planned = sum(c.bytes for c in transient)
    chunk_buffers = next(c for c in transient if c.name == "log-prob chunk")
    assert moment == "answer log-probs" and chunk_buffers.bytes == 2 * 128 * 102_400 * 4
    held_out = preference_plan(cfg, shape, "dpo").phase("held-out pass")
    assert all(c in held_out.components for c in transient)  # `homerlhf plan --algorithm dpo` counts them

    model = _lora_model(config)
    pairs = _rows(2, 512, 512, 102_400)
    warm_up = _rows(1, 8, 8, 102_400, seed=1)  # the kernels' first-call state, outside the measurement
    completion_logprobs(model, warm_up, "chosen_ids", 0, rows, chunk // rows)
    measured = _allocator_peak(lambda: completion_logprobs(model, pairs, "chosen_ids", 0, rows, chunk // rows))
    assert planned * 0.95 <= measured <= planned, (measured, planned)


def test_out_of_memory_halves_the_rows_and_goes_on_from_the_failed_batch(tiny_llama_dir):
    """Out of memory at 4 rows per forward: the pass redoes that batch with 2 and goes on with 2, so its
    batches are those of a pass at 2 rows: the same figures, bit for bit, each row once."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model.train()
    rows = _rows(5, 6, 4, 512, seed=1)
    expected = completion_logprobs(model, rows, "chosen_ids", 0, batch_size=2, chunk_per_row=2)
    with inject_oom_at(micro_batch_size=4) as injector:
        got = completion_logprobs(model, rows, "chosen_ids", 0, batch_size=4, chunk_per_row=2)
    assert injector.raised == [4] and got == expected and len(got) == 5
    assert model.training  # put back as it was
    with inject_oom_at(micro_batch_size=1, times=5), pytest.raises(UserError) as err:
        completion_logprobs(model, rows, "chosen_ids", 0, batch_size=2, fix="lower dpo.max_len")
    assert str(err.value).startswith("out of GPU memory in the held-out pass even with one row per forward")
    assert str(err.value).endswith("; lower dpo.max_len") and err.value.exit_code == 1 and model.training
