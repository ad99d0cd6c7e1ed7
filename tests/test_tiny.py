import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from homerlhf.tiny import EOS, build_sequence_classifier, build_tokenizer


def test_tokenizer_is_deterministic_and_round_trips():
    a, b = build_tokenizer(), build_tokenizer()
    text = "Tell me about tea. Happy to help!"
    assert a(text)["input_ids"] == b(text)["input_ids"]
    assert a.decode(a(text)["input_ids"]) == text
    assert a.pad_token_id != a.eos_token_id
    assert a.eos_token == EOS


def test_chat_template_ends_with_generation_prompt():
    tok = build_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>Hi<|end|><|assistant|>"


def _check_causal_lm(path):
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    n_params = sum(p.numel() for p in model.parameters())
    assert 3e5 < n_params < 5e6
    batch = tok(["Tell me about tea.", "Hi"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape[:2] == batch["input_ids"].shape
    assert logits.shape[-1] == len(tok)
    assert torch.isfinite(logits).all()
    return model


def test_tiny_llama_reloads_from_disk(tiny_llama_dir):
    assert _check_causal_lm(tiny_llama_dir).config.model_type == "llama"


def test_tiny_qwen2_reloads_from_disk(tiny_qwen2_dir):
    assert _check_causal_lm(tiny_qwen2_dir).config.model_type == "qwen2"


def test_tiny_sequence_classifier(tmp_path):
    path = build_sequence_classifier(tmp_path / "rm")
    model = AutoModelForSequenceClassification.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        out = model(**tok(["Hello there"], return_tensors="pt")).logits
    assert out.shape == (1, 1)


def test_tiny_qwen3_and_gemma3_text_on_the_builtin_tokenizer(tmp_path):
    from homerlhf.tiny import build_causal_lm

    for arch in ("qwen3", "gemma3_text"):
        model = _check_causal_lm(build_causal_lm(tmp_path / arch, arch=arch, seed=2))
        assert model.config.model_type == arch


def test_real_vocab_models_keep_the_tokenizer_and_the_checkpoint_generation_config(real_vocab_model_dir):
    import json

    expected = {"qwen3": ("qwen3", 151669, [151645, 151643]), "llama3_1": ("llama", 128256, [128001, 128008, 128009]),
                "gemma3": ("gemma3_text", 262145, [1, 106])}
    for name, (model_type, vocab, eos) in expected.items():
        path = real_vocab_model_dir(name)
        config = json.loads((path / "config.json").read_text())
        assert (config["model_type"], config["vocab_size"], config["tie_word_embeddings"]) == (model_type, vocab, True)
        assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == eos
        assert len(AutoTokenizer.from_pretrained(path)) == vocab
