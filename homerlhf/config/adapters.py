"""The sections of what PPO trains: ``actor`` and ``critic`` (each a LoRA, ``LoraConfig``), re-exported by
:mod:`homerlhf.config.schema`."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, PositiveFloat, field_validator, model_validator

from homerlhf.config.section import Section


class LoraConfig(Section):
    r: int = Field(16, ge=1, le=1024, description="LoRA rank.")
    alpha: float = Field(32, gt=0, description="LoRA alpha (scale = alpha / r).")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="LoRA dropout in SFT and RM training; PPO forwards run without it."
    )
    target_modules: Union[Literal["all-linear"], list[str]] = Field(
        "all-linear", description="Module names to adapt, or 'all-linear' (on a mixture of experts: the attention)."
    )
    experts: bool = Field(
        False, description="Mixture of experts: also adapt every expert's fused weights (gate_up_proj, down_proj; "
        "peft's target_parameters, r x (in + out) per expert). The router stays frozen.")


class ActorConfig(Section):
    lora: LoraConfig = LoraConfig()
    lr: Union[Literal["auto"], PositiveFloat] = Field(
        1e-5, description="Actor learning rate; auto: by the policy's size when the run starts "
        "(homerlhf.config.learning_rates, docs/learning.md).")

    @field_validator("lr", mode="before")
    @classmethod
    def _lr_number_or_auto(cls, value):
        if value == "auto":
            return value
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = None
        if number is None or not number > 0 or number == float("inf"):
            raise ValueError(f"actor.lr must be a number > 0 or 'auto'; got {value!r}")
        return number
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"] = Field(
        "adamw", description="Actor optimizer; the 8-bit ones are bitsandbytes'."
    )


class CriticConfig(Section):
    lora: LoraConfig = LoraConfig()
    lr: float = Field(5e-5, gt=0, description="Critic learning rate (LoRA and value head).")
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"] = Field(
        "adamw", description="Critic optimizer."
    )
    shared_adapter: bool = Field(
        False, description="One adapter for actor and critic (cheaper; the losses share weights)."
    )
    value_head_init_std: float = Field(0.0, ge=0, description="Std of the value head's init (0: zeros).")
    warmup_iterations: int = Field(
        0, ge=0, description="PPO: iterations at the start that train the critic alone (the actor keeps its "
        "weights), so the first advantages come from fitted values (VC-PPO's value pretraining). 0: none.")
    model: Optional[str] = Field(
        None, description="The critic's own base: a smaller causal LM with the policy's tokenizer, or a reward model "
        "(its score head starts the value head). None: the policy's base (docs/memory.md).")

    @model_validator(mode="after")
    def _own_base_or_shared(self) -> "CriticConfig":
        if self.model is not None and self.shared_adapter:
            raise ValueError(f"critic.model ({self.model}) gives the critic a base of its own, and critic.shared_adapter "
                             "puts it in the actor's adapter; set critic.shared_adapter=false or unset critic.model")
        if self.warmup_iterations and self.shared_adapter:
            raise ValueError(f"critic.warmup_iterations ({self.warmup_iterations}) trains the critic alone, and "
                             "critic.shared_adapter puts it in the actor's adapter; set critic.shared_adapter=false "
                             "or critic.warmup_iterations=0")
        return self
