"""Data parallel across processes: which rows of the global batch a rank owns, global statistics
from all-reduced sums and counts, and the all-reduce of the trainable gradients.

Every rank runs the same loop on its contiguous slice of the global rollout batch (rows
``[rank * B / W, (rank + 1) * B / W)``), with the same per-sample seeds a one-process run gives those
rows (:func:`homerlhf.ppo.rng.sample_seeds`). What needs the whole batch is computed from sums and
counts all-reduced over the ranks: the masked mean and variance of the advantage whitening, the
score normaliser's batch moments, the KL controller's mean KL. Mini-batches are drawn from one
permutation of the global batch (the same generator on every rank); each rank trains on the rows of
a mini-batch it owns, weighted by their share of the *global* mini-batch's tokens, and the summed
LoRA + value-head gradients are all-reduced before clipping, so every rank takes the same step.

``reduce`` arguments are ``Tensor -> Tensor`` sums over the ranks (:meth:`Ranks.sum`); with one
process they are the identity. The sum-and-count helpers are pure: no process group, no I/O.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from accelerate import PartialState
from torch import Tensor

from homerlhf.errors import UserError
from homerlhf.ppo.experience import Experience

Reduce = Callable[[Tensor], Tensor]


def identity(t: Tensor) -> Tensor:
    return t


# -- pure helpers --------------------------------------------------------------------------------
def shard_bounds(n: int, rank: int, world: int) -> tuple[int, int]:
    """``(lo, hi)``: the contiguous rows ``[lo, hi)`` of ``n`` that ``rank`` of ``world`` owns."""
    if n % world:
        raise ValueError(f"{n} rows do not split evenly over {world} processes")
    per = n // world
    return rank * per, (rank + 1) * per


def masked_sum_count(x: Tensor, mask: Tensor) -> Tensor:
    """``[sum of x where mask, number of such positions]`` in ``x``'s dtype (a (2,) tensor)."""
    mask = mask.bool()
    return torch.stack([torch.where(mask, x, x.new_zeros(())).sum(), mask.sum().to(x.dtype)])


def masked_centered_square_sum(x: Tensor, mask: Tensor, mean: Tensor) -> Tensor:
    """``sum over mask of (x - mean)^2`` (a scalar tensor)."""
    mask = mask.bool()
    return torch.where(mask, x - mean, x.new_zeros(())).pow(2).sum()


def global_masked_whiten(x: Tensor, mask: Tensor, reduce: Reduce = identity, eps: float = 1e-8) -> Tensor:
    """:func:`homerlhf.ppo.math.masked_whiten` over the union of every rank's ``x`` (B_local, T):
    mean ``S / N`` and unbiased variance ``sum (x - mean)^2 / (N - 1)`` with ``S``, ``N`` and the square
    sum all-reduced (two passes: the square sum is of deviations, not of raw squares, for stability).
    Masked-out positions are 0."""
    mask = mask.bool()
    x = torch.where(mask, x, x.new_zeros(()))
    total, count = reduce(masked_sum_count(x, mask)).unbind()
    if count.item() == 0:
        raise ValueError("global_masked_whiten: the mask selects no elements on any rank")
    mean = total / count
    var = reduce(masked_centered_square_sum(x, mask, mean)) / count
    if count.item() > 1:
        var = var * count / (count - 1)
    return torch.where(mask, (x - mean) * torch.rsqrt(var + eps), x.new_zeros(()))


def global_batch_moments(x: Tensor, reduce: Reduce = identity) -> tuple[int, float, float]:
    """``(count, mean, m2)`` of every rank's ``x`` together (``m2``: the sum of squared deviations from
    that mean), in float64: what :meth:`homerlhf.ppo.running.RunningMoments.merge` folds in."""
    xs = x.detach().to(torch.float64).flatten()
    total, count = reduce(torch.stack([xs.sum(), xs.new_tensor(float(xs.numel()))])).unbind()
    mean = total / count
    m2 = reduce(((xs - mean) ** 2).sum())
    return int(count.item()), float(mean), float(m2)


def global_mean(values: Tensor, reduce: Reduce = identity) -> float:
    """The mean of every rank's ``values`` together (any shape)."""
    xs = values.detach().to(torch.float64).flatten()
    total, count = reduce(torch.stack([xs.sum(), xs.new_tensor(float(xs.numel()))])).unbind()
    return float(total / count)


def mean_over_ranks(values: Tensor, reduce: Optional[Reduce] = None) -> float:
    """The mean of every rank's ``values`` together (:func:`global_mean`); with one process (``reduce``
    None) the tensor's own ``mean()``, as a one-process run computes it."""
    return global_mean(values, reduce) if reduce is not None else float(values.mean())


def owned_minibatch_rows(n_global: int, lo: int, hi: int, size: int,
                         generator: torch.Generator) -> Iterator[tuple[Tensor, int]]:
    """For each shuffled global mini-batch of ``size`` rows (as ``Experience.minibatches`` draws them
    from ``generator``): the local indices of the rows this rank owns (``[lo, hi)``, in permutation
    order) and the global mini-batch's row count. One permutation per call, the same on every rank."""
    order = torch.randperm(n_global, generator=generator, device=generator.device)
    for start in range(0, n_global, size):
        rows = order[start : start + size]
        owned = rows[(rows >= lo) & (rows < hi)] - lo
        yield owned, len(rows)


def flat_grads(params: Sequence[torch.nn.Parameter]) -> Tensor:
    """The gradients of ``params`` in one flat fp32 tensor (zeros where a grad is None)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float()
                      for p in params])


def set_flat_grads(params: Sequence[torch.nn.Parameter], flat: Tensor) -> None:
    """Write ``flat`` (as :func:`flat_grads` packs it) back into the params' ``.grad``."""
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).to(p.dtype).clone()
        offset += n


# -- the process group ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Ranks:
    """This process's place among the data-parallel processes; one process by default.

    ``local_rank``: its index on its host; ``node_main``: the global rank of its host's first process.
    """

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def node_main(self) -> int:
        return self.rank - self.local_rank

    def shard(self, n: int) -> tuple[int, int]:
        return shard_bounds(n, self.rank, self.world)

    def sum(self, t: Tensor) -> Tensor:
        """``t`` summed over the ranks (a new tensor on ``t``'s device; ``t`` itself with one process).
        It is reduced on the process group's device (:func:`collective_device`), wherever it lives."""
        if not self.distributed:
            return t
        out = t.detach().to(collective_device(dist.get_backend()), copy=True).contiguous()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.to(t.device)

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any."""
        return bool(self.sum(torch.tensor([float(flag)], device="cpu")).item() > 0) if self.distributed else flag

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of rank ``src`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_reduce_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum the trainable gradients over the ranks, in one flat all-reduce (every rank then holds
        the global mini-batch's gradient)."""
        if self.distributed and params:
            set_flat_grads(params, self.sum(flat_grads(params)))


SINGLE = Ranks()


def collective_device(backend: str) -> torch.device:
    """Where a collective of ``backend`` reduces: NCCL takes CUDA tensors only (this process's GPU),
    gloo (CPU data parallel) CPU ones."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def current_ranks() -> Ranks:
    """The ranks of this process as ``accelerate launch`` (or torchrun) set them up: the process group
    is initialised through accelerate's ``PartialState`` (gloo on CPU, nccl on GPUs); one process
    when not launched that way."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return SINGLE
    state = PartialState(cpu=os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true"))
    return Ranks(state.process_index, state.num_processes, state.local_process_index)


def merge_rows(parts: Sequence[Optional[dict[str, list]]]) -> dict[str, list]:
    """Per-key lists of several ranks concatenated in rank order (e.g. reward component scores)."""
    out: dict[str, list] = {}
    for part in parts:
        for key, values in (part or {}).items():
            out.setdefault(key, []).extend(values)
    return out


def check_data_parallel(batch_size: int, group_size: int, world: int) -> None:
    """The global rollout batch splits evenly over ``world`` processes, in whole prompt groups."""
    if world > 1 and batch_size % (world * group_size):
        raise UserError(f"rollout.batch_size {batch_size} does not split over {world} processes in whole groups "
                        f"of group.size {group_size}; use a multiple of {world * group_size}")


def gather_batch(ranks: Ranks, exp: Experience, scores: Tensor, entropy: Tensor, components: dict[str, list],
                 pad_id: int) -> tuple[Experience, Tensor, Tensor, dict[str, list]]:
    """Every rank's experience, scores (B,), rollout entropy (B, T) and reward components, joined in
    rank order (on the CPU) on every rank: the global batch, for its metrics row and samples. As they
    are with one process."""
    if not ranks.distributed:
        return exp, scores, entropy, components
    parts = ranks.gather((exp.to("cpu"), scores.cpu(), entropy.cpu(), components))
    width = max(part[2].shape[1] for part in parts)
    entropy = torch.cat([torch.nn.functional.pad(part[2], (0, width - part[2].shape[1])) for part in parts])
    return (Experience.cat([part[0] for part in parts], pad_id), torch.cat([part[1] for part in parts]), entropy,
            merge_rows([part[3] for part in parts]))
