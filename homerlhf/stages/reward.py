"""``homerlhf reward``: a Bradley-Terry reward model with TRL's RewardTrainer, then its GGUF export.

The model is ``AutoModelForSequenceClassification`` (num_labels 1) on the base: with qlora/lora
the base is frozen under a LoRA adapter and the score head trains in full; with ``full`` every
weight trains (tiny models). Loss: ``-log sigmoid(r_chosen - r_rejected)``.

Writes, under the run directory OUT:

- ``adapter/``  peft adapter incl. the score head (methods qlora and lora);
- ``model/``    the merged HF ``*ForSequenceClassification`` (num_labels 1) + tokenizer;
- ``gguf/``     the export for the llama.cpp reward worker (``homerlhf.workers.export``);
- ``reward_run.json``  base model, data reports, counts, held-out pairwise accuracy, time.

``homerlhf train`` takes ``reward.model: OUT`` directly.
"""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from homerlhf.data.load import fit_length, load_preferences, sequence_ids
from homerlhf.stages.common import (
    Timer,
    lora_config,
    load_model,
    match_trainable_dtype,
    load_tokenizer,
    on_cuda,
    prepare_out,
    save_merged,
    train_loss,
    trainer_args,
    write_json,
)


def pair_ids(records, tokenizer, max_len: int) -> dict[str, list[list[int]]]:
    """Preference records -> ``chosen_ids`` / ``rejected_ids`` (prompt + reply), left-truncated.

    Left truncation keeps the end of the reply, where a last-token reward model reads its score.
    """
    return {
        "chosen_ids": [sequence_ids(tokenizer, r["prompt"], r["chosen"])[-max_len:] for r in records],
        "rejected_ids": [sequence_ids(tokenizer, r["prompt"], r["rejected"])[-max_len:] for r in records],
    }


def _fit(records, report, tokenizer, max_len: int, overlong: str):
    lengths = [
        max(len(sequence_ids(tokenizer, r["prompt"], r["chosen"])), len(sequence_ids(tokenizer, r["prompt"], r["rejected"])))
        for r in records
    ]
    return fit_length(records, lengths, max_len, overlong, report)


@torch.no_grad()
def score_ids(model, sequences: Sequence[Sequence[int]], pad_id: int, batch_size: int = 32) -> torch.Tensor:
    """Reward of each token sequence. Returns Shape: (n,) float32.

    Sequences are right-padded; the HF sequence classifier reads the last non-pad token.
    """
    model.eval()
    device = next(model.parameters()).device
    scores = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start : start + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(chunk):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits  # (b, 1)
        scores.append(logits[:, 0].float().cpu())
    return torch.cat(scores)


def pairwise_accuracy(model, pairs: dict[str, list[list[int]]], pad_id: int) -> float:
    """Fraction of pairs where r(chosen) > r(rejected)."""
    chosen = score_ids(model, pairs["chosen_ids"], pad_id)
    rejected = score_ids(model, pairs["rejected_ids"], pad_id)
    return float((chosen > rejected).float().mean())


def export_gguf(run_dir: str | Path, outtype: str = "f16") -> Optional[Path]:
    """Export the RM in ``run_dir`` for the llama.cpp worker into ``run_dir/gguf`` (atomically).

    Returns None, with a warning, when the exporter is not available in this install.
    """
    run_dir = Path(run_dir)
    try:
        from homerlhf.workers.export import export_reward
    except ImportError as exc:
        print(f"[homerlhf] warning: reward GGUF export skipped ({exc})", file=sys.stderr)
        return None
    tmp = Path(tempfile.mkdtemp(prefix=".gguf-", dir=run_dir))
    try:
        export_reward(str(run_dir), tmp, outtype=outtype)
        final = run_dir / "gguf"
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _split(records, fraction: float, seed: int):
    """(train, eval) by a seeded shuffle; eval is empty when fraction is 0."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n_eval = int(round(len(records) * fraction))
    if n_eval >= len(records):
        n_eval = len(records) - 1
    return [records[i] for i in order[n_eval:]], [records[i] for i in order[:n_eval]]


def run_reward(
    cfg,
    out: str | Path,
    data: Optional[str] = None,
    base: Optional[str] = None,
    eval_data: Optional[str] = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Train a reward model on ``data`` from ``base`` (default ``cfg.rm.base`` or the policy model).

    Returns the summary also written to ``OUT/reward_run.json``.
    """
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    from homerlhf.stages.builtin import resolve_model

    from homerlhf.stages.preflight import check_reward_stage

    section = cfg.rm
    check_reward_stage(cfg, base or section.base or cfg.model.name_or_path)  # before anything is trained
    out = prepare_out(Path(out), "reward_run.json", overwrite)
    base_name = base or section.base or cfg.model.name_or_path
    source = data or section.data
    eval_source = eval_data or section.eval_data
    records, report = load_preferences(source, cfg.data)  # bad data fails before a model is built
    base_path = resolve_model(base_name)
    tokenizer = load_tokenizer(base_path, cfg)
    records = _fit(records, report, tokenizer, section.max_len, cfg.data.overlong)
    if eval_source:
        train_records = records
        eval_records, eval_report = load_preferences(eval_source, cfg.data)
        eval_records = _fit(eval_records, eval_report, tokenizer, section.max_len, cfg.data.overlong)
    else:
        train_records, eval_records = _split(records, cfg.data.eval_fraction, cfg.seed)
        eval_report = None
    print(report.summary())
    if eval_report is not None:
        print(eval_report.summary())

    torch.manual_seed(cfg.seed)  # the score head is initialised at random
    model = load_model(AutoModelForSequenceClassification, base_path, cfg, section.method, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    peft_config = None if section.method == "full" else lora_config(section.lora, "SEQ_CLS")
    args = RewardConfig(
        **trainer_args(section, cfg, out),
        max_length=None,  # already left-truncated by pair_ids; TRL would drop over-long pairs instead
        center_rewards_coefficient=section.center_rewards_coef,
        disable_dropout=True,
    )
    trainer = RewardTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict(pair_ids(train_records, tokenizer, section.max_len)),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    if section.method == "qlora":
        match_trainable_dtype(trainer.model, cfg)
    with Timer() as timer:
        result = trainer.train()
    final_loss = train_loss(trainer) or float(result.training_loss)
    eval_pairs = pair_ids(eval_records, tokenizer, section.max_len)
    accuracy = (
        pairwise_accuracy(trainer.model, eval_pairs, tokenizer.pad_token_id) if eval_records else None
    )
    train_accuracy = pairwise_accuracy(
        trainer.model, pair_ids(train_records[:256], tokenizer, section.max_len), tokenizer.pad_token_id
    )

    model_dir = out / "model"
    if section.method == "full":
        trainer.model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    else:
        trainer.model.save_pretrained(out / "adapter")
        tokenizer.save_pretrained(out / "adapter")
        del trainer, model
        if on_cuda(cfg):
            torch.cuda.empty_cache()
        save_merged(
            AutoModelForSequenceClassification, base_path, out / "adapter", model_dir, cfg, tokenizer,
            num_labels=1, pad_token_id=tokenizer.pad_token_id,
        )
    shutil.rmtree(out / "trainer", ignore_errors=True)

    summary = {
        "stage": "reward",
        "base_model": base_name,
        "base_path": base_path,
        "method": section.method,
        "data": report.to_dict(),
        "eval_data": eval_report.to_dict() if eval_report else f"{cfg.data.eval_fraction:g} split of the data",
        "n_train": len(train_records),
        "n_eval": len(eval_records),
        "eval_accuracy": accuracy,
        "train_accuracy": train_accuracy,
        "steps": result.global_step,
        "train_loss": final_loss,
        "mean_train_loss": float(result.training_loss),
        "seconds": timer.seconds,
        "model_dir": str(model_dir),
        "adapter_dir": None if section.method == "full" else str(out / "adapter"),
        "gguf_dir": None,
    }
    write_json(out / "reward_run.json", summary)
    if section.export_gguf:
        summary["gguf_dir"] = _export_after_training(out, cfg.reward.outtype, summary)
        write_json(out / "reward_run.json", summary)
    return summary


def _export_after_training(out: Path, outtype: str, summary: dict) -> Optional[str]:
    """``OUT/gguf``; a failed export keeps the trained model and says how to export it later."""
    from homerlhf.errors import UserError

    try:
        gguf = export_gguf(out, outtype=outtype)
    except (UserError, OSError, ValueError, RuntimeError) as exc:
        summary["gguf_error"] = f"{type(exc).__name__}: {exc}"
        write_json(out / "reward_run.json", summary)
        raise UserError(
            f"the reward model is trained and saved in {out / 'model'}, but its GGUF export failed ({exc}); "
            f"export it later with `homerlhf export reward --model {out} --out {out / 'gguf'}`, "
            "or use it as it is with reward.backend=hf", exit_code=1) from None
    return str(gguf) if gguf else None
