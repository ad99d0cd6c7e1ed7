"""The planner: byte counts checked against real bitsandbytes / torch objects, monotone in batch and
length, every GPU preset fits its card, suggestions fit, JSON complete."""

from __future__ import annotations

import json

import pytest
import torch

from homerlhf.config import load_config, preset_names
from homerlhf.memory.planner import (
    GIB,
    PHASES,
    Assumptions,
    adam_state_bytes,
    apply_overrides,
    compare,
    nf4_bytes_per_param,
    plan,
    predicted_peaks,
    suggest,
)
from homerlhf.memory.shapes import BUILTIN_SHAPES, resolve_shape

QWEN7 = BUILTIN_SHAPES["Qwen/Qwen2.5-7B"]
GPU_PRESETS = [p for p in preset_names() if load_config(p).card.device == "cuda"]


def test_nf4_bytes_match_bitsandbytes():
    import bitsandbytes.functional as F

    weight = torch.randn(512, 1024)
    for double_quant in (True, False):
        packed, state = F.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
        stored = packed.numel() * packed.element_size() + state.absmax.numel() * state.absmax.element_size()
        if double_quant:
            stored += state.state2.absmax.numel() * state.state2.absmax.element_size()
        assert stored == pytest.approx(weight.numel() * nf4_bytes_per_param(double_quant), rel=1e-9)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit", "paged_adamw_8bit"])
def test_optimizer_state_bytes_match_the_real_optimizers(optimizer):
    import bitsandbytes as bnb

    make = {"adamw": torch.optim.AdamW, "adamw_8bit": bnb.optim.AdamW8bit, "paged_adamw_8bit": bnb.optim.PagedAdamW8bit}
    # A LoRA A (16 x 896), B (4864 x 16) and a value head (1 x 896, under the 8-bit size floor).
    params = [torch.nn.Parameter(torch.randn(*s)) for s in [(16, 896), (4864, 16), (1, 896)]]
    opt = make[optimizer](params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    with pytest.warns(UserWarning) if optimizer.startswith("paged") else _nothing():
        opt.step()
    real = sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items()
               if torch.is_tensor(v) and k != "step")
    assert adam_state_bytes([p.numel() for p in params], optimizer) == real


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_saved_activations_match_autograd_on_a_tiny_qlora_model(tmp_path):
    """The update's per-layer formula against the bytes autograd really saves (saved-tensor hooks)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=bnb, device_map="cpu", dtype=torch.bfloat16)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
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
        "training.gradient_checkpointing=false", "actor.lora.r=8", "critic.lora.r=8",
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
def test_estimates_grow_with_batch_and_length(key, values, grows):
    base = load_config("4090", overrides=["ppo.mini_batch_size=16", "rollout.batch_size=128"])
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


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_every_gpu_preset_fits_its_card(preset):
    cfg = load_config(preset)
    result = plan(cfg, resolve_shape(cfg.model.name_or_path))
    assert result.gpu_gib == cfg.card.gpu_gib > 0
    assert result.fits, result.verdict()
    assert result.suggestion is None


def test_suggestion_fits_where_the_preset_does_not():
    cfg = load_config("4090")
    tight = plan(cfg, QWEN7, gpu_gib=11.0)
    assert tight.fits is False and tight.suggestion is not None
    fixed = plan(apply_overrides(cfg, tight.suggestion.overrides), QWEN7, gpu_gib=11.0)
    assert fixed.fits and fixed.peak_gib == pytest.approx(tight.suggestion.peak_gib)
    assert all(arg.count("=") == 1 for arg in tight.suggestion.set_args)
    # 7B weights alone (NF4 + fp32 embeddings) exceed 6 GiB: nothing in the search helps.
    assert suggest(cfg, QWEN7, gpu_gib=6.0) is None
    assert plan(cfg, QWEN7, gpu_gib=6.0).suggestion is None


def test_suggestion_prefers_speed_knobs_over_shorter_sequences():
    cfg = load_config("4090", overrides=["ppo.micro_batch_size=16", "rollout.chunk_size=64", "rollout.batch_size=128",
                                         "ppo.mini_batch_size=64"])
    result = plan(cfg, QWEN7)
    assert result.fits is False
    over = result.suggestion.overrides
    assert "rollout.max_new_tokens" not in over and "rollout.max_prompt_len" not in over
    assert over.get("ppo.micro_batch_size", 16) < 16 or over.get("rollout.chunk_size", 64) < 64


def test_json_is_complete_and_consistent():
    result = plan(load_config("3090"), QWEN7)
    data = json.loads(json.dumps(result.to_dict()))
    for key in ("model", "shape", "preset", "card", "gpu_gib", "settings", "params", "phases", "peak_phase",
                "peak_gib", "fits", "headroom_gib", "verdict", "suggestion", "assumptions", "notes"):
        assert key in data, key
    assert [p["name"] for p in data["phases"]] == list(PHASES)
    for phase in data["phases"]:
        total = sum(c["bytes"] for c in phase["components"])
        assert phase["total_gib"] == pytest.approx(total / GIB, abs=1e-3)
        allocated = sum(c["bytes"] for c in phase["components"] if c["in_allocator"])
        assert phase["allocated_gib"] == pytest.approx(allocated / GIB, abs=1e-3)
        assert {"KV cache", "LoRA actor", "base linear weights (NF4)"} & {c["name"] for c in phase["components"]}
    assert data["peak_gib"] == max(p["total_gib"] for p in data["phases"])
    assert data["params"]["total"] == QWEN7.total_params


def test_cpu_preset_has_no_verdict_and_compare_reports_error():
    cfg = load_config("cpu-tiny")
    result = plan(cfg, resolve_shape(cfg.model.name_or_path))
    assert result.fits is None and result.headroom_gib is None and "no GPU budget" in result.verdict()
    assert not any(c.kind == "overhead" for p in result.phases for c in p.components)
    predicted = result.phase("update").allocated_gib
    rows = compare(result, {"update": predicted * 2})
    assert rows["update"]["error"] == pytest.approx(-0.5, abs=1e-3)


def test_predicted_peaks_for_logging(tmp_path):
    cfg = load_config("4090")
    BUILTIN_SHAPES["Qwen/Qwen2.5-7B"].to_hf_config().save_pretrained(tmp_path)
    peaks = predicted_peaks(cfg, str(tmp_path))
    assert set(peaks) == set(PHASES)
    assert peaks == {p.name: p.allocated_gib for p in plan(cfg, QWEN7).phases}
