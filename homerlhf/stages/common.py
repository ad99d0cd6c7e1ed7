"""What the SFT and reward stages share: the base model and its tokenizer, model loading (4-bit or
not), LoRA, trainer arguments, training (reporting to ``logging.report_to``:
:mod:`homerlhf.tracking.hf`), saving (an adapter merged into the full-precision base), and the run
directory's files.

A TRL stage is: claim the run dir, load and check the data (before any model is built), resolve the
base (:func:`open_base`), fit rows to ``max_len``, then :func:`train_and_save` with the stage's own
trainer, and write the summary. Only the data, the trainer and the extra evaluation differ.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence

import torch

from homerlhf.errors import UserError
from homerlhf.memory.oom import free_memory
from homerlhf.models.precision import (cast_trainable, prepare_frozen_base, release_finished_accelerate_state,
                                       trainable_dtype, trainer_precision_flags)
from homerlhf.tracking import hf
from homerlhf.tracking.settings import TRACKER_DIRS, tracking_line

Method = Literal["qlora", "lora", "full"]


def claim_run_dir(path: Path, markers: Sequence[str], overwrite: bool, refusal: str,
                  removals: Sequence[str] = ()) -> Path:
    """``path`` made ready for a new run of one stage.

    A directory holding any of ``markers`` already holds a run: ``refusal`` (a UserError) unless
    ``overwrite``, which removes the markers and ``removals`` (and nothing else the user put there).
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"run dir {path} is a file; choose another --out")
    if any((path / name).exists() for name in markers):
        if not overwrite:
            raise UserError(refusal)
        for name in (*markers, *removals):
            target = path / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    path.mkdir(parents=True, exist_ok=True)
    return path


def prepare_out(out: Path, marker: str, overwrite: bool) -> Path:
    """The SFT / reward output dir, empty of an earlier run unless ``overwrite``."""
    return claim_run_dir(out, (marker, "model"), overwrite,
                         f"{out} already holds a run; pass --overwrite or choose another --out",
                         removals=("adapter", "gguf", "trainer", *TRACKER_DIRS))


def on_cuda(cfg) -> bool:
    return cfg.card.device == "cuda" and torch.cuda.is_available()


def train_dtype(cfg) -> torch.dtype:
    """Weights dtype of a full-precision base: bf16 where the GPU has it, fp16 on a GPU without
    (T4), fp32 on CPU."""
    if on_cuda(cfg):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def compute_dtype(cfg) -> torch.dtype:
    from homerlhf.models.policy import compute_dtype as quant_compute_dtype

    return quant_compute_dtype(cfg.quant, "cuda" if on_cuda(cfg) else "cpu")


def stage_compute_dtype(cfg, method: Method) -> torch.dtype:
    """What a stage's frozen base computes in: the 4-bit compute dtype (qlora), else the weights'."""
    return compute_dtype(cfg) if method == "qlora" else train_dtype(cfg)


def quantization_config(cfg):
    """bitsandbytes NF4/FP4 config from ``cfg.quant`` (used by method 'qlora'), as the policy loads it."""
    from homerlhf.models.policy import quantization_config as quant_config

    return quant_config(cfg.quant, "cuda" if on_cuda(cfg) else "cpu")


def load_model(auto_cls, base: str, cfg, method: Method, **kwargs):
    """``auto_cls.from_pretrained(base)`` in 4-bit for qlora, full precision otherwise."""
    load_kwargs: dict[str, Any] = dict(trust_remote_code=cfg.model.trust_remote_code, **kwargs)
    if method == "qlora":
        if not cfg.quant.load_in_4bit:
            raise UserError("method 'qlora' needs quant.load_in_4bit=true; use method 'lora' for a full-precision base")
        load_kwargs["quantization_config"] = quantization_config(cfg)
        load_kwargs["dtype"] = compute_dtype(cfg)
        load_kwargs["device_map"] = {"": 0} if on_cuda(cfg) else "cpu"
    else:
        # method full trains every weight: fp32 master weights under fp16 compute (see models.precision)
        dtype = train_dtype(cfg)
        load_kwargs["dtype"] = trainable_dtype(dtype) if method == "full" else dtype
    try:
        with _quiet_head_swap(auto_cls):
            model = auto_cls.from_pretrained(base, **load_kwargs)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load model '{base}': {str(exc).strip().splitlines()[0][:200]}") from None
    if method == "qlora":  # a reference pass in eval mode must not leave the 4-bit layers without a backward
        from homerlhf.models.base_loading import keep_cpu_4bit_differentiable

        keep_cpu_4bit_differentiable(model)
    if method == "qlora" and cfg.quant.upcast_non_quantized:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=cfg.training.gradient_checkpointing
        )
    elif method == "qlora":  # the base's other weights in the compute dtype, as the PPO policy holds them
        model = prepare_frozen_base(model, load_in_4bit=True, upcast=False,
                                    checkpointing=cfg.training.gradient_checkpointing)
    return model


def _quiet_head_swap(auto_cls):
    """A causal LM loaded as a sequence classifier: a new score head and an unused lm_head are expected."""
    import contextlib

    if "SequenceClassification" not in auto_cls.__name__:
        return contextlib.nullcontext()
    try:
        from trl.trainer.reward_trainer import suppress_seqcls_warning
    except ImportError:  # pragma: no cover - older TRL: the load report is only noise
        return contextlib.nullcontext()
    return suppress_seqcls_warning()


def open_base(base: Optional[str], section, cfg) -> tuple[str, str, Any]:
    """``(name, path, tokenizer)`` of the model a stage starts from: ``base``, else the section's
    ``base``, else the policy model. The tokenizer keeps its own padding side (TRL pads with it)."""
    from homerlhf.models.policy import load_tokenizer
    from homerlhf.models.registry import resolve_model

    name = base or section.base or cfg.model.name_or_path
    path = resolve_model(name)
    return name, path, load_tokenizer(path, trust_remote_code=cfg.model.trust_remote_code, padding_side=None)


def lora_config(section, lora, task_type: str):
    """peft's LoRA config from ``lora`` for methods qlora and lora; None for ``full``."""
    from homerlhf.models.policy import peft_lora_config

    return None if section.method == "full" else peft_lora_config(lora, task_type)


def match_trainable_dtype(model, cfg, method: Method) -> list[str]:
    """Trainable weights in the dtype the stage's mixed precision trains (``models.precision``);
    returns the names cast.

    TRL casts the trainable weights of a 4-bit model to bf16 (the QLoRA paper's choice): they
    follow the compute dtype instead, so fp32 on CPU (a bf16 score head would meet fp32 hidden
    states) and fp32 under fp16 compute (the grad scaler refuses fp16 gradients). With a
    full-precision base only fp16 weights (a SEQ_CLS score head copied from an fp16 base) go to fp32.
    """
    return cast_trainable(model, stage_compute_dtype(cfg, method), all_trainable=method == "qlora")


def checkpointing_arg(on: bool) -> dict[str, bool]:
    """TrainingArguments' switch of activation checkpointing by the installed transformers' name for it:
    ``activation_checkpointing`` (5.24+), else ``gradient_checkpointing`` (a deprecated alias since)."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": on}


def trainer_args(section, cfg, out: Path) -> dict[str, Any]:
    """Keyword arguments shared by TRL's SFTConfig and RewardConfig, from an sft/rm section."""
    return dict(
        output_dir=str(out / "trainer"),
        num_train_epochs=section.epochs,
        max_steps=section.max_steps or -1,
        learning_rate=section.lr,
        per_device_train_batch_size=section.batch_size,
        per_device_eval_batch_size=section.batch_size,
        gradient_accumulation_steps=section.grad_accum,
        warmup_steps=section.warmup_ratio,  # a float < 1 is a fraction of the steps
        weight_decay=cfg.training.weight_decay,
        **checkpointing_arg(cfg.training.gradient_checkpointing and section.method != "full"),
        seed=cfg.seed,
        data_seed=cfg.seed,
        use_cpu=not on_cuda(cfg),
        # autocast in the compute dtype (+ a grad scaler for fp16) on CUDA; trainable weights are
        # fp32 under fp16 (match_trainable_dtype), so the scaler can unscale their gradients
        **trainer_precision_flags(stage_compute_dtype(cfg, section.method), on_cuda(cfg)),
        save_strategy="no",
        eval_strategy="no",
        **hf.trainer_args(cfg, out),  # logging.report_to, the run's name and project
        logging_steps=min(10, section.max_steps) if section.max_steps else 10,  # a short run logs its loss too
        disable_tqdm=not cfg.logging.progress,
        dataloader_num_workers=0,
    )


def save_merged(auto_cls, base: str, adapter_dir: Path, out_dir: Path, cfg, tokenizer, **kwargs) -> None:
    """The adapter merged into the full-precision base, saved for ``from_pretrained``."""
    from peft import PeftModel

    # Merge on the CPU: the trainer may still hold the GPU, and the merge is one pass of additions.
    with _quiet_head_swap(auto_cls):
        model = auto_cls.from_pretrained(
            base, dtype=train_dtype(cfg), trust_remote_code=cfg.model.trust_remote_code, **kwargs
        )
    model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def train_and_save(make_trainer: Callable[[], Any], method: Method, cfg, out: Path, base_path: str, tokenizer,
                   auto_cls, evaluate: Optional[Callable[[Any], dict[str, Any]]] = None,
                   **merge_kwargs) -> dict[str, Any]:
    """Train, then save ``OUT/model`` (and ``OUT/adapter`` unless ``full``); the trainer dir goes.

    ``make_trainer()`` builds the TRL trainer and its model, so that nothing else holds the trained
    model once it is dropped before the merge loads the full-precision base. ``evaluate(model)``:
    summary entries computed on the trained model before it is saved. ``merge_kwargs`` go to the
    base's ``from_pretrained`` for the merge. Returns the summary entries: ``evaluate``'s, then
    steps, losses, seconds and the directories.
    """
    print(tracking_line(cfg.logging, out))
    with hf.hf_trackers(cfg, out) as callbacks:  # the trackers' places under OUT, for the stage only
        flags = trainer_precision_flags(stage_compute_dtype(cfg, method), on_cuda(cfg))
        release_finished_accelerate_state(next((name for name, on in flags.items() if on), "no"))
        trainer = make_trainer()
        for callback in callbacks:
            trainer.add_callback(callback)
        match_trainable_dtype(trainer.model, cfg, method)  # before train() builds the optimizer
        with Timer() as timer:
            result = trainer.train()
    final_loss = train_loss(trainer) or float(result.training_loss)
    report = dict(evaluate(trainer.model)) if evaluate else {}
    report.update(steps=result.global_step, train_loss=final_loss,
                  mean_train_loss=float(result.training_loss), seconds=timer.seconds)
    model_dir, adapter_dir = out / "model", out / "adapter"
    if method == "full":
        trainer.model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        del trainer
        free_memory()  # the next stage (a notebook chains them) loads into a card this one no longer holds
    else:
        trainer.model.save_pretrained(adapter_dir)
        tokenizer.save_pretrained(adapter_dir)
        del trainer
        free_memory()  # before the merge loads the full-precision base
        save_merged(auto_cls, base_path, adapter_dir, model_dir, cfg, tokenizer, **merge_kwargs)
    shutil.rmtree(out / "trainer", ignore_errors=True)
    report.update(model_dir=str(model_dir), adapter_dir=None if method == "full" else str(adapter_dir))
    return report


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


class Timer:
    def __enter__(self) -> "Timer":
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = round(time.perf_counter() - self.start, 2)


def train_loss(trainer) -> Optional[float]:
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return float(losses[-1]) if losses else None
