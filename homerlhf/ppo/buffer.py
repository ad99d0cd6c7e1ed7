"""The experience buffer of the asynchronous mode: the one batch generated ahead, kept on disk.

A :class:`PendingBatch` is an iteration's rollout as the engine produced it (ids, masks, behaviour
log-probs, the policy version of each sample), with its reference log-probs and raw scores: all an
iteration needs except what the trainer computes itself when it takes the batch (old log-probs,
values). :class:`ExperienceBuffer` holds at most one, in ``RUN_DIR/buffer/`` as
``pending.safetensors`` (tensors) and ``pending.json`` (iteration, prompt indices, per-reward
scores), each written to a temporary name and moved into place, the json last: no pickle, and a
batch whose json is there is complete. A checkpoint copies both files (:meth:`ExperienceBuffer.copy_to`),
so ``--resume`` takes the very batch the interrupted run would have taken next.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from safetensors.torch import load_file, save_file
from torch import Tensor

from homerlhf.ppo.rollout import RolloutBatch

TENSORS = "pending.safetensors"
META = "pending.json"
FORMAT = 1
_BATCH_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "truncated", "behaviour_logprobs")


@dataclass
class PendingBatch:
    iteration: int  # the iteration this batch is for
    indices: list[int]  # its prompts' indices into the trainer's prompts
    batch: RolloutBatch  # the engine's rollout, behaviour log-probs included
    policy_version: Tensor  # (B,) long, updates applied to the adapter that sampled each row
    raw_scores: Tensor  # (B,) the reward backend's scores as returned
    ref_logprobs: Optional[Tensor] = None  # (B, T); None: taken by the trainer (a reference on its own module)
    components: dict[str, list] = field(default_factory=dict)  # per-reward scores (weighted rewards)

    def __len__(self) -> int:
        return len(self.batch)


def save_pending(pending: PendingBatch, directory: Path) -> None:
    """Write ``pending`` into ``directory`` (replacing any batch there)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: getattr(pending.batch, name) for name in _BATCH_FIELDS}
    tensors.update(policy_version=pending.policy_version, raw_scores=pending.raw_scores)
    if pending.ref_logprobs is not None:
        tensors["ref_logprobs"] = pending.ref_logprobs
    (directory / META).unlink(missing_ok=True)  # from here until the json is back: no batch
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(directory / f"{TENSORS}.tmp"))
    os.replace(directory / f"{TENSORS}.tmp", directory / TENSORS)
    meta = {"format": FORMAT, "iteration": pending.iteration, "indices": list(pending.indices),
            "components": pending.components}
    (directory / f"{META}.tmp").write_text(json.dumps(meta))
    os.replace(directory / f"{META}.tmp", directory / META)


def load_pending(directory: Path, device="cpu") -> Optional[PendingBatch]:
    """The batch in ``directory``, its tensors on ``device``; None when there is none."""
    if not (directory / META).is_file():
        return None
    meta = json.loads((directory / META).read_text())
    tensors = load_file(str(directory / TENSORS), device=str(device))
    batch = RolloutBatch(*(tensors[name] for name in _BATCH_FIELDS))
    return PendingBatch(int(meta["iteration"]), [int(i) for i in meta["indices"]], batch,
                        tensors["policy_version"], tensors["raw_scores"], tensors.get("ref_logprobs"),
                        meta.get("components", {}))


class ExperienceBuffer:
    """At most one pending batch, on disk in ``directory`` (in memory when None: no run dir)."""

    def __init__(self, directory: Optional[Path], device="cpu"):
        self.directory = Path(directory) if directory is not None else None
        self.device = device
        self._held: Optional[PendingBatch] = None

    def put(self, pending: PendingBatch) -> None:
        if self.directory is None:
            self._held = pending
        else:
            save_pending(pending, self.directory)

    def take(self) -> Optional[PendingBatch]:
        """The batch, removed from the buffer; None when empty."""
        if self.directory is None:
            pending, self._held = self._held, None
            return pending
        pending = load_pending(self.directory, self.device)
        self.clear()
        return pending

    def clear(self) -> None:
        self._held = None
        if self.directory is not None:
            for name in (META, TENSORS):
                (self.directory / name).unlink(missing_ok=True)

    def copy_to(self, target: Path) -> None:
        """The batch's files into ``target`` (a checkpoint being written); nothing when empty."""
        if self.directory is None:
            if self._held is not None:
                save_pending(self._held, target)
            return
        if (self.directory / META).is_file():
            target.mkdir(parents=True, exist_ok=True)
            for name in (TENSORS, META):
                shutil.copy2(self.directory / name, target / name)

    def restore_from(self, source: Path) -> None:
        """Replace the buffer with the batch saved in ``source`` (a checkpoint's), or empty it."""
        self.clear()
        pending = load_pending(source, self.device) if source.is_dir() else None
        if pending is not None:
            self.put(pending)
