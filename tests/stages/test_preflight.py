"""Check first: each role's backend is checked against config.json alone, before any weight is read.

Every model dir here holds a config.json and a *garbage* weights file: a check that read weights
would fail with a load error instead of the one line asserted.
"""

from __future__ import annotations

import json

import pytest

from homerlhf.config import load_config
from homerlhf.errors import UserError
from homerlhf.stages.preflight import check_auto_choices, check_reward_stage, check_run, check_sft_stage


def config_dir(root, name: str, **config):
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"not weights")
    return path


@pytest.fixture
def dirs(tmp_path):
    """config.json-only model dirs of the architectures the checks tell apart."""
    from homerlhf.tiny import model_config

    def tiny(arch, **extra):
        values = model_config(arch, 512).to_dict()
        values.pop("transformers_version", None)
        return {**values, **extra}

    return {
        "gpt2": config_dir(tmp_path, "gpt2", model_type="gpt2", architectures=["GPT2LMHeadModel"]),
        "gpt2-rm": config_dir(tmp_path, "gpt2-rm", model_type="gpt2", architectures=["GPT2ForSequenceClassification"]),
        "internlm2": config_dir(tmp_path, "internlm2", model_type="internlm2", architectures=["InternLM2ForCausalLM"],
                                auto_map={"AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"}),
        "t5": config_dir(tmp_path, "t5", model_type="t5", architectures=["T5ForConditionalGeneration"]),
        "gemma3": config_dir(tmp_path, "gemma3", **tiny("gemma3_text")),
        "gemma2-untied": config_dir(tmp_path, "gemma2-untied", **tiny("gemma2", tie_word_embeddings=False)),
        "mistral-window": config_dir(tmp_path, "mistral-window", **tiny("mistral", sliding_window=32)),
    }


def cfg_with(**overrides):
    return load_config("cpu-tiny", overrides=[f"{k}={v}" for k, v in overrides.items()])


def refusal(call) -> str:
    with pytest.raises(UserError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_the_default_run_and_supported_models_pass(dirs):
    check_run(cfg_with())  # builtin names: known without building them
    check_run(cfg_with(**{"model.name_or_path": dirs["gemma3"]}))
    check_run(cfg_with(**{"model.name_or_path": dirs["mistral-window"], "rollout.max_prompt_len": 16,
                          "rollout.max_new_tokens": 16}))


def test_an_architecture_the_ref_worker_cannot_serve_names_the_switch(dirs):
    message = refusal(lambda: check_run(cfg_with(**{"model.name_or_path": dirs["gpt2"]})))
    assert message.startswith(f"{dirs['gpt2']}: architecture 'gpt2' cannot be served by the llama.cpp ref worker")
    assert "gemma2, gemma3_text, llama, mistral, phi3, qwen2, qwen3" in message
    assert message.endswith("set ref.backend=adapter_off (the policy base with its adapters off is the reference)")
    check_run(cfg_with(**{"model.name_or_path": dirs["gpt2"], "ref.backend": "adapter_off"}))  # the switch works


def test_a_policy_the_llamacpp_rollout_engine_cannot_run_names_the_switch(dirs):
    adapter_off = {"model.name_or_path": dirs["gpt2"], "ref.backend": "adapter_off"}
    message = refusal(lambda: check_run(cfg_with(**adapter_off, **{"rollout.engine": "llamacpp"})))
    assert message.startswith(f"{dirs['gpt2']}: architecture 'gpt2' cannot be served by the llama.cpp rollout engine")
    assert message.endswith("set rollout.engine=hf (the actor samples with its own generate)")
    check_run(cfg_with(**adapter_off))  # the switch works (hf is the default)
    check_run(cfg_with(**{"model.name_or_path": dirs["gemma3"], "rollout.engine": "llamacpp"}))


def test_what_auto_chose_is_checked_after_it_chose_and_nothing_else(dirs):
    """``auto`` is no backend to check: once resolved, the roles it placed are (a gpt2 policy exported for the
    llama.cpp reference or engine is refused), and a config whose roles were named is not checked again."""
    gpt2 = {"model.name_or_path": dirs["gpt2"]}
    before = cfg_with(**gpt2, **{"ref.backend": "auto", "rollout.engine": "auto"})
    check_auto_choices(before, cfg_with(**gpt2, **{"ref.backend": "adapter_off", "rollout.engine": "hf"}))
    message = refusal(lambda: check_auto_choices(before, cfg_with(**gpt2, **{"ref.backend": "llamacpp"})))
    assert "cannot be served by the llama.cpp ref worker" in message
    message = refusal(lambda: check_auto_choices(before, cfg_with(**gpt2, **{"ref.backend": "adapter_off",
                                                                            "rollout.engine": "llamacpp"})))
    assert "cannot be served by the llama.cpp rollout engine" in message
    named = cfg_with(**gpt2, **{"ref.backend": "llamacpp"})  # check_run's to refuse, not this check's
    check_auto_choices(named, named)


def test_a_reward_model_the_worker_cannot_serve_names_the_switch(dirs):
    message = refusal(lambda: check_run(cfg_with(**{"reward.model": dirs["gpt2-rm"]})))
    assert "architecture 'gpt2' cannot be served by the llama.cpp reward worker" in message
    assert "set reward.backend=hf" in message
    check_run(cfg_with(**{"reward.model": dirs["gpt2-rm"], "reward.backend": "hf"}))


def test_the_presets_builtin_reward_model_as_an_adapter_is_refused_before_it_is_built(monkeypatch):
    """builtin:demo-rm is a full fine-tune with its own export (registered llamacpp and hf): as
    reward.backend=adapter it is refused by its registration, nothing built."""
    from homerlhf.models import registry

    monkeypatch.setattr(registry, "resolve_model", lambda *a, **k: pytest.fail("built a builtin model"))
    message = refusal(lambda: check_run(cfg_with(**{"reward.backend": "adapter"})))
    assert message.startswith("reward.model builtin:demo-rm is a reward model of its own (it runs on llamacpp or hf), "
                              "not a LoRA on the policy's base: reward.backend=adapter needs one trained with "
                              "rm.method=qlora or lora")


def test_architectures_the_policy_cannot_load(dirs):
    message = refusal(lambda: check_run(cfg_with(**{"model.name_or_path": dirs["internlm2"]})))
    assert "architecture 'internlm2' is not in transformers" in message and "model.trust_remote_code=true" in message
    message = refusal(lambda: check_run(cfg_with(**{"model.name_or_path": dirs["t5"], "ref.backend": "adapter_off"})))
    assert "architecture 't5' cannot be the policy (a causal LM)" in message and "AutoModelForCausalLM" in message
    assert "cannot be the policy" in refusal(lambda: check_sft_stage(cfg_with(), str(dirs["t5"])))


def test_a_variant_the_export_cannot_write(dirs):
    message = refusal(lambda: check_run(cfg_with(**{"model.name_or_path": dirs["gemma2-untied"]})))
    assert "tie_word_embeddings false" in message and message.endswith("is the reference)")


def test_a_sliding_window_llama_cpp_does_not_apply(dirs):
    """Mistral's window (32 here) is exact only within it: 48 + 56 tokens per sequence is refused."""
    message = refusal(lambda: check_run(cfg_with(**{"model.name_or_path": dirs["mistral-window"]})))
    assert "mistral's sliding window of 32 tokens is not applied by llama.cpp's llama graph" in message
    assert "sequences here reach 104 tokens" in message and "ref.backend=adapter_off" in message


def test_reward_stage_checks_the_export_before_training(dirs):
    message = refusal(lambda: check_reward_stage(cfg_with(), str(dirs["gpt2"])))
    assert "architecture 'gpt2' is not supported for GGUF export" in message
    assert message.endswith("set rm.export_gguf=false and use the reward model with reward.backend=hf")
    check_reward_stage(cfg_with(**{"rm.export_gguf": "false"}), str(dirs["gpt2"]))


def test_a_gguf_reference_must_exist(tmp_path):
    message = refusal(lambda: check_run(cfg_with(**{"ref.model": tmp_path / "none.gguf"})))
    assert message == f"ref.model {tmp_path / 'none.gguf'} does not exist; give an existing .gguf file"


def test_a_model_that_is_nowhere_is_refused_at_once_when_the_hub_cannot_be_reached(monkeypatch):
    """Neither a local dir nor in the hub cache, offline: refused before the run starts, in well under
    the download's retries, naming the key and the way out; while the hub answers it is left to the
    download."""
    import time

    from homerlhf.models import registry

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    start = time.monotonic()
    message = refusal(lambda: check_run(cfg_with(**{"model.name_or_path": "Qwen/Qwen2.5-7B"})))
    assert time.monotonic() - start < 2.0
    assert message.startswith("model.name_or_path: 'Qwen/Qwen2.5-7B' is neither a local model directory nor in "
                              "the hub cache, and the hub cannot be reached (HF_HUB_OFFLINE is set)")
    assert "builtin:<name>" in message and "hf download Qwen/Qwen2.5-7B" in message
    message = refusal(lambda: check_run(cfg_with(**{"reward.backend": "hf", "reward.model": "org/rm"})))
    assert message.startswith("reward.model: 'org/rm' is neither")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr(registry, "hub_unreachable", lambda: "")  # the hub answers: the download decides
    check_run(cfg_with(**{"model.name_or_path": "Qwen/Qwen2.5-7B", "ref.backend": "adapter_off"}))


def _with_tokenizer(path, template: bool):
    """The tiny tokenizer saved into a model dir, with its chat template or without one."""
    from homerlhf.tiny import build_tokenizer

    tok = build_tokenizer()
    if not template:
        tok.chat_template = None
    tok.save_pretrained(path)
    return path


def test_a_policy_whose_tokenizer_has_no_chat_template_is_refused(dirs):
    from homerlhf.stages.preflight import check_chat_template

    gemma3 = {"model.name_or_path": dirs["gemma3"]}
    check_run(cfg_with(**gemma3))  # no tokenizer files: nothing to tell from here
    _with_tokenizer(dirs["gemma3"], template=False)
    message = refusal(lambda: check_run(cfg_with(**gemma3)))
    assert message.startswith(f"model.name_or_path: {dirs['gemma3']}'s tokenizer has no chat template")
    assert "set one (a chat_template.jinja in the model dir" in message and "or use a chat model" in message
    (dirs["gemma3"] / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")  # the fix it names
    check_run(cfg_with(**gemma3))
    _with_tokenizer(dirs["mistral-window"], template=True)
    check_chat_template(str(dirs["mistral-window"]), "model.name_or_path")  # in tokenizer_config.json


def test_a_gguf_policy_is_checked_from_its_header(tmp_path):
    """A ``.gguf`` policy: a LoRA adapter's GGUF is no model, a GGUF without a chat template has none to
    render prompts with; neither imports anything (the cache stays empty)."""
    import os
    from pathlib import Path

    import gguf

    def header_only_gguf(path, arch, kind="model"):
        writer = gguf.GGUFWriter(str(path), arch)
        writer.add_type(kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        return path

    adapter = header_only_gguf(tmp_path / "lora.gguf", "llama", "adapter")
    message = refusal(lambda: check_run(cfg_with(**{"model.name_or_path": adapter})))
    assert message.startswith(f"model.name_or_path {adapter}: this GGUF is a LoRA adapter")
    assert message.endswith("not a causal language model; give the base model's .gguf or its HF directory")
    bare = header_only_gguf(tmp_path / "bare.gguf", "llama")
    message = refusal(lambda: check_run(cfg_with(**{"model.name_or_path": bare, "ref.backend": "adapter_off"})))
    assert "tokenizer has no chat template (no tokenizer.chat_template in the GGUF)" in message
    assert not (Path(os.environ["HOMERLHF_CACHE"]) / "gguf").exists() or not any(
        (Path(os.environ["HOMERLHF_CACHE"]) / "gguf").glob("bare-*"))


def test_a_model_too_big_for_the_machine_by_the_plan(tmp_path):
    """A 4-bit 32B (config.json only) on a CPU preset against 16 GiB of RAM, and on the 4090's 24 GiB (where
    no setting fits it: docs/memory.md): one line each with the plan's figures; the tiny models pass."""
    from homerlhf.memory.shapes import builtin_shape
    from homerlhf.stages.preflight import check_memory

    shape = builtin_shape("Qwen/Qwen2.5-32B")
    big = config_dir(tmp_path, "big", **shape.to_hf_config().to_dict())
    cpu = cfg_with(**{"model.name_or_path": big, "ref.backend": "adapter_off"})
    message = refusal(lambda: check_memory(cpu, ram_gib=16))
    assert message.startswith(f"{big} does not fit this machine's memory by the plan: the trainer's peak ")
    assert "exceed the 16.0 GiB of RAM; choose a smaller model" in message
    check_memory(cfg_with(), ram_gib=16)  # the tiny demo models
    gpu = load_config("4090", overrides=[f"model.name_or_path={big}", "data.prompts=x.jsonl"])
    message = refusal(lambda: check_memory(gpu))
    assert message.startswith(f"{big} does not fit RTX 4090 (24 GiB) by the memory plan: peak ")
    assert message.endswith("choose a smaller model or a larger card (`homerlhf plan` shows each component)")
