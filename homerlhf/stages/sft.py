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
from homerlhf.data.replies import ReplyEncoder
from homerlhf.data.tokens import fit_length
from homerlhf.stages.common import load_model, lora_config, open_base, prepare_out, train_and_save, trainer_args, write_json


def sft_sequence(tokenizer, record, encoder: ReplyEncoder | None = None) -> tuple[list[int], list[int]]:
    """(input ids, completion mask) of one SFT record, in the shape PPO samples and scores.

    The ids are :func:`homerlhf.data.replies.reward_sequence_ids`: the prompt rendered with its
    generation prompt, the reply as the model writes it after that prompt, the turn's end token,
    nothing after it. So the policy learns to write exactly what it will generate and the reward
    model reads, not the template's rendering of a whole dialogue (Qwen3's empty think block before
    the reply, the newline after its end-of-turn token). The mask is 1 from the end of the rendered
    prompt on (every completion turn trains), 0 over the prompt.
    """
    encoder = encoder or ReplyEncoder(tokenizer)  # one for many records: each prompt rendered once
    ids = encoder.sequence_ids(record["prompt"], record["completion"])
    head = encoder.prompt_ids(record["prompt"])
    # where the ids leave the rendered prompt: its end, unless the template renders the prompt
    # differently inside the dialogue
    n_prompt = next((i for i, (a, b) in enumerate(zip(ids, head)) if a != b), min(len(ids), len(head)))
    return ids, [0] * n_prompt + [1] * (len(ids) - n_prompt)


def _dataset(records, tokenizer):
    """Tokenised rows (``input_ids``, ``completion_mask``): TRL trains on them as given."""
    from datasets import Dataset

    encoder = ReplyEncoder(tokenizer)
    rows = [dict(zip(("input_ids", "completion_mask"), sft_sequence(tokenizer, r, encoder))) for r in records]
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
    encoder = ReplyEncoder(tokenizer)
    lengths = [len(encoder.sequence_ids(r["prompt"], r["completion"])) for r in records]
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
