"""Model names resolved: builtin names built once into the cache, local paths checked, hub ids passed
through (``resolve_model``) or looked up in the hub cache (``resolve_model_dir``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from homerlhf.errors import UserError
from homerlhf.models import registry
from homerlhf.models.registry import cache_key, resolve_model, resolve_model_dir
from homerlhf.paths import cache_dir


def test_tiny_models_are_built_once_and_cached():
    from transformers import AutoConfig

    path = resolve_model("builtin:tiny-qwen2")
    assert os.path.basename(path) == cache_key("tiny-qwen2")
    assert AutoConfig.from_pretrained(path).model_type == "qwen2"
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert resolve_model("builtin:tiny-qwen2") == path
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime
    # nothing half-built of it is left next to it (another process may be building another model there)
    assert not [p for p in os.listdir(os.path.dirname(path)) if p.startswith(".tmp-tiny-qwen2-")]


def test_other_names_pass_through(tmp_path):
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve_model(str(tmp_path)) == str(tmp_path)


@pytest.mark.parametrize("bad, fragment", [
    ("builtin:nope", "unknown builtin model 'builtin:nope'"),
    ("./no/such/dir", "does not exist"),
    ("/no/such/model.gguf", "does not exist"),
])
def test_bad_names_are_one_line_errors(bad, fragment):
    with pytest.raises(UserError, match=fragment) as err:
        resolve_model(bad)
    assert "\n" not in str(err.value)


def test_a_registered_builtin_is_built_once_per_recipe(tmp_path, monkeypatch):
    recipe = tmp_path / "recipe.txt"
    recipe.write_text("one")
    builds = []

    def build(out):
        builds.append(out)
        (out / "model").mkdir()

    monkeypatch.setattr(registry, "_BUILTINS", dict(registry._BUILTINS))
    registry.register_builtin("test-model", build, lambda: [recipe], finish=lambda built: built / "model")
    assert "builtin:test-model" in registry.builtin_names()

    first = resolve_model("builtin:test-model")
    assert first.endswith("/model") and os.path.isdir(first) and len(builds) == 1
    assert resolve_model("builtin:test-model") == first and len(builds) == 1
    recipe.write_text("two")  # a changed recipe never reuses the old build
    second = resolve_model("builtin:test-model")
    assert second != first and len(builds) == 2


def test_a_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def build(out):
        (out / "half-written").write_text("x")
        raise RuntimeError("build failed")

    monkeypatch.setattr(registry, "_BUILTINS", dict(registry._BUILTINS))
    registry.register_builtin("test-broken", build, lambda: [tmp_path / "no-such-recipe"])
    with pytest.raises(RuntimeError, match="build failed"):
        resolve_model("builtin:test-broken")
    assert not [p for p in os.listdir(cache_dir("builtin")) if p.startswith((".tmp-test-broken", "test-broken"))]


def test_resolve_model_dir(tmp_path, tiny_llama_dir):
    assert resolve_model_dir(str(tiny_llama_dir)) == tiny_llama_dir
    assert resolve_model_dir("builtin:tiny-qwen2") == Path(resolve_model("builtin:tiny-qwen2"))
    (tmp_path / "weights.bin").write_text("")
    with pytest.raises(UserError, match="is a file; pass the HF model directory"):
        resolve_model_dir(str(tmp_path / "weights.bin"))
    with pytest.raises(UserError, match="does not exist; check the path"):
        resolve_model_dir(str(tmp_path / "missing"))
    # The suite runs offline: a hub id that is not in the hub cache is one line, not a traceback.
    with pytest.raises(UserError, match="was not found locally and the hub is unreachable") as err:
        resolve_model_dir("homerlhf-tests/no-such-model")
    assert "\n" not in str(err.value)


def test_a_hub_id_that_is_nowhere_is_refused_while_builtins_and_paths_never_ask(monkeypatch):
    monkeypatch.setattr(registry, "hub_unreachable", lambda: "no answer from http://127.0.0.1:1: ConnectError")
    registry.check_available("builtin:tiny-llama")  # builtins and paths never ask the hub
    registry.check_available("./some/local/dir")
    with pytest.raises(UserError, match="'org/model' is neither a local model directory nor in the hub cache, and "
                                        r"the hub cannot be reached \(no answer from"):
        registry.check_available("org/model")
    monkeypatch.setattr(registry, "hub_unreachable", lambda: "")
    registry.check_available("org/model")  # the hub answers: the download decides


def test_gemma3_270m_is_known_from_its_gguf_header_without_building_it(tmp_path, monkeypatch):
    """builtin:gemma3-270m's config and shape come from the package's GGUF header (Gemma-3-270M as
    published: 18 layers of width 640, 4 query heads sharing one KV head of 256, a 262,144-token
    vocabulary, tied embeddings); nothing is built into the cache to know them."""
    pytest.importorskip(registry.GEMMA3_PACKAGE)
    monkeypatch.setenv("HOMERLHF_CACHE", str(tmp_path))  # an empty cache: the suite's may hold a notebook's build
    from homerlhf.memory.shapes import resolve_shape
    from homerlhf.stages.preflight import model_config

    config = model_config("builtin:gemma3-270m")
    assert config["model_type"] == "gemma3_text" and config["architectures"] == ["Gemma3ForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["vocab_size"]) == (18, 640, 4, 1, 256, 262144)
    assert config["tie_word_embeddings"] is True and config["sliding_window"] == 512
    shape = resolve_shape("builtin:gemma3-270m")
    assert (shape.model_type, shape.num_layers, shape.vocab_size) == ("gemma3_text", 18, 262144)
    assert not [p for p in os.listdir(cache_dir("builtin")) if "gemma3" in p]


def test_a_gguf_path_resolves_to_its_import(tmp_path, tiny_llama_dir):
    """A ``.gguf`` model file resolves to an HF directory imported from it (once), which a missing one does not."""
    from homerlhf.workers.gguf.tensors import checkpoint_tensors
    from homerlhf.workers.gguf.writer import write_gguf

    with pytest.raises(UserError, match="does not exist"):
        resolve_model(str(tmp_path / "none.gguf"))
    gguf = write_gguf(tmp_path / "tiny.gguf", Path(tiny_llama_dir), checkpoint_tensors(Path(tiny_llama_dir)), "f32",
                      role="policy", text_use=True)
    resolved = Path(resolve_model(str(gguf)))
    assert resolved.parent == cache_dir("gguf") and resolved.name.startswith("tiny-")
    assert (resolved / "config.json").is_file() and resolve_model_dir(str(gguf)) == resolved
