"""The ``dpo`` and ``kto`` sections of the run config: direct preference training on the policy's base.

Kept beside ``schema.py`` (which imports it). Both stages train the policy's LoRA (``actor.lora``)
on the 4-bit base with TRL's ``DPOTrainer`` / ``KTOTrainer``; the reference is the policy they start
from, on the same base (no second copy): :mod:`homerlhf.stages.preference`.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from homerlhf.config.section import Section


class PreferenceStageConfig(Section):
    """What ``homerlhf dpo`` and ``homerlhf kto`` share."""

    base: Optional[str] = Field(None, description="Policy to start from: an SFT run or model dir, a PPO/GRPO/RLOO "
                                "run (its last checkpoint's actor) or an earlier dpo/kto run (default: model.name_or_path).")
    data: str = Field("builtin:demo-pairs", description="Training data: builtin:<name>, hub id or local file "
                      "(dpo: preference pairs; kto: rated answers or pairs, each pair one good and one bad answer).")
    eval_data: Optional[str] = Field(None, description="Held-out data (default: a data.eval_fraction split of the data).")
    method: Literal["qlora", "lora"] = Field(
        "qlora", description="qlora: the policy's LoRA (actor.lora) on a 4-bit base; lora: on a full-precision base. "
        "The reference is the starting policy on the same base, so every weight cannot train.")
    epochs: float = Field(1.0, gt=0, description="Passes over the training data.")
    max_steps: Optional[int] = Field(None, ge=1, description="Stop after this many optimizer steps (overrides epochs).")
    lr: float = Field(5e-5, gt=0, description="Peak learning rate of the LoRA adapter.")
    batch_size: int = Field(4, ge=1, description="Rows (dpo: pairs; kto: answers) per forward/backward.")
    grad_accum: int = Field(4, ge=1, description="Micro-batches per optimizer step.")
    max_len: int = Field(1024, ge=8, description="Tokens per sequence (prompt + answer); a longer row is cut inside "
                         "its prompt's last user message (answers kept whole), or dropped with data.overlong=drop.")
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="Fraction of steps with linear warm-up.")
    beta: float = Field(0.1, gt=0, description="Strength of the tie to the reference (TRL's beta): higher stays closer.")
    min_rows: int = Field(4, ge=1, description="Fewest usable training rows (dpo: pairs; kto: answers) to train on.")


class DPOTrainConfig(PreferenceStageConfig):
    """``homerlhf dpo``: TRL's DPOTrainer on preference pairs."""

    loss_type: Literal["sigmoid", "hinge", "ipo", "robust"] = Field(
        "sigmoid", description="TRL's DPO loss: sigmoid (the DPO paper), hinge, ipo or robust.")
    sft_weight: float = Field(0.0, ge=0, description="Weight of TRL's sft loss (the chosen answers' mean token NLL) "
                              "added to the DPO loss (RPO); keeps the preferred answers likely. 0: DPO alone.")


class KTOTrainConfig(PreferenceStageConfig):
    """``homerlhf kto``: TRL's KTOTrainer on answers rated good or bad (thumbs up / down)."""

    desirable_weight: float = Field(1.0, gt=0, description="Weight of the good answers' loss.")
    undesirable_weight: float = Field(1.0, gt=0, description="Weight of the bad answers' loss.")
