"""Checkpointing every n-th layer and offloading the checkpointed inputs in the plan
(homerlhf.memory.recompute) against hand-derived bytes and seconds, and the ``auto`` choice
(homerlhf.memory.checkpointing): the fewest recomputed layers, offload only where nothing else fits.

Qwen2.5-7B on the 4090 preset: a micro-batch of 4 x (512 + 256) = 3,072 tokens, h = 3,584, bf16
activations (a = 2), LoRA r 16 on every linear. One layer's saved bytes per token
(components.layer_saved_bytes_per_token), by hand: a (3 I + 4 q + t) + 4 r x 7 linears + 8 h + 4 x the
adapted linears' in-features = 2 x (56,832 + 14,336 + 768) + 448 + 28,672 + 4 x 40,448 = 334,784 B.
"""

from __future__ import annotations

import pytest
import torch

from homerlhf.memory.checkpointing import planned_checkpointing, strides, update_gib
from homerlhf.memory.planner import MARGIN, plan
from homerlhf.memory.shapes import BUILTIN_SHAPES
from homerlhf.memory.timing import Placement, iteration_time

QWEN7 = BUILTIN_SHAPES["Qwen/Qwen2.5-7B"]
MISTRAL24 = BUILTIN_SHAPES["mistralai/Mistral-Small-24B-Base-2501"]
AUTO = ("training.checkpoint_every_n_layers=auto", "training.activation_offload=auto")  # the preset's own
TOKENS, H, PER_LAYER = 4 * 768, 3584, 334_784
INPUT = TOKENS * H * 2  # one layer's input hidden states: 22,020,096 B


def update_components(cfg, shape=QWEN7):
    phase = plan(cfg, shape, with_suggestion=False).phase("update")
    return phase.moment, {c.name: c.bytes for c in phase.components}


def test_every_second_layer_keeps_the_others_activations(preset_named):
    """Every 2: layers 0, 2, ..., 26 checkpointed (14), the 14 others keep all their activations: the 14
    inputs + the last hidden state, and 14 x 3,072 x 334,784 B. At the top kept layer's backward nothing
    is recomputed yet: that moment holds the most."""
    moment, comps = update_components(preset_named("4090", "training.checkpoint_every_n_layers=2",
                                                   "training.activation_offload=false"))
    assert comps["checkpointed layer inputs"] == 15 * INPUT == 330_301_440
    assert comps["saved activations"] == 14 * TOKENS * PER_LAYER == 14_398_390_272  # 13.41 GiB
    # Its peak: the actor loss's backward, whose log-prob buffers (4 x 4 x 64 x 152,064 x 4 = 622,854,144 B)
    # outweigh one layer's backward transients (3,072 x (2 I + 2 h) x 2 = 276,824,064 B).
    assert moment == "actor loss backward" and "recomputed layer" not in comps


def test_every_layer_and_none_are_counted_as_before(preset_named):
    """Every 1 is full checkpointing (29 inputs + one recomputed layer); no checkpointing keeps all 28."""
    _, full = update_components(preset_named("4090", "training.checkpoint_every_n_layers=1",
                                             "training.activation_offload=false"))
    assert full["checkpointed layer inputs"] == 29 * INPUT and full["recomputed layer"] == TOKENS * PER_LAYER
    _, none = update_components(preset_named("4090", "training.gradient_checkpointing=false"))
    assert none["saved activations"] == 28 * TOKENS * PER_LAYER + INPUT


def test_offload_leaves_the_last_hidden_state_and_one_layer_input_on_the_card(preset_named):
    """Offload, every layer: the 28 inputs go to pinned host memory, 28 blocks of 22,020,096 B each
    rounded up to 2**25 (torch's pinned allocator) = 939,524,096 B; the card keeps the last hidden state
    and, at a recompute, that layer's input back from the host: 27 inputs (0.55 GiB) less than without."""
    cfg = preset_named("4090", "training.checkpoint_every_n_layers=1", "training.activation_offload=true")
    result = plan(cfg, QWEN7, with_suggestion=False)
    comps = {c.name: c.bytes for c in result.phase("update").components}
    assert comps["last hidden state"] == comps["layer input back from host"] == INPUT
    assert "checkpointed layer inputs" not in comps
    host = result.workers["activation offload"]
    assert [(c.bytes, c.in_allocator) for c in host] == [(28 * 2**25, False)] and 28 * 2**25 == 939_524_096
    full = plan(preset_named("4090", "training.checkpoint_every_n_layers=1", "training.activation_offload=false"),
                QWEN7, with_suggestion=False)
    assert full.phase("update").allocated_bytes - result.phase("update").allocated_bytes == 27 * INPUT
    assert result.checkpointing["offloaded_bytes_per_forward"] == 28 * INPUT


def test_the_update_time_recomputes_a_share_and_copies_at_the_cards_pcie_rate(preset_named, rates):
    """From the H200's rate (every layer recomputed: 3 + 1 forwards' work): every 2 recomputes 14 of 28
    layers, x 3.5 / 4. Offload, every layer: per pass (actor, critic) 64 sequences x 768 tokens x 28
    layers x h x 2 B each way = 39,460,012,032 B at the RTX 4090's PCIe 4.0 x16 (31.5 GB/s): +1.2527 s."""
    where = Placement("llamacpp", "llamacpp", "hf")

    def update_s(*extra):
        cfg = preset_named("4090", *extra)
        return iteration_time(cfg, rates, where, cores=2, logical=2, shape=QWEN7).update_s

    full = update_s("training.checkpoint_every_n_layers=1", "training.activation_offload=false")
    assert update_s("training.checkpoint_every_n_layers=2", "training.activation_offload=false") == \
        pytest.approx(full * 3.5 / 4, rel=1e-12)
    copies = 2 * 2 * 64 * 768 * 28 * H * 2
    assert copies == 39_460_012_032
    assert update_s("training.checkpoint_every_n_layers=1", "training.activation_offload=true") == \
        pytest.approx(full + copies / 31.5e9, rel=1e-12)


def test_auto_takes_the_fewest_recomputed_layers_that_leave_the_margin(preset_named):
    """The 7B at micro-batch 4: every 2nd layer would keep 13.4 GiB more, over the card: every layer.
    At micro-batch 2 every 10th (layers 0, 10, 20: 3 recomputed) fits with the margin (21.28 of 21.6 GiB)
    and every 14th (2 recomputed, 21.80) does not; at micro-batch 1 one recomputed layer fits."""
    limit = (1 - MARGIN) * 24
    assert strides(28) == [28, 14, 10, 7, 6, 5, 4, 3, 2, 1]
    at4 = preset_named("4090", *AUTO)
    assert planned_checkpointing(at4, QWEN7) == (1, False)
    assert update_gib(at4, QWEN7, 2, False) > limit
    at2 = preset_named("4090", *AUTO, "ppo.micro_batch_size=2")
    assert planned_checkpointing(at2, QWEN7) == (10, False)
    assert update_gib(at2, QWEN7, 10, False) <= limit < update_gib(at2, QWEN7, 14, False)
    info = plan(at2, QWEN7, with_suggestion=False).checkpointing
    assert (info["every_n"], info["checkpointed_layers"], info["offload"], info["every_n_setting"]) == (10, 3, False, "auto")
    assert planned_checkpointing(preset_named("4090", *AUTO, "ppo.micro_batch_size=1"), QWEN7) == (28, False)


def test_auto_offloads_only_where_nothing_else_fits(preset_named):
    """Mistral-Small-24B's update at every layer checkpointed is over the 90% budget; offloading the 40
    inputs brings it under: the plan takes offload, and the fewest recomputed layers with it."""
    cfg = preset_named("4090", *AUTO)
    limit = (1 - MARGIN) * 24
    assert update_gib(cfg, MISTRAL24, 1, False) > limit
    n, offload = planned_checkpointing(cfg, MISTRAL24)
    assert offload and update_gib(cfg, MISTRAL24, n, True) <= limit
    if n > 1:
        assert update_gib(cfg, MISTRAL24, strides(40)[strides(40).index(n) - 1], True) > limit


def test_auto_is_every_layer_without_offload_off_a_gpu():
    from homerlhf.config import load_config

    cpu = load_config("4090", None, ["card.device=cpu", "card.gpu_gib=0"])
    assert planned_checkpointing(cpu, QWEN7) == (1, False)
    assert plan(cpu, QWEN7, with_suggestion=False).checkpointing["checkpointed_layers"] == 28


@pytest.mark.parametrize("setting, message", [
    ("training.checkpoint_every_n_layers=0", "must be >= 1 or auto"),
    ("training.activation_offload=true", "set training.gradient_checkpointing=true"),
])
def test_bad_settings_are_refused_in_one_line(setting, message):
    from homerlhf.config import load_config
    from homerlhf.errors import UserError

    extra = ["training.gradient_checkpointing=false"] if "offload" in setting else []
    with pytest.raises(UserError) as err:
        load_config("cpu-tiny", None, [setting, *extra])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_every_second_layers_saved_bytes_match_autograd_on_a_tiny_qlora_model(tmp_path):
    """Layers 0 and 2 of 4 checkpointed (transformers' every_n_layers=2), LoRA on an NF4 base, bf16 end to
    end (the GPU presets' a = 2): the bytes autograd saves in the forward (saved-tensor hooks: the
    checkpoints' inputs and every tensor layers 1 and 3 keep) against the plan's checkpointed inputs + saved
    activations, within 5% (tests/memory/test_phases.py checks a layer's formula at a = 4 and a = 2)."""
    upcast = False
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig

    from homerlhf.config import load_config
    from homerlhf.memory.shapes import resolve_shape
    from homerlhf.models.activations import checkpointed_flags, enable_checkpointing
    from homerlhf.models.precision import prepare_frozen_base

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=bnb, device_map="cpu", dtype=torch.bfloat16)
    model = prepare_frozen_base(model, load_in_4bit=True, upcast=upcast, checkpointing=True)
    enable_checkpointing(model, every_n=2)
    model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    model.train()
    assert checkpointed_flags(model) == [True, False, True, False]
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
    mask[0, :5] = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.get_base_model().model(input_ids=ids, attention_mask=mask)

    cfg = load_config("cpu-tiny", overrides=[
        f"rollout.max_prompt_len={prompt}", f"rollout.max_new_tokens={new}", f"ppo.micro_batch_size={m}",
        "training.gradient_checkpointing=true", "training.checkpoint_every_n_layers=2", "actor.lora.r=8",
        "critic.lora.r=8", "quant.compute_dtype=bf16", f"quant.upcast_non_quantized={str(upcast).lower()}"])
    update = {c.name: c.bytes for c in plan(cfg, resolve_shape(str(tmp_path))).phase("update").components}
    a = 4 if upcast else 2
    assert update["checkpointed layer inputs"] == 3 * m * (prompt + new) * 256 * a
    predicted = update["checkpointed layer inputs"] + update["saved activations"]
    assert predicted == pytest.approx(sum(saved.values()), rel=0.05)
