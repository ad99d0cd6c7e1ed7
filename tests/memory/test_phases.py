"""The phases' transient memory: saved activations against autograd, monotone in batch and length,
checkpointing and 8-bit optimizers save memory."""

from __future__ import annotations

import pytest
import torch

from homerlhf.config import load_config
from homerlhf.memory.components import GIB
from homerlhf.memory.phases import PHASES
from homerlhf.memory.planner import plan
from homerlhf.memory.search import apply_overrides
from homerlhf.memory.shapes import BUILTIN_SHAPES, resolve_shape

QWEN7 = BUILTIN_SHAPES["Qwen/Qwen2.5-7B"]


@pytest.mark.parametrize("upcast", [True, False])
def test_saved_activations_match_autograd_on_a_tiny_qlora_model(tmp_path, upcast):
    """The update's per-layer formula against the bytes autograd really saves (saved-tensor hooks), with
    the fp32 upcast (a = 4) and with bf16 end to end (a = 2, the norms' and LoRA's fp32 inputs saved)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig

    from homerlhf.models.precision import prepare_frozen_base

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=bnb, device_map="cpu", dtype=torch.bfloat16)
    model = prepare_frozen_base(model, load_in_4bit=True, upcast=upcast, checkpointing=False)
    model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    model.train()
    owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in owned:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    m, prompt, new = 2, 40, 24
    ids = torch.randint(0, 512, (m, prompt + new))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding, as in rollouts
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.get_base_model().model(input_ids=ids, attention_mask=mask)

    cfg = load_config("cpu-tiny", overrides=[
        f"rollout.max_prompt_len={prompt}", f"rollout.max_new_tokens={new}", f"ppo.micro_batch_size={m}",
        "training.gradient_checkpointing=false", "actor.lora.r=8", "critic.lora.r=8", "quant.compute_dtype=bf16",
        f"quant.upcast_non_quantized={str(upcast).lower()}",
    ])
    update = plan(cfg, resolve_shape(str(tmp_path))).phase("update")
    predicted = next(c.bytes for c in update.components if c.name == "saved activations")
    assert predicted == pytest.approx(sum(saved.values()), rel=0.05)


def _totals(cfg, shape=QWEN7):
    p = plan(cfg, shape, with_suggestion=False)
    return {ph.name: ph.total_bytes for ph in p.phases}


@pytest.mark.parametrize(
    "key, values, grows",
    [
        ("ppo.micro_batch_size", [1, 2, 4, 8, 16], {"update"}),
        ("rollout.chunk_size", [1, 2, 4, 8, 16, 32], {"generation", "scoring"}),
        ("rollout.max_prompt_len", [64, 128, 256, 512, 1024], set(PHASES)),
        ("rollout.max_new_tokens", [16, 64, 128, 256, 512], set(PHASES)),
        ("rollout.batch_size", [16, 32, 64, 128], set()),
    ],
)
def test_estimates_grow_with_batch_and_length(key, values, grows, preset_named):
    base = preset_named("4090", "ppo.mini_batch_size=16", "rollout.batch_size=128")
    series = [_totals(apply_overrides(base, {key: v})) for v in values]
    for before, after in zip(series, series[1:]):
        for phase in PHASES:
            assert after[phase] >= before[phase], (key, phase)
            if phase in grows:
                assert after[phase] > before[phase], (key, phase)


def test_checkpointing_and_8bit_optimizer_save_memory():
    cfg = load_config("4090")
    on = plan(cfg, QWEN7).phase("update").total_bytes
    off = plan(apply_overrides(cfg, {"training.gradient_checkpointing": False}), QWEN7).phase("update").total_bytes
    assert off > on + 4 * GIB  # 28 layers of activations vs. layer inputs
    adam = plan(apply_overrides(cfg, {"actor.optimizer": "adamw", "critic.optimizer": "adamw"}), QWEN7)
    paged = plan(apply_overrides(cfg, {"actor.optimizer": "adamw_8bit", "critic.optimizer": "adamw_8bit"}), QWEN7)
    assert adam.phase("update").allocated_bytes > paged.phase("update").allocated_bytes


def test_the_prefill_transients_follow_the_piece():
    """The 4090 preset's Qwen2.5-7B chunk of 64 x 512 prompt tokens, bf16 end to end, LoRA on every
    linear: one layer's prefill transients per token, by hand (components.forward_layer_transient_per_token),
    2 a h + max(attention, MLP) = 2 x 2 x 3584 + (12 x 18944 + 4 x 3584) = 256,000 B, over the tokens of a
    piece of 4096 // 64 = 64 columns, + the causal mask's rows of the piece over the block's 512 keys."""
    def prefill_bytes(*extra):
        cfg = load_config("4090", None, ["rollout.generation_chunk=64", *extra])
        gen = plan(cfg, QWEN7, with_suggestion=False).phase("generation")
        return next(c for c in gen.components if c.name == "prefill activations")

    piece = prefill_bytes()
    assert piece.bytes == 64 * 64 * 256_000 + 64 * 64 * 512 * 2 == 1_052_770_304  # 0.98 GiB
    assert "64 x 64 tokens (a piece of the 64 x 512 block" in piece.note
    assert prefill_bytes("rollout.prefill_tokens=0").bytes == 64 * 512 * 256_000 + 64 * 512 * 512 * 2  # 7.84 GiB
    assert prefill_bytes("rollout.prefill_tokens=8192").bytes == 64 * 128 * 256_000 + 64 * 128 * 512 * 2


def test_the_prefill_moment_holds_the_previous_pieces_logits_not_the_sampling_logits():
    """The sampling logits come after the last layer (the last decode step counts them); HF generate
    keeps each piece's output, its last position's fp32 logits (64 x V x 4 B), through the next piece.
    On the CPU allocator this made the plan of a prefill in pieces 0.988 of the measurement, 0.936 before
    (docs/memory.md, benchmarks/planner_cpu_allocations.py --prefill-tokens 512)."""
    from homerlhf.memory.components import Assumptions
    from homerlhf.memory.phases import generation_phase

    def prefill_moment(*extra):
        # One new token: the decode step's K/V repeat stays below the prefill's transients.
        cfg = load_config("4090", None, ["rollout.generation_chunk=64", "rollout.max_new_tokens=1", *extra])
        moment, comps = generation_phase(cfg, QWEN7, Assumptions(decoder="hf"))
        assert moment == "prefill"
        return {c.name: c.bytes for c in comps}

    pieces, whole = prefill_moment(), prefill_moment("rollout.prefill_tokens=0")
    assert "sampling logits" not in pieces and "sampling logits" not in whole
    assert pieces["previous piece's logits"] == 64 * 152_064 * 4 and "previous piece's logits" not in whole
