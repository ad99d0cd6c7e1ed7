"""``homerlhf reward``: a Bradley-Terry reward model with TRL's RewardTrainer, then its GGUF export.

The model is ``AutoModelForSequenceClassification`` (num_labels 1) on the base: with qlora/lora
the base is frozen under a LoRA adapter and the score head trains in full; with ``full`` every
weight trains (tiny models). Loss: ``-log sigmoid(r_chosen - r_rejected)``.

Writes, under the run directory OUT:

- ``adapter/``  peft adapter incl. the score head (methods qlora and lora);
- ``model/``    the merged HF ``*ForSequenceClassification`` (num_labels 1) + tokenizer;
- ``gguf/``     the export for the llama.cpp reward worker (``homerlhf.workers.gguf``);
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

from homerlhf.data.load import load_preferences
from homerlhf.data.tokens import fit_length, sequence_ids
from homerlhf.ppo.rollout import pad_sequences
from homerlhf.stages.common import load_model, lora_config, open_base, prepare_out, train_and_save, trainer_args, write_json


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
        ids, mask = pad_sequences(sequences[start : start + batch_size], pad_id, side="right", device=device)
        logits = model(input_ids=ids, attention_mask=mask).logits  # (b, 1)
        scores.append(logits[:, 0].float().cpu())
    return torch.cat(scores)


def pairwise_accuracy(model, pairs: dict[str, list[list[int]]], pad_id: int) -> float:
    """Fraction of pairs where r(chosen) > r(rejected)."""
    chosen = score_ids(model, pairs["chosen_ids"], pad_id)
    rejected = score_ids(model, pairs["rejected_ids"], pad_id)
    return float((chosen > rejected).float().mean())


def _accuracies(model, train_records, eval_records, tokenizer, max_len: int) -> dict[str, Optional[float]]:
    """Pairwise accuracy on the held-out pairs (None when there are none) and on up to 256 training pairs."""
    pad = tokenizer.pad_token_id
    held_out = pair_ids(eval_records, tokenizer, max_len)
    return {
        "eval_accuracy": pairwise_accuracy(model, held_out, pad) if eval_records else None,
        "train_accuracy": pairwise_accuracy(model, pair_ids(train_records[:256], tokenizer, max_len), pad),
    }


def export_gguf(run_dir: str | Path, outtype: str = "f16") -> Optional[Path]:
    """Export the RM in ``run_dir`` for the llama.cpp worker into ``run_dir/gguf`` (atomically).

    Returns None, with a warning, when the exporter is not available in this install.
    """
    run_dir = Path(run_dir)
    try:
        from homerlhf.workers.gguf import export_reward
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


def _train_and_eval(records, report, eval_source, cfg, tokenizer, max_len: int):
    """(train records, eval records, eval report or None), fitted to ``max_len``; without
    ``eval_source`` the eval records are a ``data.eval_fraction`` split of ``records``."""
    records = _fit(records, report, tokenizer, max_len, cfg.data.overlong)
    if not eval_source:
        return (*_split(records, cfg.data.eval_fraction, cfg.seed), None)
    eval_records, eval_report = load_preferences(eval_source, cfg.data)
    return records, _fit(eval_records, eval_report, tokenizer, max_len, cfg.data.overlong), eval_report


def run_reward(cfg, out: str | Path, data: Optional[str] = None, base: Optional[str] = None,
               eval_data: Optional[str] = None, overwrite: bool = False) -> dict[str, Any]:
    """Train a reward model on ``data`` from ``base`` (default ``cfg.rm.base`` or the policy model).

    Returns the summary also written to ``OUT/reward_run.json``.
    """
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    from homerlhf.stages.preflight import check_reward_stage

    section = cfg.rm
    check_reward_stage(cfg, base or section.base or cfg.model.name_or_path)  # before anything is trained
    out = prepare_out(Path(out), "reward_run.json", overwrite)
    records, report = load_preferences(data or section.data, cfg.data)  # bad data fails before a model is built
    base_name, base_path, tokenizer = open_base(base, section, cfg)
    train_records, eval_records, eval_report = _train_and_eval(
        records, report, eval_data or section.eval_data, cfg, tokenizer, section.max_len
    )
    print("\n".join(r.summary() for r in (report, eval_report) if r is not None))

    def make_trainer():
        torch.manual_seed(cfg.seed)  # the score head is initialised at random
        model = load_model(AutoModelForSequenceClassification, base_path, cfg, section.method, num_labels=1)
        model.config.pad_token_id = tokenizer.pad_token_id
        return RewardTrainer(
            model=model,
            args=RewardConfig(
                **trainer_args(section, cfg, out),
                max_length=None,  # already left-truncated by pair_ids; TRL would drop over-long pairs instead
                center_rewards_coefficient=section.center_rewards_coef,
                disable_dropout=True,
            ),
            train_dataset=Dataset.from_dict(pair_ids(train_records, tokenizer, section.max_len)),
            processing_class=tokenizer,
            peft_config=lora_config(section, section.lora, "SEQ_CLS"),
        )

    trained = train_and_save(make_trainer, section.method, cfg, out, base_path, tokenizer,
                             AutoModelForSequenceClassification,
                             lambda model: _accuracies(model, train_records, eval_records, tokenizer, section.max_len),
                             num_labels=1, pad_token_id=tokenizer.pad_token_id)
    summary = {
        "stage": "reward", "base_model": base_name, "base_path": base_path, "method": section.method,
        "data": report.to_dict(),
        "eval_data": eval_report.to_dict() if eval_report else f"{cfg.data.eval_fraction:g} split of the data",
        "n_train": len(train_records), "n_eval": len(eval_records), **trained, "gguf_dir": None,
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
