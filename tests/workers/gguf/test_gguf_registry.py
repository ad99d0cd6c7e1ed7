"""The family registry: what is supported, the Gemma query-scale fold and layer pattern (numbers
derived by hand), refused variants, and vocabularies longer or shorter than the embedding."""

from __future__ import annotations

import math

import pytest

from homerlhf.errors import UserError
from homerlhf.workers.gguf.gemma import Gemma2Family, Gemma3Family
from homerlhf.workers.gguf.registry import FAMILIES, SUPPORTED_ARCHS, family_for


def test_every_family_is_an_architecture_llama_cpp_knows():
    import gguf

    assert SUPPORTED_ARCHS == ("gemma2", "gemma3_text", "llama", "mistral", "phi3", "qwen2", "qwen3", "qwen3_moe")
    for family in FAMILIES.values():
        assert family.gguf_arch in gguf.MODEL_ARCH_NAMES.values()


def test_the_planner_table_lists_only_models_the_default_backends_serve():
    """gpt-oss has no GGUF family here: its reference is the policy's base with the adapters off (the presets'
    auto placement), and a run that names the llama.cpp reference for it is refused before it starts."""
    from homerlhf.memory.shapes import BUILTIN_SHAPES
    from homerlhf.stages.preflight import check_exportable

    assert {s.model_type for s in BUILTIN_SHAPES.values()} - set(FAMILIES) == {"gpt_oss"}
    with pytest.raises(UserError, match="set ref.backend=adapter_off"):
        check_exportable({"model_type": "gpt_oss"}, "openai/gpt-oss-20b", "ref", 768)


@pytest.mark.parametrize("family, config, factor", [
    # tiny: head_dim 32, query_pre_attn_scalar 256; llama.cpp scales by 1/sqrt(32) -> fold sqrt(32/256)
    (Gemma3Family(), dict(hidden_size=128, num_attention_heads=4, head_dim=32, num_hidden_layers=4,
                          query_pre_attn_scalar=256), math.sqrt(32 / 256)),
    # Gemma 3 270M: head_dim 256 = query_pre_attn_scalar -> nothing to fold
    (Gemma3Family(), dict(hidden_size=640, num_attention_heads=4, head_dim=256, num_hidden_layers=18,
                          query_pre_attn_scalar=256), 1.0),
    # Gemma 3 27B: llama.cpp knows it by its 62 layers and uses hidden / heads = 168, as HF does
    (Gemma3Family(), dict(hidden_size=5376, num_attention_heads=32, head_dim=128, num_hidden_layers=62,
                          query_pre_attn_scalar=168), 1.0),
    # Gemma 2 27B (46 layers): 4608 / 32 = 144 on both sides
    (Gemma2Family(), dict(hidden_size=4608, num_attention_heads=32, head_dim=128, num_hidden_layers=46,
                          query_pre_attn_scalar=144), 1.0),
    # the same shape with another layer count: llama.cpp would use 1/sqrt(128) -> fold sqrt(128/144)
    (Gemma2Family(), dict(hidden_size=4608, num_attention_heads=32, head_dim=128, num_hidden_layers=8,
                          query_pre_attn_scalar=144), math.sqrt(128 / 144)),
])
def test_gemma_query_scale_fold(family, config, factor):
    assert family.query_correction(config) == pytest.approx(factor, rel=1e-12)


def test_gemma_sliding_layers():
    assert Gemma3Family().sliding_layers({"num_hidden_layers": 7}) == [True] * 5 + [False, True]  # 5 local : 1 global
    assert Gemma2Family().sliding_layers({"num_hidden_layers": 4}) == [True, False, True, False]
    types = ["sliding_attention", "full_attention", "full_attention"]
    assert Gemma3Family().sliding_layers({"layer_types": types, "num_hidden_layers": 3}) == [True, False, False]


@pytest.mark.parametrize("config, words", [
    ({"model_type": "gpt2"}, "architecture 'gpt2' is not supported for GGUF export"),
    ({"model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": 50.0},
     "attention soft-capping is not in llama.cpp's gemma3 graph"),
    ({"model_type": "gemma2", "hidden_activation": "gelu"}, "activation 'gelu' is not supported"),
    ({"model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": False},
     "tie_word_embeddings false"),
    ({"model_type": "qwen2", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope scaling 'llama3'"),
    ({"model_type": "phi3", "hidden_act": "gelu"}, "supported: silu"),
])
def test_refused_variants(config, words):
    with pytest.raises(UserError, match=words):
        family_for(config, "M")


def test_sliding_windows_llama_cpp_does_not_apply():
    assert FAMILIES["mistral"].exact_context({"sliding_window": 4096}) == 4096
    assert FAMILIES["mistral"].exact_context({"sliding_window": None}) is None
    assert FAMILIES["qwen2"].exact_context({"sliding_window": 4096, "use_sliding_window": False}) is None
    assert FAMILIES["phi3"].exact_context({"sliding_window": 2047}) == 2047
    assert FAMILIES["gemma2"].exact_context({"sliding_window": 4096}) is None  # its graph applies it


def _write_vocabulary(path, tokenizer, vocab_size: int):
    """A GGUF holding only the vocabulary, read back."""
    import gguf

    from homerlhf.workers.gguf.tokenizer import add_tokenizer

    writer = gguf.GGUFWriter(str(path), "llama")
    n_real = add_tokenizer(writer, tokenizer, vocab_size)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    fields = gguf.GGUFReader(str(path)).fields
    return n_real, {key: fields[key].contents() for key in fields if key.startswith(("tokenizer.", "homerlhf."))}


def test_tokens_past_the_embedding_are_left_out_when_they_are_added_tokens(tmp_path):
    """Gemma 3's tokenizer has one (added) token more than its embedding rows."""
    from homerlhf.tiny import build_tokenizer
    from homerlhf.workers.vocab import tokenizer_fingerprint

    tok = build_tokenizer()
    tok.add_tokens(["<image_soft_token>"], special_tokens=True)
    n_real, fields = _write_vocabulary(tmp_path / "v.gguf", tok, vocab_size=len(tok) - 1)
    assert n_real == len(tok) - 1 == len(fields["tokenizer.ggml.tokens"]) == fields["homerlhf.tokenizer_size"]
    assert fields["homerlhf.vocab_fingerprint"] == tokenizer_fingerprint(tok)  # of the whole tokenizer
    with pytest.raises(UserError, match="the tokenizer has 513 tokens but the model's embedding only 400"):
        _write_vocabulary(tmp_path / "w.gguf", tok, vocab_size=400)


def test_embedding_rows_past_the_tokenizer_are_unused_tokens(tmp_path):
    from homerlhf.tiny import build_tokenizer

    tok = build_tokenizer()
    n_real, fields = _write_vocabulary(tmp_path / "v.gguf", tok, vocab_size=len(tok) + 64)
    assert n_real == len(tok) and fields["tokenizer.ggml.tokens"][-1] == f"[PAD{len(tok) + 63}]"
    assert fields["tokenizer.ggml.token_type"][-64:] == [5] * 64  # UNUSED
