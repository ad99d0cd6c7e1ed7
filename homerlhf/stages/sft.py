"""``homerlhf sft``: supervised fine-tuning with TRL's SFTTrainer, loss on completions only.

Writes, under the run directory OUT:

- ``adapter/``   the peft LoRA adapter (methods qlora and lora);
- ``model/``     the full model (LoRA merged into the full-precision base) + tokenizer, loadable with
  ``AutoModelForCausalLM.from_pretrained``; this is what ``model.name_or_path`` and
  ``rm.base`` take;
- ``sft_run.json`` base model, method, data report, counts, final loss, time.

Method ``full`` trains every weight: a tiny randomly initialised model (the builtin demo) cannot
learn language through a low-rank adapter alone.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Optional

from homerlhf.data.load import fit_length, load_sft, render, sequence_ids
from homerlhf.stages.common import (
    Timer,
    lora_config,
    load_model,
    match_trainable_dtype,
    load_tokenizer,
    prepare_out,
    save_merged,
    train_loss,
    trainer_args,
    write_json,
)


def _dataset(records, tokenizer):
    """Conversational prompt/completion rows (TRL applies the chat template), or text without one."""
    from datasets import Dataset

    if getattr(tokenizer, "chat_template", None):
        return Dataset.from_list(records)
    rows = []
    for r in records:
        prompt = render(tokenizer, r["prompt"], add_generation_prompt=True)
        full = render(tokenizer, r["prompt"] + r["completion"])
        rows.append({"prompt": prompt, "completion": full[len(prompt):]})
    return Dataset.from_list(rows)


def run_sft(
    cfg,
    out: str | Path,
    data: Optional[str] = None,
    base: Optional[str] = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Fine-tune ``base`` (default ``cfg.sft.base`` or ``cfg.model.name_or_path``) on ``data``.

    Returns the summary also written to ``OUT/sft_run.json``.
    """
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from homerlhf.stages.builtin import resolve_model

    from homerlhf.stages.preflight import check_sft_stage

    section = cfg.sft
    check_sft_stage(cfg, base or section.base or cfg.model.name_or_path)  # before anything is trained
    out = prepare_out(Path(out), "sft_run.json", overwrite)
    base_name = base or section.base or cfg.model.name_or_path
    source = data or section.data
    records, report = load_sft(source, cfg.data)  # bad data fails before a model is built
    base_path = resolve_model(base_name)
    tokenizer = load_tokenizer(base_path, cfg)
    lengths = [len(sequence_ids(tokenizer, r["prompt"], r["completion"])) for r in records]
    records = fit_length(records, lengths, section.max_len, cfg.data.overlong, report)
    print(report.summary())

    model = load_model(AutoModelForCausalLM, base_path, cfg, section.method)
    peft_config = None if section.method == "full" else lora_config(cfg.actor.lora, "CAUSAL_LM")
    args = SFTConfig(
        **trainer_args(section, cfg, out),
        max_length=section.max_len,
        truncation_mode="keep_start",  # over-long rows lose the end of the completion, never the prompt
        completion_only_loss=True,
        packing=False,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=_dataset(records, tokenizer),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    if section.method == "qlora":
        match_trainable_dtype(trainer.model, cfg)
    with Timer() as timer:
        result = trainer.train()
    final_loss = train_loss(trainer) or float(result.training_loss)

    model_dir = out / "model"
    if section.method == "full":
        trainer.model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    else:
        trainer.model.save_pretrained(out / "adapter")
        tokenizer.save_pretrained(out / "adapter")
        del trainer, model
        save_merged(AutoModelForCausalLM, base_path, out / "adapter", model_dir, cfg, tokenizer)
    shutil.rmtree(out / "trainer", ignore_errors=True)

    summary = {
        "stage": "sft",
        "base_model": base_name,
        "base_path": base_path,
        "method": section.method,
        "data": report.to_dict(),
        "n_train": len(records),
        "steps": result.global_step,
        "train_loss": final_loss,
        "mean_train_loss": float(result.training_loss),
        "seconds": timer.seconds,
        "model_dir": str(model_dir),
        "adapter_dir": None if section.method == "full" else str(out / "adapter"),
    }
    write_json(out / "sft_run.json", summary)
    return summary
