"""Model shapes: the table's parameter counts equal those of the real architectures (meta device),
the published counts, and peft's LoRA counts; local dirs and the hub cache resolve offline."""

from __future__ import annotations

import json

import pytest
import torch

from homerlhf.errors import UserError
from homerlhf.memory.shapes import BUILTIN_SHAPES, ModelShape, builtin_shape, resolve_shape, shape_from_config


def _meta_model(shape: ModelShape):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(shape.to_hf_config())


@pytest.mark.parametrize("name", list(BUILTIN_SHAPES))
def test_param_count_equals_meta_model(name):
    shape = BUILTIN_SHAPES[name]
    model = _meta_model(shape)
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    # The quantized part is exactly the decoder's nn.Linear weights (the LM head stays unquantized).
    linear = sum(
        m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n
    )
    assert shape.linear_weight_params == linear
    # Independent of transformers: the model card's count (rounded there to 2-3 digits).
    assert shape.total_params / 1e9 == pytest.approx(shape.published_params_b, rel=0.01)


@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-0.5B", "microsoft/Phi-3-mini-4k-instruct", "google/gemma-2-9b"])
def test_lora_count_equals_peft(name):
    from peft import LoraConfig, get_peft_model

    shape = BUILTIN_SHAPES[name]
    peft_model = get_peft_model(_meta_model(shape), LoraConfig(r=8, target_modules="all-linear"))
    lora = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    assert shape.lora_params(8) == lora


def test_lora_subset_and_bad_targets():
    shape = BUILTIN_SHAPES["Qwen/Qwen2.5-7B"]
    # q (3584 -> 3584) and v (3584 -> 512), r=4, 28 layers
    assert shape.lora_params(4, ["q_proj", "v_proj"]) == 28 * 4 * (3584 + 3584 + 3584 + 512)
    with pytest.raises(UserError, match="match no linear layer"):
        shape.lora_params(4, ["c_attn"])


@pytest.mark.parametrize(
    "typed, canonical",
    [
        ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B"),
        ("qwen2.5-7b", "Qwen/Qwen2.5-7B"),
        ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B"),
        ("meta-llama/Meta-Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B"),
        ("mistralai/Mistral-7B-Instruct-v0.3", "mistralai/Mistral-7B-v0.3"),
        ("mistralai/Mistral-7B", "mistralai/Mistral-7B-v0.1"),
        ("mistralai/Mistral-Small-24B-Instruct-2501", "mistralai/Mistral-Small-24B-Base-2501"),
        ("google/gemma-2-9b-it", "google/gemma-2-9b"),
        ("microsoft/Phi-3-mini-4k-instruct", "microsoft/Phi-3-mini-4k-instruct"),
        ("Qwen/Qwen3-14B", "Qwen/Qwen3-14B"),
    ],
)
def test_table_accepts_base_and_instruct_ids(typed, canonical):
    shape = builtin_shape(typed)
    assert shape is not None and shape == BUILTIN_SHAPES[canonical]
    resolved = resolve_shape(typed)
    assert resolved.name == typed and resolved.total_params == shape.total_params


@pytest.mark.parametrize("name", ["google/gemma-2-9b", "microsoft/Phi-3-mini-4k-instruct", "Qwen/Qwen3-8B", "Qwen/Qwen2.5-3B"])
def test_local_config_round_trip(tmp_path, name):
    table = BUILTIN_SHAPES[name]
    table.to_hf_config().save_pretrained(tmp_path)
    local = resolve_shape(str(tmp_path))
    assert local.source == "local"
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "tie_word_embeddings", "attention_bias", "qk_norm",
                "norms_per_layer", "fused_qkv", "fused_gate_up"):
        assert getattr(local, key) == getattr(table, key), key
    assert resolve_shape(str(tmp_path / "config.json")).total_params == table.total_params


def test_hub_cache_is_read_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    snapshot = tmp_path / "models--acme--tiny-7b" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "models--acme--tiny-7b" / "refs").mkdir()
    (tmp_path / "models--acme--tiny-7b" / "refs" / "main").write_text("abc123")
    cfg = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}
    (snapshot / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    shape = resolve_shape("acme/tiny-7b")
    assert shape.source == "hub-cache" and shape.num_layers == 3 and shape.head_dim == 16
    assert shape.tie_word_embeddings is False  # llama's default


def test_builtin_tiny_model():
    shape = resolve_shape("builtin:demo-sft")
    assert shape.source == "builtin-tiny" and shape.model_type == "llama" and shape.hidden_size == 128


def test_unknown_model_is_one_clear_line():
    with pytest.raises(UserError) as info:
        resolve_shape("acme/not-a-model-9b")
    msg = str(info.value)
    assert "\n" not in msg and "Qwen2.5-7B" in msg and "local dir" in msg


def test_bad_configs(tmp_path):
    with pytest.raises(UserError, match="mixture of experts 'mixtral' is not supported"):
        shape_from_config({"model_type": "mixtral", "num_local_experts": 8}, "m", "local")
    with pytest.raises(UserError, match="mlp_only_layers"):
        shape_from_config({**BUILTIN_SHAPES["Qwen/Qwen3-30B-A3B"].to_hf_config().to_dict(), "mlp_only_layers": [0]},
                          "m", "local")
    with pytest.raises(UserError, match="lacks"):
        shape_from_config({"model_type": "llama", "hidden_size": 8}, "m", "local")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot read"):
        resolve_shape(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no config.json"):
        resolve_shape(str(empty))
