"""``training.checkpoint_every_n_layers: auto`` and ``training.activation_offload: auto``: the memory plan
chooses, as it chooses the generation chunk (:mod:`homerlhf.memory.chunks`).

Recomputing a layer in backward costs about a third of its forward + backward, so the fewest
checkpointed layers are the fastest; copying the checkpointed inputs to host memory and back costs
PCIe time on the compute stream. The choice: the fewest checkpointed layers (the largest stride n)
whose update phase leaves :data:`~homerlhf.memory.plans.MARGIN` of the card free, without offload;
offload only where no stride fits without it, then again the fewest checkpointed layers that fit. Where
nothing fits, every layer (and offload when it is ``auto``: it lowers the peak all the same), and the
plan's suggestion says what else to change. Without a GPU budget (a CPU card) or without checkpointing
``auto`` is every layer, no offload: what runs when nothing was chosen.
"""

from __future__ import annotations

from typing import Any, Optional

from homerlhf.config.schema import RunConfig
from homerlhf.memory.components import GIB, Assumptions
from homerlhf.memory.plans import MARGIN, memory_view, persistent_of, phase_plan
from homerlhf.memory.recompute import offload_host_components, offloaded_bytes
from homerlhf.memory.shapes import ModelShape


def with_checkpointing(cfg: RunConfig, every_n: Any, offload: Any) -> RunConfig:
    """``cfg`` with ``training.checkpoint_every_n_layers`` and ``training.activation_offload`` set."""
    training = cfg.training.model_copy(update={"checkpoint_every_n_layers": every_n, "activation_offload": offload})
    return cfg.model_copy(update={"training": training})


def strides(num_layers: int) -> list[int]:
    """One stride n per count of checkpointed layers ceil(L / n), the smallest n that gives it (the most
    even spacing), fewest layers first."""
    by_count: dict[int, int] = {}
    for n in range(1, num_layers + 1):
        by_count.setdefault(-(-num_layers // n), n)
    return [by_count[k] for k in sorted(by_count)]


def update_gib(cfg: RunConfig, shape: ModelShape, every_n: int, offload: bool,
               assumptions: Assumptions = Assumptions()) -> float:
    """The update phase's GiB (the persistent memory with it) at stride ``every_n`` and ``offload``."""
    probe = memory_view(with_checkpointing(cfg, every_n, offload))
    if probe.rollout.generation_chunk == "auto":  # the update does not read it
        probe = probe.model_copy(update={"rollout": probe.rollout.model_copy(update={"generation_chunk": 1})})
    return phase_plan(probe, shape, assumptions, "update", persistent_of(probe, shape, assumptions)).total_gib


def _fewest_that_fit(cfg, shape, options: list[int], offload: bool, limit: float, assumptions) -> Optional[int]:
    """The first stride of ``options`` (fewest checkpointed layers first) whose update fits ``limit``
    GiB; memory falls as layers are checkpointed, so by bisection. None if even the last does not."""
    def fits(n: int) -> bool:
        return update_gib(cfg, shape, n, offload, assumptions) <= limit

    if not options or not fits(options[-1]):
        return None
    lo, hi = 0, len(options) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(options[mid]):
            hi = mid
        else:
            lo = mid + 1
    return options[lo]


def planned_checkpointing(cfg: RunConfig, shape: ModelShape, gpu_gib: Optional[float] = None, *,
                          assumptions: Assumptions = Assumptions()) -> tuple[int, bool]:
    """(stride, offload) for ``cfg``'s ``auto`` settings on a ``gpu_gib`` card (default the config's);
    settings the config names are kept."""
    tr = cfg.training
    budget = cfg.card.gpu_gib if gpu_gib is None else float(gpu_gib)
    n_opts = strides(shape.num_layers) if tr.checkpoint_every_n_layers == "auto" else [tr.checkpoint_every_n_layers]
    off_opts = [False, True] if tr.activation_offload == "auto" else [tr.activation_offload]
    if not tr.gradient_checkpointing or budget <= 0 or cfg.card.device != "cuda":
        return n_opts[-1], off_opts[0]  # every layer (or the named stride), no offload (or the named)
    limit = (1 - MARGIN) * budget
    for offload in off_opts:
        found = _fewest_that_fit(cfg, shape, n_opts, offload, limit, assumptions)
        if found is not None:
            return found, offload
    return n_opts[-1], off_opts[-1]  # nothing fits: the least device memory; the plan suggests the rest


def resolve_checkpointing(cfg: RunConfig, shape: ModelShape, gpu_gib: Optional[float] = None, *,
                          assumptions: Assumptions = Assumptions()) -> RunConfig:
    """``cfg`` with its ``auto`` checkpointing settings chosen (:func:`planned_checkpointing`); a config
    without one is returned as it is."""
    if not cfg.training.has_auto:
        return cfg
    return with_checkpointing(cfg, *planned_checkpointing(cfg, shape, gpu_gib, assumptions=assumptions))


def checkpointing_info(cfg: RunConfig, resolved: RunConfig, shape: ModelShape) -> dict[str, Any]:
    """What a plan shows of the checkpointing: the settings (as the config says them), the layers
    recomputed, whether offloaded, the bytes each forward sends to host and the pinned host memory."""
    tr = resolved.training
    host = sum(c.bytes for c in offload_host_components(resolved, shape))
    return {"every_n_setting": cfg.training.checkpoint_every_n_layers,
            "offload_setting": cfg.training.activation_offload,
            "every_n": tr.every_n, "offload": tr.offload, "enabled": tr.gradient_checkpointing,
            "checkpointed_layers": tr.checkpointed_layers(shape.num_layers), "num_layers": shape.num_layers,
            "offloaded_bytes_per_forward": offloaded_bytes(resolved, shape), "pinned_host_gib": round(host / GIB, 4)}


def checkpointing_words(training, num_layers: int, chosen: bool = False) -> str:
    """The update's checkpointing in words (``chosen``: by the plan, at a run's start)."""
    if not training.gradient_checkpointing:
        return "activation checkpointing off: every layer keeps its activations for backward"
    k = training.checkpointed_layers(num_layers)
    where = "their inputs in pinned host memory" if training.offload else "their inputs on the device"
    return (f"activation checkpointing{' (planned)' if chosen else ''}: {k} of {num_layers} layers recomputed "
            f"in backward (training.checkpoint_every_n_layers={training.every_n}), {where} "
            f"(training.activation_offload={str(training.offload).lower()})")


def checkpointing_line(info: dict[str, Any]) -> str:
    """A plan's :func:`checkpointing_info` in one line: the layers recomputed, where their inputs wait,
    and what ``auto`` asked for."""
    if not info.get("enabled", True):
        return "activation checkpointing off (training.gradient_checkpointing=false): every layer keeps its activations"
    k, n_layers = info["checkpointed_layers"], info["num_layers"]
    autos = [name for name, key in (("checkpoint_every_n_layers", "every_n_setting"),
                                    ("activation_offload", "offload_setting")) if info[key] == "auto"]
    why = (f" (auto: {', '.join(autos)}: the fewest recomputed layers, offload only where nothing else fits, "
           f"with {MARGIN:.0%} of the card free)") if autos else ""
    where = (f"inputs offloaded to pinned host memory ({info['offloaded_bytes_per_forward'] / 2**20:,.1f} MiB each "
             f"way per micro-batch forward, {info['pinned_host_gib']:.2f} GiB pinned)") if info["offload"] \
        else "inputs on the device"
    return (f"activation checkpointing: {k} of {n_layers} layers recomputed, every {info['every_n']} "
            f"(training.checkpoint_every_n_layers={info['every_n']}), {where}{why}")


def run_start_lines(resolved: RunConfig, shape: ModelShape) -> list[str]:
    """What a run's start says of its checkpointing, and, under offload, the pinned host memory beside
    what this machine has available (pinned pages cannot be swapped out)."""
    import psutil

    lines = [checkpointing_words(resolved.training, shape.num_layers, chosen=True)]
    pinned = sum(c.bytes for c in offload_host_components(resolved, shape)) / GIB
    if pinned:
        free = psutil.virtual_memory().available / GIB
        lines.append(f"  the offloaded inputs take {pinned:.2f} GiB of pinned host memory; this machine has {free:.1f} "
                     "GiB available" + ("" if pinned < free else ": NOT enough, set training.activation_offload=false"))
    return lines
