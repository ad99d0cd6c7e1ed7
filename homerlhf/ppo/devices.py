"""Where an iteration's tensors live: on the trainer's device, or as lists for the backends.

The trainer computes on one device, the policy's (``PolicyModel.device``). The reference and reward
backends (llama.cpp workers over HTTP, in-process models, reward functions) speak lists: token ids in,
floats out. Two functions are the only crossings: :func:`worker_lists` (a rollout batch as unpadded id
lists, one device-to-host copy per tensor) and :func:`to_trainer` (whatever comes back, as tensors on
the trainer's device). An :class:`~homerlhf.ppo.experience.Experience` holds every tensor on one device.
What stays on the CPU on purpose: the mini-batch shuffle's generator and its permutations (a
checkpoint's RNG state does not depend on the card), the prompt order, the per-sample seeds, and what
is written to disk. Every tensor the trainer's path creates names its device: a factory call without
one gives a CPU tensor, which on a GPU meets the trainer's CUDA tensors at the first op; the tests run
iterations with such calls sent to ``meta``.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

Device = Union[str, torch.device]


def unpadded_lists(ids: Tensor, mask: Tensor) -> list[list[int]]:
    """(B, L) ids and their mask -> each row's ids where the mask is 1, as a list of ints."""
    rows, keep = ids.tolist(), mask.tolist()  # one copy off the device each
    return [[token for token, on in zip(row, flags) if on] for row, flags in zip(rows, keep)]


def worker_lists(batch) -> tuple[list[list[int]], list[list[int]]]:
    """``(prompts, responses)`` of a rollout batch for the backends: each prompt's ids without
    padding and each response's ids up to and including its stop token."""
    return unpadded_lists(batch.prompt_ids, batch.prompt_mask), unpadded_lists(batch.response_ids, batch.response_mask)


def _padded_rows(rows: Sequence, width: int) -> Tensor:
    """Rows of floats of at most ``width`` each (lists or tensors) -> (B, width) float32 on the CPU,
    0 after each row's end."""
    out = torch.zeros((len(rows), width), dtype=torch.float32, device="cpu")
    for i, row in enumerate(rows):
        values = row.detach().float().cpu() if isinstance(row, Tensor) else torch.tensor(
            [float(v) for v in row], dtype=torch.float32, device="cpu")
        if values.shape[0] > width:
            raise ValueError(f"row {i} has {values.shape[0]} values for {width} response tokens")
        out[i, : values.shape[0]] = values
    return out


def to_trainer(values, device: Device, width: Optional[int] = None):
    """``values`` placed on the trainer's ``device``.

    - a tensor: moved (dtype kept); with ``width``, its rows are padded on the right with 0 to it;
    - a list of per-token rows (``width`` given): (B, width) float32, 0 after each row's end;
    - a list of numbers (one per sample): (B,) float32;
    - a :class:`~homerlhf.ppo.rollout.RolloutBatch` (or any dataclass of tensors): a copy with every
      tensor moved.

    Lists are packed on the CPU and copied to the device once.
    """
    if is_dataclass(values) and not isinstance(values, type):
        return replace(values, **{f.name: to_trainer(getattr(values, f.name), device) for f in fields(values)
                                  if isinstance(getattr(values, f.name), Tensor)})
    if width is not None:
        if isinstance(values, Tensor) and values.dim() == 2 and values.shape[1] <= width:
            values = values.float()
            return torch.nn.functional.pad(values, (0, width - values.shape[1])).to(device)
        return _padded_rows(values, width).to(device)
    if isinstance(values, Tensor):
        return values.to(device)
    return torch.tensor([float(v) for v in values], dtype=torch.float32, device=device)
