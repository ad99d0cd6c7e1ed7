"""``homerlhf reward``: a Bradley-Terry reward model with TRL's RewardTrainer, then its GGUF export.

The model is ``AutoModelForSequenceClassification`` (num_labels 1) on the base: with qlora/lora
the base is frozen under a LoRA adapter and the score head trains in full; with ``full`` every
weight trains (tiny models). Loss: ``-log sigmoid(r_chosen - r_rejected)``. Under the run directory OUT:
``adapter/`` (the peft adapter incl. the score head; qlora and lora), ``model/`` (the merged HF model and
tokenizer), ``gguf/`` (the export for the llama.cpp reward worker) and ``reward_run.json``: the base and
its fingerprint (``base_fingerprint``, :mod:`homerlhf.models.fingerprint`, which ``reward.backend:
adapter`` checks against the policy's base), data reports, counts, time, the training accuracy and the
held-out pairwise accuracy with where its pairs came from (``eval_source``, ``eval_how``;
:mod:`homerlhf.data.heldout`), or, for data too small to hold out a set, none and why (``eval_note``).
``homerlhf train`` takes ``reward.model: OUT`` directly.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence

import torch

from homerlhf.data.heldout import (MIN_HELDOUT, choose_eval_source, half_width, prompt_key, split_by_prompt,
                                   too_small_note)
from homerlhf.data.load import load_preferences
from homerlhf.data.replies import ReplyEncoder
from homerlhf.data.tokens import fit_length, fit_prompt
from homerlhf.models.fingerprint import base_fingerprint
from homerlhf.models.registry import resolve_model_dir
from homerlhf.models.scores import grouped_sequence_scores, score_sequences
from homerlhf.stages.common import load_model, lora_config, open_base, prepare_out, train_and_save, trainer_args, write_json


class Pair(NamedTuple):
    """The two sequences of one preference record, fitted to the length limit."""

    chosen_ids: list[int]
    rejected_ids: list[int]
    n_full: int  # tokens of the longer sequence before fitting


def _fit_pair(encoder: ReplyEncoder, record, max_len: int) -> Pair:
    """The sequences PPO scores (:func:`homerlhf.data.replies.reward_sequence_ids`: the prompt
    rendered with its generation prompt, the reply, its end-of-turn token, nothing after it), each
    rendered once. A pair longer than ``max_len`` keeps both replies whole and its prompt's head
    (:func:`homerlhf.data.tokens.fit_prompt` cuts inside the last user message, so BOS, the system
    turn and the generation prompt survive), the same cut prompt under both replies. Only when a
    reply alone leaves no room for an emptied last user message (or the template renders the prompt
    differently inside the dialogue) are the ids cut from the left, keeping the end where the score
    is read."""
    chosen = encoder.sequence_ids(record["prompt"], record["chosen"])
    rejected = encoder.sequence_ids(record["prompt"], record["rejected"])
    n_full = max(len(chosen), len(rejected))
    if n_full <= max_len:
        return Pair(chosen, rejected, n_full)
    head = encoder.prompt_ids(record["prompt"])
    if chosen[:len(head)] == head and rejected[:len(head)] == head:
        tails = chosen[len(head):], rejected[len(head):]
        fitted = fit_prompt(encoder.tokenizer, record["prompt"], max_len - max(map(len, tails)))
        if fitted is not None:
            return Pair(fitted + tails[0], fitted + tails[1], n_full)
    return Pair(chosen[-max_len:], rejected[-max_len:], n_full)


def _pairs(records, tokenizer, max_len: int) -> list[Pair]:
    encoder = ReplyEncoder(tokenizer)
    return [_fit_pair(encoder, r, max_len) for r in records]


def _columns(pairs: Sequence[Pair]) -> dict[str, list[list[int]]]:
    return {"chosen_ids": [p.chosen_ids for p in pairs], "rejected_ids": [p.rejected_ids for p in pairs]}


def pair_ids(records, tokenizer, max_len: int) -> dict[str, list[list[int]]]:
    """Preference records -> ``chosen_ids`` / ``rejected_ids``, the sequences PPO scores, each pair
    fitted to ``max_len`` (:func:`_fit_pair`)."""
    return _columns(_pairs(records, tokenizer, max_len))


def _fit(records, report, tokenizer, max_len: int, overlong: str) -> list[Pair]:
    pairs = _pairs(records, tokenizer, max_len)
    return fit_length(pairs, [p.n_full for p in pairs], max_len, overlong, report)


def score_ids(model, sequences: Sequence[Sequence[int]], pad_id: int, batch_size: int = 32) -> torch.Tensor:
    """Reward of each token sequence, read at its last token. Returns Shape: (n,) float32."""
    model.eval()
    return score_sequences(model, sequences, pad_id, batch_size)


def pairwise_accuracy(model, pairs: dict[str, list[list[int]]], pad_id: int) -> float:
    """Fraction of pairs where r(chosen) > r(rejected): hits / pairs, counted (a float32 mean of
    the hits reads 180 of 200 as 0.8999999762, below a 0.9 it is)."""
    chosen = score_ids(model, pairs["chosen_ids"], pad_id)
    rejected = score_ids(model, pairs["rejected_ids"], pad_id)
    return int((chosen > rejected).sum()) / len(chosen)


def _accuracies(model, train_pairs, eval_pairs, pad_id: int) -> dict[str, Optional[float]]:
    """Pairwise accuracy on the held-out pairs (None when there are none) and on up to 256 training pairs."""
    return {
        "eval_accuracy": pairwise_accuracy(model, _columns(eval_pairs), pad_id) if eval_pairs else None,
        "train_accuracy": pairwise_accuracy(model, _columns(train_pairs[:256]), pad_id),
    }


def _last_token_reward_trainer():
    """TRL's RewardTrainer whose model scores by :func:`homerlhf.models.scores.sequence_scores`.

    TRL calls the model's own forward, which pools at the last token that is not the pad id; with
    pad == eos (Llama-3) that is the token before the end-of-turn. Its loss and metrics are kept;
    only the forward it calls is ours.
    """
    from types import SimpleNamespace

    from trl import RewardTrainer

    class LastTokenRewardTrainer(RewardTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            # Unwrapped: one process, one device (a DDP wrapper would need its own forward).
            inner = self.accelerator.unwrap_model(model)

            def forward(input_ids, attention_mask, **_):
                return SimpleNamespace(logits=grouped_sequence_scores(inner, input_ids, attention_mask).unsqueeze(-1))

            return super().compute_loss(forward, inputs, return_outputs, num_items_in_batch)

    return LastTokenRewardTrainer


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


class HeldOut(NamedTuple):
    """The pairs a reward model trains on and is evaluated on, and where the held-out ones came from."""

    train: list[Pair]
    eval: list[Pair]
    report: Any  # the held-out set's LoadReport; None for a split of the training data
    source: Optional[str]  # the held-out pairs' dataset; None when there are none
    how: str  # "--eval-data", "rm.eval_data", "held out by prompt" or "none"
    note: Optional[str]  # why the figure is missing, or which builtin set was not used


def _held_out(records, report, train_source: str, choice, cfg, tokenizer, max_len: int) -> HeldOut:
    """Fitted training and held-out pairs. Without a held-out dataset (``choice.source`` None) the
    held-out pairs are a ``data.eval_fraction`` split of ``records`` by prompt
    (:func:`homerlhf.data.heldout.split_by_prompt`), or none when the split would hold out fewer than
    :data:`homerlhf.data.heldout.MIN_HELDOUT` pairs (``note`` says why and what would give a figure)."""
    pairs = _pairs(records, tokenizer, max_len)
    kept = fit_length(list(range(len(pairs))), [p.n_full for p in pairs], max_len, cfg.data.overlong, report)
    pairs = [pairs[i] for i in kept]
    if choice.source:
        eval_records, eval_report = load_preferences(choice.source, cfg.data)
        return HeldOut(pairs, _fit(eval_records, eval_report, tokenizer, max_len, cfg.data.overlong), eval_report,
                       choice.source, choice.given_by, choice.ignored_note(train_source))
    keys = [prompt_key(records[i]["prompt"]) for i in kept]
    train_idx, held_idx = split_by_prompt(keys, cfg.data.eval_fraction, cfg.seed)
    if len(held_idx) < MIN_HELDOUT:
        note = too_small_note(len(pairs), len(held_idx), cfg.data.eval_fraction, train_source)
        ignored = choice.ignored_note(train_source)
        return HeldOut(pairs, [], None, None, "none", f"{ignored}; {note}" if ignored else note)
    return HeldOut([pairs[i] for i in train_idx], [pairs[i] for i in held_idx], None, train_source,
                   "held out by prompt", choice.ignored_note(train_source))


def eval_summary(held: HeldOut, fraction: float) -> dict[str, Any]:
    """``reward_run.json``'s account of the held-out figure: its source, how it was chosen, its 95%
    half-width at worst (accuracy 0.5) and, when there is no figure or a builtin set was not used, why."""
    split = held.how == "held out by prompt"
    eval_data = held.report.to_dict() if held.report is not None else (
        {"source": held.source, "split": "by prompt", "eval_fraction": fraction} if split else None)
    return {"eval_source": held.source, "eval_how": held.how, "eval_data": eval_data,
            "eval_half_width_95": round(half_width(len(held.eval)), 4) if held.eval else None,
            "eval_note": held.note}


def done_line(summary: dict[str, Any], out: str | Path) -> str:
    """The line ``homerlhf reward`` ends with: pairs, the held-out figure and where it comes from
    (or why there is none), the training accuracy, the run dir."""
    acc, train_acc = summary["eval_accuracy"], summary.get("train_accuracy")
    if acc is None:
        figure = f"no held-out figure ({summary.get('eval_note') or 'no held-out pairs'})"
    else:
        how = summary.get("eval_how")
        figure = (f"held-out accuracy {acc:.3f} +-{summary['eval_half_width_95']:.2f} (95%) on "
                  f"{summary['n_eval']} pairs of {summary['eval_source']}" + (f" ({how})" if how else ""))
    trained = "" if train_acc is None else f", training accuracy {train_acc:.3f}"
    return f"reward done: {summary['n_train']} pairs, {figure}{trained}, run dir {out}"


def run_reward(cfg, out: str | Path, data: Optional[str] = None, base: Optional[str] = None,
               eval_data: Optional[str] = None, overwrite: bool = False) -> dict[str, Any]:
    """Train a reward model on ``data`` from ``base`` (default ``cfg.rm.base`` or the policy model).

    Returns the summary also written to ``OUT/reward_run.json``.
    """
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig

    LastTokenRewardTrainer = _last_token_reward_trainer()

    from homerlhf.stages.preflight import check_reward_stage

    section = cfg.rm
    check_reward_stage(cfg, base or section.base or cfg.model.name_or_path)  # before anything is trained
    out = prepare_out(Path(out), "reward_run.json", overwrite)
    records, report = load_preferences(data or section.data, cfg.data)  # bad data fails before a model is built
    base_name, base_path, tokenizer = open_base(base, section, cfg)
    choice = choose_eval_source(data or section.data, eval_data, section.eval_data)  # never another task's
    held = _held_out(records, report, data or section.data, choice, cfg, tokenizer, section.max_len)
    print("\n".join([r.summary() for r in (report, held.report) if r is not None] + ([held.note] if held.note else [])))

    def make_trainer():
        torch.manual_seed(cfg.seed)  # the score head is initialised at random
        model = load_model(AutoModelForSequenceClassification, base_path, cfg, section.method, num_labels=1)
        model.config.pad_token_id = tokenizer.pad_token_id
        return LastTokenRewardTrainer(
            model=model,
            args=RewardConfig(
                **trainer_args(section, cfg, out),
                max_length=None,  # already fitted by _fit_pair; TRL would drop over-long pairs instead
                center_rewards_coefficient=section.center_rewards_coef,
                disable_dropout=True,
            ),
            train_dataset=Dataset.from_dict(_columns(held.train)),
            processing_class=tokenizer,
            peft_config=lora_config(section, section.lora, "SEQ_CLS"),
        )

    trained = train_and_save(make_trainer, section.method, cfg, out, base_path, tokenizer,
                             AutoModelForSequenceClassification,
                             lambda model: _accuracies(model, held.train, held.eval, tokenizer.pad_token_id),
                             num_labels=1, pad_token_id=tokenizer.pad_token_id)
    summary = {
        "stage": "reward", "base_model": base_name, "base_path": base_path, "method": section.method,
        "data": report.to_dict(),
        **eval_summary(held, cfg.data.eval_fraction),
        "n_train": len(held.train), "n_eval": len(held.eval), **trained, "gguf_dir": None,
        "base_fingerprint": base_fingerprint(resolve_model_dir(base_path)),
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
