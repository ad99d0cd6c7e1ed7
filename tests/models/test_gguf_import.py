"""A GGUF as a model: its header read without its tensors, refusals of GGUFs that are no causal LM, and
the import into an HF directory, on GGUFs built here from the tiny Llama (no download, no real checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from homerlhf.errors import UserError
from homerlhf.models.gguf_import import (check_causal_gguf, gguf_chat_template, gguf_config, gguf_header,
                                         gguf_model_dir, import_gguf)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_llama_dir):
    """The tiny Llama as an f32 GGUF with its tokenizer and chat template (as a policy export writes it)."""
    from homerlhf.workers.gguf.tensors import checkpoint_tensors
    from homerlhf.workers.gguf.writer import write_gguf

    out = tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama.gguf"
    return write_gguf(out, Path(tiny_llama_dir), checkpoint_tensors(Path(tiny_llama_dir)), "f32", role="policy",
                      text_use=True)


def header_only_gguf(path: Path, arch: str, kind: str = "model") -> Path:
    """A GGUF of ``arch`` with a ``general.type`` and no tensors: what the checks read, nothing else."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(kind)
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


def test_the_header_gives_the_checkpoints_config(tiny_gguf, tiny_llama_dir):
    config = json.loads((Path(tiny_llama_dir) / "config.json").read_text())
    header = gguf_header(tiny_gguf)
    got = gguf_config(header)
    assert got["model_type"] == "llama" and got["architectures"] == ["LlamaForCausalLM"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "vocab_size", "tie_word_embeddings"):
        assert got[key] == config[key], key
    assert got["head_dim"] == config["hidden_size"] // config["num_attention_heads"]
    # the token strings are counted, not read
    assert header["array_lengths"]["tokenizer.ggml.tokens"] == config["vocab_size"]
    assert "tokenizer.ggml.tokens" not in header["kv"]
    from transformers import AutoTokenizer

    assert gguf_chat_template(header) == AutoTokenizer.from_pretrained(tiny_llama_dir).chat_template


def test_import_gives_the_same_model_tokenizer_and_template(tiny_gguf, tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = import_gguf(tiny_gguf, tmp_path / "imported", chat_template=gguf_chat_template(gguf_header(tiny_gguf)))
    original, imported = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32) for d in (tiny_llama_dir, out))
    ids = torch.tensor([[1, 5, 9, 30, 100, 7, 411]])
    with torch.no_grad():
        # f32 tensors written and read back unchanged, the same modules: the same floats
        assert torch.equal(original(ids).logits, imported(ids).logits)
    tok_a, tok_b = AutoTokenizer.from_pretrained(tiny_llama_dir), AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": "Tell me about tea, please."}]
    assert tok_b.chat_template == tok_a.chat_template
    assert (tok_a.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            == tok_b.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    assert (out / "model.safetensors").is_file()


def test_a_gguf_model_file_is_imported_once(tiny_gguf):
    first = gguf_model_dir(tiny_gguf)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert gguf_model_dir(tiny_gguf) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.parametrize("arch, kind, fragment", [
    ("llama", "adapter", "this GGUF is a LoRA adapter (general.type 'adapter', architecture 'llama'), not a causal "
                         "language model"),
    ("clip", "model", "this GGUF is a vision projector"),
    ("bert", "model", "a GGUF of architecture 'bert', which transformers cannot load from GGUF"),
    ("t5", "model", "architecture 't5' cannot be the policy (a causal LM)"),
], ids=["lora-adapter", "clip", "bert", "t5"])
def test_a_gguf_that_is_no_causal_lm_is_refused_from_its_header(tmp_path, arch, kind, fragment):
    path = header_only_gguf(tmp_path / f"{arch}-{kind}.gguf", arch, kind)
    with pytest.raises(UserError) as info:
        check_causal_gguf(path, str(path))
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_a_file_that_is_no_gguf_is_one_line(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_text("not a gguf\n")
    with pytest.raises(UserError, match="is not a readable GGUF file"):
        gguf_header(path)
