"""The memory planner: bytes per component for each PPO phase, a verdict for a card, and suggestions.

Pure functions on a :class:`~homerlhf.memory.shapes.ModelShape` and a ``RunConfig``; nothing is
loaded or allocated. :func:`plan` says what the trainer does, and so what is counted; the formulas and
their sources are in ``docs/memory.md``. The byte counts are :mod:`homerlhf.memory.components`, the
phases :mod:`homerlhf.memory.phases`, a plan as data :mod:`homerlhf.memory.plans`, the search for
settings that fit :mod:`homerlhf.memory.search`; this module puts them together.
"""

from __future__ import annotations

from typing import Optional

from homerlhf.config.schema import RunConfig
from homerlhf.memory.checkpointing import checkpointing_info, resolve_checkpointing
from homerlhf.memory.chunks import generation_chunk_info, resolve_generation_chunk
from homerlhf.memory.components import Assumptions, for_shape
from homerlhf.memory.plans import MARGIN, PhasePlan, Plan, Suggestion, build_plan, param_counts, settings_of
from homerlhf.memory.search import suggest
from homerlhf.memory.shapes import ModelShape

__all__ = ["MARGIN", "PhasePlan", "Plan", "Suggestion", "compare", "param_counts", "plan", "predicted_peaks",
           "settings_of"]


def plan(
    cfg: RunConfig,
    shape: ModelShape,
    gpu_gib: Optional[float] = None,
    *,
    assumptions: Assumptions = Assumptions(),
    with_suggestion: bool = True,
) -> Plan:
    """Bytes per component per phase for ``cfg`` on ``shape``; ``gpu_gib`` defaults to the card's.

    ``auto`` checkpointing settings are resolved first (:mod:`homerlhf.memory.checkpointing`;
    ``plan.checkpointing`` says to what), then an ``auto`` generation chunk (``plan.generation`` says to
    what and why). When the plan does not fit with the margin (over, or tight), ``plan.suggestion`` holds
    overrides that do (see :func:`homerlhf.memory.search.suggest`). What the trainer does, and so what is
    counted:

    - the base is NF4 (``bnb_4bit_use_double_quant``); its other parameters (embeddings, LM head, norms)
      and with them the residual stream, activations and the KV cache are in the compute dtype, or in
      fp32 under ``quant.upcast_non_quantized``; logits, LoRA, its gradients and AdamW states are fp32
      either way, and peft's LoRA keeps fp32 copies of its inputs;
    - **generation** samples ``rollout.generation_chunk`` prompts at a time with a KV cache;
    - **scoring** runs no-grad forwards of the actor (old log-probs), critic (values) and, with
      ``ref.backend: adapter_off``, the adapter-less base, on a rollout chunk; log-probs are computed
      ``ppo.logprob_chunk_size`` positions at a time;
    - **update** runs forward/backward on ``ppo.micro_batch_size`` sequences, accumulating LoRA grads of
      actor and critic over a mini-batch; optimizer states stay resident between iterations, and the
      last step's gradients until the next update.
    """
    budget = cfg.card.gpu_gib if gpu_gib is None else float(gpu_gib)
    assumptions = for_shape(assumptions, shape)
    chosen = resolve_checkpointing(cfg, shape, budget, assumptions=assumptions)  # before the chunk it leaves room for
    resolved = resolve_generation_chunk(chosen, shape, budget, assumptions=assumptions)
    result = build_plan(resolved, shape, gpu_gib, assumptions=assumptions)
    result.generation.update(generation_chunk_info(chosen, shape, budget, assumptions=assumptions))
    result.checkpointing = checkpointing_info(cfg, chosen, shape)
    if with_suggestion and result.fits is False:
        result.suggestion = suggest(cfg, shape, budget, assumptions=assumptions)  # an auto chunk stays auto
    return result


def compare(plan_: Plan, measured_gib: dict[str, float]) -> dict[str, dict[str, float]]:
    """Measured (``PhaseMeter.peaks()``) beside predicted allocated GiB, per phase, with the error."""
    out = {}
    for phase in plan_.phases:
        if phase.name in measured_gib:
            got = measured_gib[phase.name]
            out[phase.name] = {
                "predicted_gib": round(phase.allocated_gib, 4),
                "measured_gib": round(got, 4),
                "error": round((phase.allocated_gib - got) / got, 4) if got else float("nan"),
            }
    return out


def predicted_peaks(cfg: RunConfig, shape: ModelShape) -> dict[str, float]:
    """``{phase: predicted allocated GiB}``: the plan's figure to log beside ``PhaseMeter.peaks()``, of
    what the models built from ``cfg`` run (an unresolved ``auto`` checkpointing read as they read it)."""
    if cfg.training.has_auto:
        cfg = cfg.model_copy(update={"training": cfg.training.as_read()})
    return {p.name: p.allocated_gib for p in plan(cfg, shape, with_suggestion=False).phases}
