"""``homerlhf.stages.common`` under fp16 compute (T4/Colab cards): real TRL trainers on a real NF4
tiny model, with the trainable weights the stage hands them (named apart from tests/app/test_common.py).

The HF Trainer autocasts and scales the loss through accelerate, which does neither on a CPU; the
step below runs the same torch.amp operations (fp16 autocast, ``GradScaler``) on the CPU by hand.
"""

from __future__ import annotations

import pytest
import torch

from homerlhf.config import load_config

CHAT = [("Tell me about tea.", "Happy to help! Tea is steeped leaves.", "Tea is boring, go away."),
        ("Share a fact about cats.", "Gladly! Cats sleep most of the day.", "No."),
        ("What do you know about snow?", "Sure. Fresh snow holds air.", "Whatever."),
        ("Tell me about maps.", "Of course. A map shows places from above.", "Maps? Ask someone else.")]


def _sft_trainer(cfg, path, tokenizer, out):
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from homerlhf.data.load import normalise
    from homerlhf.stages.common import load_model, lora_config, trainer_args
    from homerlhf.stages.sft import _dataset

    records, _ = normalise([{"prompt": p, "completion": c} for p, c, _ in CHAT], "sft")
    return SFTTrainer(model=load_model(AutoModelForCausalLM, path, cfg, "qlora"),
                      args=SFTConfig(**trainer_args(cfg.sft, cfg, out), max_length=64, completion_only_loss=True),
                      train_dataset=_dataset(records, tokenizer), processing_class=tokenizer,
                      peft_config=lora_config(cfg.sft, cfg.actor.lora, "CAUSAL_LM"))


def _reward_trainer(cfg, path, tokenizer, out):
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    from homerlhf.stages.common import load_model, lora_config, trainer_args

    def ids(prompt, reply):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                                   {"role": "assistant", "content": reply}],
                                                  tokenize=True, return_dict=False))

    model = load_model(AutoModelForSequenceClassification, path, cfg, "qlora", num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    pairs = {"chosen_ids": [ids(p, c) for p, c, _ in CHAT], "rejected_ids": [ids(p, r) for p, _, r in CHAT]}
    return RewardTrainer(model=model, args=RewardConfig(**trainer_args(cfg.rm, cfg, out), max_length=None),
                         train_dataset=Dataset.from_dict(pairs), processing_class=tokenizer,
                         peft_config=lora_config(cfg.rm, cfg.rm.lora, "SEQ_CLS"))


@pytest.mark.parametrize("stage", ["sft", "rm"])
def test_fp16_compute_trains_fp32_weights_under_autocast_and_a_grad_scaler(stage, tiny_llama_dir, tmp_path):
    from bitsandbytes.nn import Linear4bit

    from homerlhf.stages.common import match_trainable_dtype, open_base, trainer_args

    cfg = load_config("cpu-tiny", overrides=[
        f"model.name_or_path={tiny_llama_dir}", "quant.compute_dtype=fp16", f"{stage}.method=qlora",
        f"{stage}.batch_size=4", "logging.progress=false"])
    section = getattr(cfg, stage)
    assert {k: trainer_args(section, cfg, tmp_path)[k] for k in ("fp16", "bf16")} == {"fp16": False, "bf16": False}
    _, path, tokenizer = open_base(None, section, cfg)
    build = _sft_trainer if stage == "sft" else _reward_trainer
    torch.manual_seed(0)
    trainer = build(cfg, path, tokenizer, tmp_path)
    model = trainer.model
    # TRL casts a 4-bit model's trainable weights to bf16; the stage puts them in fp32 for fp16 compute.
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.bfloat16}
    cast = match_trainable_dtype(model, cfg, "qlora")
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert set(cast) == set(trainable) and {p.dtype for p in trainable.values()} == {torch.float32}
    if stage == "rm":
        assert any("score" in n for n in trainable)  # the score head trains in full, fp32 too
    quantized = [m for m in model.modules() if isinstance(m, Linear4bit)]
    assert quantized and {m.compute_dtype for m in quantized} == {torch.float16}

    # One step as the Trainer takes it on CUDA with fp16=True: autocast, scaled backward, unscale, step.
    optimizer = trainer.create_optimizer()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    before = {n: p.detach().clone() for n, p in trainable.items()}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    model.train()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = trainer.compute_loss(model, batch)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)  # "Attempting to unscale FP16 gradients" with fp16 trainable weights
    scaler.step(optimizer)
    scaler.update()
    assert torch.isfinite(loss) and scaler.get_scale() == 2.0**8  # no overflow: the step was taken
    assert max(float((p.detach() - before[n]).abs().max()) for n, p in trainable.items()) > 0
    moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert len(moments) == 2 * len(trainable) and {t.dtype for t in moments} == {torch.float32}


@pytest.mark.parametrize("upcast", [False, True])
def test_a_qlora_stage_holds_the_base_as_the_policy_does(upcast, tiny_llama_dir):
    """``quant.upcast_non_quantized`` for the SFT and RM stages too: off, the 4-bit base's embeddings and
    norms stay in the compute dtype (the reward adapter later scores on the policy's base held so);
    on, peft's fp32 upcast, as before."""
    from transformers import AutoModelForCausalLM

    from homerlhf.stages.common import load_model

    cfg = load_config("cpu-tiny", overrides=["quant.compute_dtype=bf16", f"quant.upcast_non_quantized={upcast}"])
    model = load_model(AutoModelForCausalLM, str(tiny_llama_dir), cfg, "qlora")
    frozen = torch.float32 if upcast else torch.bfloat16
    assert model.model.embed_tokens.weight.dtype == model.model.norm.weight.dtype == frozen
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("on", [True, False])
def test_the_trl_configs_take_checkpointing_by_its_current_name_without_a_future_warning(on, tmp_path):
    """transformers 5.24+ renamed TrainingArguments' gradient_checkpointing activation_checkpointing (the
    old name warns); the stages pass the name the installed version has, and the setting takes."""
    import dataclasses
    import warnings

    from transformers import TrainingArguments
    from trl import DPOConfig, RewardConfig, SFTConfig

    from homerlhf.stages.common import checkpointing_arg, trainer_args

    current = "activation_checkpointing" in {f.name for f in dataclasses.fields(TrainingArguments)}
    assert checkpointing_arg(on) == {("activation_checkpointing" if current else "gradient_checkpointing"): on}
    cfg = load_config("cpu-tiny", overrides=[f"training.gradient_checkpointing={str(on).lower()}", "sft.method=qlora"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for config_cls in (SFTConfig, RewardConfig, DPOConfig):
            args = config_cls(**trainer_args(cfg.sft, cfg, tmp_path))
            assert args.gradient_checkpointing is on and getattr(args, "activation_checkpointing", on) is on
