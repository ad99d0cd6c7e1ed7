"""Mixed-precision rules: which dtype trains under which compute dtype, and when the loss is scaled."""

from __future__ import annotations

import pytest
import torch

from homerlhf.models.precision import cast_trainable, loss_scaler, trainable_dtype, trainer_precision_flags

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32


def test_trainable_dtype_is_fp32_under_fp16_compute_and_the_compute_dtype_otherwise():
    assert [trainable_dtype(c) for c in (FP16, BF16, FP32)] == [FP32, BF16, FP32]


def test_trainer_autocasts_in_the_compute_dtype_on_cuda_only():
    assert trainer_precision_flags(FP16, on_cuda=True) == {"bf16": False, "fp16": True}
    assert trainer_precision_flags(BF16, on_cuda=True) == {"bf16": True, "fp16": False}
    assert trainer_precision_flags(FP32, on_cuda=True) == {"bf16": False, "fp16": False}
    assert trainer_precision_flags(FP16, on_cuda=False) == {"bf16": False, "fp16": False}


@pytest.mark.parametrize("compute", [FP16, BF16, FP32])
def test_loss_scaler_is_on_for_fp16_only_and_a_no_op_otherwise(compute):
    scaler = loss_scaler(compute, "cpu")
    assert scaler.is_enabled() == (compute == FP16)
    loss = torch.tensor(3.0)
    assert float(scaler.scale(loss)) == (3.0 * 2.0**16 if compute == FP16 else 3.0)


def _lora_classifier(tmp_path, base_dtype):
    """A peft LoRA SEQ_CLS model on a tiny classifier in ``base_dtype``: fp32 LoRA (peft's default),
    a trainable score head copied in the base's dtype, frozen base weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    from homerlhf.tiny import build_sequence_classifier

    path = build_sequence_classifier(tmp_path / "rm", arch="llama", seed=0)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=base_dtype)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="SEQ_CLS"))


def test_full_precision_fp16_base_gets_an_fp32_score_head_and_keeps_its_frozen_weights(tmp_path):
    model = _lora_classifier(tmp_path, FP16)
    trainable = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    assert {trainable[n] for n in trainable if "score" in n} == {FP16}  # what the scaler would refuse
    cast = cast_trainable(model, FP16, all_trainable=False)
    assert cast and all("score" in n for n in cast)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {FP32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {FP16}


def test_bf16_compute_keeps_what_trains_today(tmp_path):
    # method lora: fp32 LoRA and a bf16 score head, as before; method qlora (all_trainable): bf16.
    model = _lora_classifier(tmp_path, BF16)
    before = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    assert cast_trainable(model, BF16, all_trainable=False) == []
    assert {n: p.dtype for n, p in model.named_parameters() if p.requires_grad} == before
    cast_trainable(model, BF16, all_trainable=True)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {BF16}


def test_ppo_accelerator_starts_after_a_stage_with_other_mixed_precision_in_the_same_process():
    """A notebook runs the reward stage (TRL, fp16/bf16 autocast on CUDA) and then PPO (ours, "no") in
    one process; accelerate keeps one state per process and refused the second precision. CPU shows
    it with bf16, which accelerate accepts there."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from homerlhf.models.precision import release_finished_accelerate_state, unmixed_accelerator

    AcceleratorState._reset_state()
    try:
        Accelerator(cpu=True, mixed_precision="bf16")  # what the earlier stage's trainer left behind
        with pytest.raises(ValueError, match="already been initialized"):
            Accelerator(cpu=True, mixed_precision="no")  # accelerate alone: the crash at PPO's start
        accelerator = unmixed_accelerator(cpu=True)
        assert accelerator.mixed_precision == "no" and AcceleratorState().mixed_precision == "no"
        release_finished_accelerate_state("bf16")  # and back: a later stage gets its own precision
        assert Accelerator(cpu=True, mixed_precision="bf16").mixed_precision == "bf16"
        release_finished_accelerate_state("bf16")  # the same precision keeps the state as it is
        assert AcceleratorState._shared_state and AcceleratorState().mixed_precision == "bf16"
    finally:
        AcceleratorState._reset_state()
