"""The ``distributed`` section of the run config: data parallel over GPUs, and sharded QLoRA.

Kept beside ``schema.py`` (which imports it) so that file stays one screen per section.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DistributedConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gpus: int = Field(1, ge=1, description="Data-parallel processes, one per GPU (`homerlhf train --gpus N` "
                      "launches them with accelerate); rollout.batch_size is the global batch, split over them.")
    workers: Literal["shared", "per_node"] = Field(
        "per_node", description="Local reference/reward workers: per_node (each host's first process starts them for "
        "that host) or shared (process 0 starts one set for all; docs/scaling.md).")
    fsdp: bool = Field(False, description="Shard the 4-bit base over the GPUs (FSDP + QLoRA: 4-bit storage "
                       "in the compute dtype) instead of a whole copy per GPU; for models one card cannot hold.")
