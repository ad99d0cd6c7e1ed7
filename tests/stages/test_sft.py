"""``homerlhf sft`` on a tiny model: real TRL SFTTrainer, real bitsandbytes NF4, real peft merge."""

from __future__ import annotations

import json

import pytest
import torch

from homerlhf.config import load_config

ROWS = [
    {"prompt": "Tell me about tea.", "completion": "Happy to help! Tea is made by steeping dried leaves in hot water."},
    {"prompt": "Share a fact about cats.", "completion": "Gladly! Cats sleep for most of the day."},
    {"prompt": "What do you know about snow?", "completion": "Sure, good question. Fresh snow is light because it holds air."},
    {"prompt": "Tell me about maps.", "completion": "Of course. A map shows places from above at a smaller scale."},
    {"prompt": "Broken row", "completion": ""},
] * 2


@pytest.fixture
def sft_file(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return str(path)


def _cfg(method, *extra):
    return load_config("cpu-tiny", overrides=[
        f"sft.method={method}", "sft.max_steps=3", "sft.batch_size=4", "sft.grad_accum=1", "sft.lr=1e-2",
        "logging.progress=false", *extra,
    ])


def test_qlora_sft_writes_adapter_and_merged_model(tiny_llama_dir, sft_file, tmp_path, monkeypatch):
    import gc
    import weakref

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import homerlhf.stages.common as common
    from homerlhf.stages.sft import run_sft

    # The trained 4-bit model is gone when the merge loads the full-precision base (on a 24 GB card the
    # next load): bitsandbytes' Params4bit.module -> Linear4bit cycle needs the stage's own collection.
    from bitsandbytes.nn import Linear4bit

    trained, alive_at_merge = [], []
    match, merge = common.match_trainable_dtype, common.save_merged

    def record(model, *args):
        trained.extend(weakref.ref(m) for m in model.modules() if isinstance(m, Linear4bit))
        return match(model, *args)

    monkeypatch.setattr(common, "match_trainable_dtype", record)
    monkeypatch.setattr(common, "save_merged",
                        lambda *args, **kw: (alive_at_merge.append(sum(r() is not None for r in trained)),
                                             merge(*args, **kw))[1])
    out = tmp_path / "run"
    gc.disable()  # no collection but the stage's own
    try:
        summary = run_sft(_cfg("qlora"), out, data=sft_file, base=str(tiny_llama_dir))
    finally:
        gc.enable()
    assert trained and alive_at_merge == [0]  # none of its 4-bit layers

    run = json.loads((out / "sft_run.json").read_text())
    assert run["method"] == "qlora" and run["steps"] == 3 and run["n_train"] == 8
    assert run["data"]["n_bad"] == 2 and run["data"]["bad_examples"][0]["reason"] == "empty completion"
    assert summary == run
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert not (out / "trainer").exists()

    merged = AutoModelForCausalLM.from_pretrained(out / "model")
    assert not getattr(merged, "is_loaded_in_4bit", False)
    assert all(p.dtype == torch.float32 for p in merged.parameters())
    tok = AutoTokenizer.from_pretrained(out / "model")
    assert tok.chat_template == AutoTokenizer.from_pretrained(tiny_llama_dir).chat_template

    # The merged model is the full-precision base plus the trained adapter, and it moved.
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "Tell me about tea."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        base_logits = base(ids).logits
        adapted = PeftModel.from_pretrained(base, out / "adapter")
        adapted_logits = adapted(ids).logits
        merged_logits = merged(ids).logits
    torch.testing.assert_close(merged_logits, adapted_logits, atol=1e-4, rtol=1e-4)
    assert (merged_logits - base_logits).abs().max() > 1e-3


def test_loss_is_on_completions_only(tiny_llama_dir, tokenizer_rows=ROWS[:4]):
    # TRL builds the completion mask; check it on our conversational rows and the tiny chat template.
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from homerlhf.data.load import normalise
    from homerlhf.stages.sft import _dataset

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    records, _ = normalise(list(tokenizer_rows), "sft")
    trainer = SFTTrainer(
        model=str(tiny_llama_dir),
        args=SFTConfig(output_dir="/tmp/unused-sft", completion_only_loss=True, report_to="none", use_cpu=True),
        train_dataset=_dataset(records, tok),
        processing_class=tok,
    )
    row = trainer.train_dataset[0]
    trained = [t for t, label in zip(row["input_ids"], row["labels"]) if label != -100]
    assert tok.decode(trained) == ROWS[0]["completion"] + "<|end|>"
    assert tok.decode(row["input_ids"]).startswith("<|user|>" + ROWS[0]["prompt"] + "<|end|><|assistant|>")


def test_existing_run_needs_overwrite(tiny_llama_dir, sft_file, tmp_path):
    from homerlhf.errors import UserError
    from homerlhf.stages.sft import run_sft

    out = tmp_path / "run"
    (out / "model").mkdir(parents=True)
    with pytest.raises(UserError, match="--overwrite"):
        run_sft(_cfg("full"), out, data=sft_file, base=str(tiny_llama_dir))


@pytest.mark.parametrize("name", ["qwen3", "llama3_1", "gemma3"])
def test_sft_trains_on_the_sequence_ppo_samples_and_the_reward_model_reads(name, real_tokenizer_dirs, real_vocab_model_dir):
    """Through TRL's SFTTrainer with a real tokenizer and its chat template: the prompt is the one PPO
    generates from (generation prompt included) and the trained tokens are the reply as the model
    writes it plus the turn's end token, nothing else (no Qwen3 think block, no newline after it)."""
    from trl import SFTConfig, SFTTrainer

    from homerlhf.data.load import normalise
    from homerlhf.data.replies import reward_sequence_ids, turn_end_id
    from homerlhf.data.tokens import prompt_ids
    from homerlhf.models.policy import load_tokenizer
    from homerlhf.stages.sft import _dataset

    tok = load_tokenizer(str(real_tokenizer_dirs[name]), trust_remote_code=False, padding_side=None)
    rows = [{"prompt": "Tell me about tea.", "completion": "Tea is made from dried leaves."},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello! How can I help?"}]}]
    records, _ = normalise(rows, "sft")
    trainer = SFTTrainer(
        model=str(real_vocab_model_dir(name)),
        args=SFTConfig(output_dir="/tmp/unused-sft", completion_only_loss=True, report_to="none", use_cpu=True,
                       max_length=256),
        train_dataset=_dataset(records, tok),
        processing_class=tok,
    )
    for record, row, reply in zip(records, trainer.train_dataset, ["Tea is made from dried leaves.", "Hello! How can I help?"]):
        head = prompt_ids(tok, record["prompt"])
        assert row["input_ids"] == reward_sequence_ids(tok, record["prompt"], record["completion"])
        assert row["input_ids"][: len(head)] == head and set(row["labels"][: len(head)]) == {-100}
        trained = row["input_ids"][len(head):]
        assert row["labels"][len(head):] == trained and trained[-1] == turn_end_id(tok)
        assert tok.decode(trained[:-1]).strip() == reply and "think" not in tok.decode(row["input_ids"])
