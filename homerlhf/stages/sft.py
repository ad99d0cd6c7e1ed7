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

from pathlib import Path
from typing import Any, Optional

from homerlhf.data.load import load_sft
from homerlhf.data.tokens import fit_length, render, sequence_ids
from homerlhf.stages.common import load_model, lora_config, open_base, prepare_out, train_and_save, trainer_args, write_json


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

    The LoRA settings are ``actor.lora``: SFT trains the policy, as PPO's actor does after it.
    Returns the summary also written to ``OUT/sft_run.json``.
    """
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from homerlhf.stages.preflight import check_sft_stage

    section = cfg.sft
    check_sft_stage(cfg, base or section.base or cfg.model.name_or_path)  # before anything is trained
    out = prepare_out(Path(out), "sft_run.json", overwrite)
    records, report = load_sft(data or section.data, cfg.data)  # bad data fails before a model is built
    base_name, base_path, tokenizer = open_base(base, section, cfg)
    lengths = [len(sequence_ids(tokenizer, r["prompt"], r["completion"])) for r in records]
    records = fit_length(records, lengths, section.max_len, cfg.data.overlong, report)
    print(report.summary())

    def make_trainer():
        return SFTTrainer(
            model=load_model(AutoModelForCausalLM, base_path, cfg, section.method),
            args=SFTConfig(
                **trainer_args(section, cfg, out),
                max_length=section.max_len,
                truncation_mode="keep_start",  # over-long rows lose the end of the completion, never the prompt
                completion_only_loss=True,
                packing=False,
            ),
            train_dataset=_dataset(records, tokenizer),
            processing_class=tokenizer,
            peft_config=lora_config(section, cfg.actor.lora, "CAUSAL_LM"),
        )

    trained = train_and_save(make_trainer, section.method, cfg, out, base_path, tokenizer, AutoModelForCausalLM)
    summary = {"stage": "sft", "base_model": base_name, "base_path": base_path, "method": section.method,
               "data": report.to_dict(), "n_train": len(records), **trained}
    write_json(out / "sft_run.json", summary)
    return summary
