"""The ``training`` section of the run config: activation checkpointing (which decoder layers recompute
in backward, and whether their saved inputs wait in host memory) and the update's guards.

Kept beside ``schema.py`` (which imports it). ``auto`` settings are the memory plan's to resolve when a
run starts (:func:`homerlhf.memory.checkpointing.resolve_checkpointing`); read unresolved (a model
loaded outside a run), ``auto`` is every layer and no offload.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import Field, model_validator

from homerlhf.config.section import Section


class TrainingConfig(Section):
    gradient_checkpointing: bool = Field(True, description="Recompute activations in backward.")
    checkpoint_every_n_layers: Union[int, Literal["auto"]] = Field(
        1, description="With gradient_checkpointing: checkpoint decoder layers 0, n, 2n, ... only (faster, more "
        "memory); auto: the fewest the memory plan affords (docs/memory.md).")
    activation_offload: Union[bool, Literal["auto"]] = Field(
        False, description="With gradient_checkpointing: hold the checkpointed layers' inputs in pinned host memory "
        "during the update (PCIe copies each way). auto: only where nothing else fits the card (docs/memory.md).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    dynamic_micro_batch: bool = Field(True, description="Halve the micro-batch on CUDA OOM and redo.")
    max_nonfinite_steps: int = Field(
        5, ge=1, description="Stop the run after this many optimizer steps in a row with a NaN/inf loss or gradient."
    )

    @model_validator(mode="after")
    def _checkpointing(self) -> "TrainingConfig":
        n = self.checkpoint_every_n_layers
        if isinstance(n, bool) or (isinstance(n, int) and n < 1):
            raise ValueError(f"training.checkpoint_every_n_layers must be >= 1 or auto, got {n}")
        if not self.gradient_checkpointing and (n not in (1, "auto") or self.activation_offload is True):
            raise ValueError("training.checkpoint_every_n_layers and training.activation_offload choose among the "
                             "checkpointed layers: set training.gradient_checkpointing=true, or leave them at 1/false")
        return self

    @property
    def has_auto(self) -> bool:
        return "auto" in (self.checkpoint_every_n_layers, self.activation_offload)

    @property
    def every_n(self) -> int:
        """The layer stride that checkpoints (an unresolved ``auto``: 1, every layer)."""
        n = self.checkpoint_every_n_layers
        return 1 if n == "auto" else n

    @property
    def offload(self) -> bool:
        """Whether the checkpointed layers' inputs go to host memory (an unresolved ``auto``: no)."""
        return self.gradient_checkpointing and self.activation_offload is True

    def as_read(self) -> "TrainingConfig":
        """This section with any ``auto`` replaced by what a model built from it runs (:attr:`every_n`,
        :attr:`offload`): what a plan of an unresolved config must assume to match the run."""
        return self.model_copy(update={"checkpoint_every_n_layers": self.every_n, "activation_offload": self.offload})

    def checkpointed_layers(self, num_layers: int) -> int:
        """How many of ``num_layers`` decoder layers recompute in backward: layers 0, n, 2n, ... (as
        transformers' ``activation_checkpointing_enable(every_n_layers=n)`` picks them), ceil(L / n);
        0 without checkpointing."""
        return -(-num_layers // self.every_n) if self.gradient_checkpointing else 0
