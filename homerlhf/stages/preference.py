"""``homerlhf dpo`` and ``homerlhf kto``: direct preference training of the policy on its 4-bit base.

TRL's ``DPOTrainer`` (pairs) and ``KTOTrainer`` (answers rated good or bad) train the policy's LoRA on
the same NF4 base the other stages load (:func:`homerlhf.stages.common.load_model`); the losses,
their metrics and the reference forwards are TRL's. The reference is the policy the run starts from
without a second copy of the base: the base with adapters off for a new LoRA, or TRL's ``ref`` adapter
(a copy of the starting LoRA weights: :func:`_restore`) when it continues a run's actor
(:mod:`homerlhf.stages.preference_start`). What ours is: the data's token ids (the ones PPO samples,
:mod:`homerlhf.stages.preference_data`), checkpoints, resume and the held-out figures
(:mod:`homerlhf.stages.preference_eval`). The run directory holds what a PPO run's does
(:func:`run_preference` lists it), so ``homerlhf export policy OUT``, the app and a later run read it alike.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from homerlhf.errors import UserError
from homerlhf.stages.preference_data import METHODS, PreferenceData, load_units, tokenise
from homerlhf.stages.preference_start import RUN_FILE, START_FILE, Start, check_start_unchanged, resolve_start, start_config

LOG = "metrics.jsonl"
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def _trainer_class(method: str):
    """TRL's trainer for ``method``, taking our token rows as they are and in their order (shuffled
    once by the seed when split): the data loader is sequential, so a resumed run sees the same rows."""
    from torch.utils.data import SequentialSampler
    from trl import DPOTrainer, KTOTrainer

    from homerlhf.stages.preference_data import kl_completions

    base = DPOTrainer if method == "dpo" else KTOTrainer

    class Pretokenized(base):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            if method == "kto" and self.calculate_KL:  # TRL's mismatched completions for its KL term
                kl = kl_completions(list(dataset), args.per_device_train_batch_size)
                dataset = dataset.add_column("KL_completion_ids", kl)
            return dataset

        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    return Pretokenized


def _config(method: str, cfg, out: Path):
    """TRL's DPOConfig / KTOConfig from the stage's section: the shared TRL arguments, checkpoints every
    ``checkpoint.every`` steps, OOM backoff on CUDA (``auto_find_batch_size``: the HF Trainer halves the
    batch and redoes), every step logged."""
    from trl import DPOConfig, KTOConfig

    from homerlhf.stages.common import on_cuda, trainer_args

    section = getattr(cfg, method)
    args = {**trainer_args(section, cfg, out), "save_strategy": "steps", "save_steps": cfg.checkpoint.every,
            "auto_find_batch_size": on_cuda(cfg) and cfg.training.dynamic_micro_batch,
            "max_length": section.max_len, "beta": section.beta, "disable_dropout": True,
            "remove_unused_columns": True, "logging_steps": 1}  # every step: the live loss and margins
    if method == "dpo":
        sft = ["sft"] if section.sft_weight > 0 else []  # TRL's own sft term, weighted beside the DPO loss
        return DPOConfig(**args, loss_type=[section.loss_type, *sft],
                         loss_weights=[1.0] + [section.sft_weight] * len(sft))
    return KTOConfig(**args, desirable_weight=section.desirable_weight, undesirable_weight=section.undesirable_weight)


def _model(cfg, start: Start, base_path: str, method: str):
    """The 4-bit base, and the starting adapter on it as the trainable ``default`` (None: TRL adds a
    new LoRA from ``actor.lora``). Returns ``(model, peft_config or None, the adapter's exact weights)``."""
    from transformers import AutoModelForCausalLM

    from homerlhf.models.base_loading import check_logits_path
    from homerlhf.stages.common import load_model, lora_config

    model = load_model(AutoModelForCausalLM, base_path, cfg, getattr(cfg, method).method)
    check_logits_path(model, base_path)  # the held-out pass computes its logits from the last hidden state
    if start.adapter is None:
        return model, lora_config(getattr(cfg, method), cfg.actor.lora, "CAUSAL_LM"), {}
    from peft import PeftModel

    model = PeftModel.from_pretrained(model, start.adapter, is_trainable=True)
    exact = {n: p.detach().clone() for n, p in model.named_parameters() if ".default." in n}
    return model, None, exact


def _restore(model, exact: dict) -> None:
    """The adapter TRL continues gets its exact values back, in the dtype it now trains in (TRL rounds a
    4-bit model's trainable weights to bf16; :func:`match_trainable_dtype` then sets the stage's), and
    TRL's ``ref`` adapter (its fp32 copy of them, taken before the rounding) becomes that same adapter:
    those values, that dtype. So the policy starts equal to its reference; under bf16 training both are
    the starting adapter in bf16, where the fp32 copy would run its LoRA in fp32 beside the policy's bf16
    one (peft computes a LoRA in its weights' dtype): the first rewards and margins off 0."""
    import torch

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in exact.items():
            param = params[name]
            param.data = value.to(param.dtype)
            ref = params.get(name.replace(".default.", ".ref."))
            if ref is not None:
                ref.data = param.data.clone()


class _Recorder:
    """The trainer's callback: each logged step into ``metrics.jsonl``, and each HF checkpoint the
    Trainer writes sealed into ``checkpoints/iter_XXXXXX`` (then the HF copy goes)."""

    def __init__(self, out: Path, cfg, info: dict[str, Any]):
        from transformers import TrainerCallback

        self.out, self.cfg, self.info = out, cfg, info
        self.callback = type("PreferenceRecorder", (TrainerCallback,), {
            "on_log": lambda _, args, state, control, logs=None, **kw: self.log(state, logs),
            "on_save": lambda _, args, state, control, **kw: self.save(state)})()

    def log(self, state, logs: Optional[dict]) -> None:
        if logs:
            row = {"step": state.global_step, "epoch": state.epoch, **logs}
            with open(self.out / LOG, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(row, default=float) + "\n")

    def save(self, state) -> None:
        from homerlhf.config import to_yaml
        from homerlhf.ppo.checkpoint import CHECKPOINTS, _move_into_place, _seal, checkpoint_name, prune_checkpoints

        step = state.global_step
        hf_dir = self.out / "trainer" / f"checkpoint-{step}"
        root = self.out / CHECKPOINTS
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".tmp-{checkpoint_name(step)}"
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "actor").mkdir(parents=True)
        (tmp / "trainer").mkdir()
        for item in sorted(hf_dir.iterdir()):
            if item.name in ADAPTER_FILES:
                shutil.copy2(item, tmp / "actor" / item.name)
            elif item.is_file() and item.name not in ("training_args.bin", "README.md"):
                shutil.copy2(item, tmp / "trainer" / item.name)  # the ref/ adapter is rebuilt from the start
        (tmp / "config.yaml").write_text(to_yaml(self.cfg))
        (tmp / START_FILE).write_text(json.dumps({**self.info, "step": step, "log_bytes": _size(self.out / LOG)},
                                                 indent=1))
        _seal(tmp, step)
        _move_into_place(tmp, root / checkpoint_name(step))
        prune_checkpoints(self.out, self.cfg.checkpoint.keep)
        shutil.rmtree(hf_dir, ignore_errors=True)


def _logged_tokens(path: Path) -> int:
    """The last ``num_tokens`` TRL logged (its count of training tokens so far), 0 if none."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return int(next((r["num_tokens"] for r in reversed(rows) if "num_tokens" in r), 0))


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _hf_resume_dir(out: Path, ckpt: Path) -> str:
    """The HF Trainer's checkpoint dir rebuilt from a sealed checkpoint: its adapter and trainer files."""
    hf_dir = out / "trainer" / f"checkpoint-{int(ckpt.name.split('_')[1])}"
    shutil.rmtree(hf_dir, ignore_errors=True)
    shutil.copytree(ckpt / "trainer", hf_dir)
    for name in ADAPTER_FILES:
        shutil.copy2(ckpt / "actor" / name, hf_dir / name)
    return str(hf_dir)


def _build_trainer(method: str, cfg, start: Start, base_path: str, tokenizer, data: PreferenceData, out: Path,
                   callbacks: list):
    """TRL's trainer on the 4-bit base with the starting adapter (or a new LoRA), its callbacks added."""
    import torch
    from datasets import Dataset

    from homerlhf.models.precision import release_finished_accelerate_state, trainer_precision_flags
    from homerlhf.stages.common import match_trainable_dtype, on_cuda, stage_compute_dtype

    section = getattr(cfg, method)
    flags = trainer_precision_flags(stage_compute_dtype(cfg, section.method), on_cuda(cfg))
    release_finished_accelerate_state(next((name for name, on in flags.items() if on), "no"))
    torch.manual_seed(cfg.seed)  # a new LoRA's initial weights
    model, peft_config, exact = _model(cfg, start, base_path, method)
    trainer = _trainer_class(method)(model=model, args=_config(method, cfg, out),
                                     train_dataset=Dataset.from_list(data.train), processing_class=tokenizer,
                                     peft_config=peft_config)
    for callback in callbacks:
        trainer.add_callback(callback)
    match_trainable_dtype(trainer.model, cfg, section.method)  # before train() builds the optimizer
    _restore(trainer.model, exact)
    return trainer


def _train(method: str, cfg, out: Path, start: Start, base_path: str, tokenizer, data: PreferenceData,
           info: dict, resume_from: Optional[Path]) -> dict[str, Any]:
    """Build TRL's trainer, train (from ``resume_from``), and measure the held-out rows; each of the two
    phases metered (:class:`homerlhf.memory.peaks.PhaseMeter`: on CUDA the allocator's peak, else RSS)."""
    from homerlhf.memory.peaks import PhaseMeter
    from homerlhf.memory.preference import HELD_OUT, TRAINING
    from homerlhf.stages.common import Timer, on_cuda
    from homerlhf.stages.preference_eval import held_out_figures, trained_figures
    from homerlhf.tracking import hf
    from homerlhf.tracking.settings import tracking_line

    print(tracking_line(cfg.logging, out))
    recorder = _Recorder(out, cfg, info)
    with contextlib.closing(PhaseMeter("cuda" if on_cuda(cfg) else "cpu")) as meter:
        with hf.hf_trackers(cfg, out) as callbacks:
            trainer = _build_trainer(method, cfg, start, base_path, tokenizer, data, out,
                                     [*callbacks, recorder.callback])
            if resume_from is not None:  # TRL's running token count is not in the HF checkpoint: from the log
                trainer._total_train_tokens = _logged_tokens(out / LOG)
            with Timer() as timer, meter.phase(TRAINING):
                result = trainer.train(resume_from_checkpoint=_hf_resume_dir(out, resume_from) if resume_from else None)
        with meter.phase(HELD_OUT):  # the rows it trained on measured as the held-out ones, in the same batches
            with Timer() as held_timer:
                figures = held_out_figures(trainer.model, data, tokenizer.pad_token_id, cfg)
            trained = trained_figures(trainer.model, data, tokenizer.pad_token_id, cfg)
    shutil.rmtree(out / "trainer", ignore_errors=True)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"steps": result.global_step, "train_loss": float(losses[-1]) if losses else float(result.training_loss),
            "batch_size": trainer.state.train_batch_size, "seconds": timer.seconds,
            "held_out_seconds": held_timer.seconds, "held_out": figures, "trained_rows": trained,
            "peak_mem_gib": {k: round(v, 4) for k, v in meter.peaks().items()}, "peak_mem_kind": meter.kind}


def _claim(out: Path, overwrite: bool) -> Path:
    from homerlhf.stages.common import claim_run_dir
    from homerlhf.tracking.settings import TRACKER_DIRS

    return claim_run_dir(out, (RUN_FILE, "checkpoints", LOG), overwrite,
                         f"{out} already holds a run; pass --overwrite, --resume {out}, or choose another --out",
                         removals=("trainer", *TRACKER_DIRS))


def _prepare(method: str, cfg, start: Start, sources: Sequence[str], eval_source: Optional[str]):
    """Rows read and checked (no tokenizer), then the tokenizer and the token rows."""
    from homerlhf.models.policy import load_tokenizer
    from homerlhf.models.registry import resolve_model

    train_units, eval_units, reports = load_units(method, sources, eval_source, cfg)
    base_path = resolve_model(start.base)
    tokenizer = load_tokenizer(base_path, trust_remote_code=cfg.model.trust_remote_code, padding_side=None)
    data = tokenise(method, train_units, eval_units, reports, tokenizer, cfg)
    print("\n".join(r.summary() for r in data.reports))
    return base_path, tokenizer, data


def run_preference(method: str, cfg, out: str | Path, data: Sequence[str] = (), base: Optional[str] = None,
                   eval_data: Optional[str] = None, overwrite: bool = False) -> dict[str, Any]:
    """A new DPO / KTO run into ``out``; returns the summary also written to ``OUT/preference_run.json``.

    OUT holds ``checkpoints/iter_XXXXXX/`` every ``checkpoint.every`` optimizer steps and at the end
    (``actor/``, ``config.yaml`` whose ``model.name_or_path`` is the base, ``start.json``: what the run
    started from, its data and method; ``trainer/``: the HF Trainer's optimizer, scheduler, RNG and
    state, for an exact ``--resume``; ``MANIFEST.json``, written last), ``metrics.jsonl`` (TRL's figures
    per logging step) and ``preference_run.json`` (start, data reports, counts, held-out margins
    before/after, time, and the peak memory of training and of the held-out pass)."""
    from homerlhf.stages.preflight import check_chat_template
    from homerlhf.tracking.settings import check_installed

    if method not in METHODS:
        raise UserError(f"unknown preference method {method!r}; use dpo or kto")
    section = getattr(cfg, method)
    check_installed(cfg.logging)
    start, run_cfg = resolve_start(base or section.base or cfg.model.name_or_path)
    cfg = start_config(cfg, start, run_cfg)
    check_chat_template(start.base, "the policy's base")  # the pairs are rendered with it, before any weight loads
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"run dir {out} is a file; choose another --out")
    if any((out / name).exists() for name in (RUN_FILE, "checkpoints", LOG)) and not overwrite:
        _claim(out, overwrite)  # the one-line refusal, before the data is read
    sources = list(data) or [section.data]
    eval_source = eval_data or section.eval_data
    base_path, tokenizer, pdata = _prepare(method, cfg, start, sources, eval_source)
    out = _claim(out, overwrite)
    info = {"method": method, "start": start.to_dict(), "data": sources, "eval_data": eval_source,
            "data_fingerprint": pdata.fingerprint()}
    return _finish(method, cfg, out, start, base_path, tokenizer, pdata, info, None)


def resume_preference(out: str | Path, method: Optional[str] = None) -> dict[str, Any]:
    """Continue the DPO / KTO run in ``out`` from its newest checkpoint, exactly: same config, start,
    data (refused if its rows changed), optimizer, scheduler, RNG and data position. ``method``: the
    command's (refused when the run is of the other one)."""
    from homerlhf.ppo.resuming import find_resume_checkpoint, saved_config

    out = Path(out)
    ckpt = find_resume_checkpoint(out)
    if not (ckpt / START_FILE).is_file():
        raise UserError(f"--resume {out}: {ckpt.name} is not a dpo/kto checkpoint (no {START_FILE}); "
                        "resume a PPO run with `homerlhf train --resume`")
    info = json.loads((ckpt / START_FILE).read_text())
    cfg = saved_config(ckpt)
    start = Start(**info["start"])
    check_start_unchanged(start)
    if method is not None and info["method"] != method:
        raise UserError(f"--resume {out}: a {info['method']} run; continue it with `homerlhf {info['method']} --resume {out}`")
    method = info["method"]
    base_path, tokenizer, pdata = _prepare(method, cfg, start, info["data"], info["eval_data"])
    if pdata.fingerprint() != info["data_fingerprint"]:
        raise UserError(f"cannot resume {out}: the training rows of {', '.join(info['data'])} changed since the "
                        "run started; restore the data, or start a new run with --out")
    _cut_log(out / LOG, info["log_bytes"])
    (out / RUN_FILE).unlink(missing_ok=True)
    info = {k: v for k, v in info.items() if k not in ("step", "log_bytes")}
    return _finish(method, cfg, out, start, base_path, tokenizer, pdata, info, ckpt)


def _cut_log(path: Path, size: int) -> None:
    """``metrics.jsonl`` back to its size at the checkpoint: the steps after it are redone."""
    if path.exists():
        with open(path, "r+b") as fh:
            fh.truncate(min(size, path.stat().st_size))


def _finish(method, cfg, out: Path, start: Start, base_path: str, tokenizer, data: PreferenceData,
            info: dict, resume_from: Optional[Path]) -> dict[str, Any]:
    from homerlhf.ppo.checkpoint import latest_complete_checkpoint
    from homerlhf.stages.common import write_json

    trained = _train(method, cfg, out, start, base_path, tokenizer, data, info, resume_from)
    summary = {"stage": method, "start": start.to_dict(), "base_model": start.base, "method": getattr(cfg, method).method,
               "data": [r.to_dict() for r in data.reports], **data.counts(), **trained,
               "checkpoint": str(latest_complete_checkpoint(out)), "resumed_from": str(resume_from) if resume_from else None,
               "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_json(out / RUN_FILE, summary)
    return summary
