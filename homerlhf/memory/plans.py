"""A memory plan as data: its phases, the verdict against a card, and :func:`build_plan`, which counts
it (no suggestion, no ``auto`` setting resolved: :func:`homerlhf.memory.planner.plan` does both).

Kept below :mod:`homerlhf.memory.search` and :mod:`homerlhf.memory.chunks`, which plan candidate
settings, and :mod:`homerlhf.memory.planner`, which uses them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from homerlhf.config.schema import RunConfig
from homerlhf.memory.components import (GIB, Assumptions, Component, for_shape, overhead_components,
                                       persistent_components)
from homerlhf.memory.host import engine_components, workers_host_bytes
from homerlhf.memory.phases import PHASE_BUILDERS, PHASES
from homerlhf.memory.ranks import distributed_summary, gradient_sync_components, per_gpu_persistent
from homerlhf.memory.shapes import ModelShape


@dataclass
class PhasePlan:
    name: str
    moment: str  # the step of the phase where memory peaks
    components: list[Component]

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes for c in self.components)

    @property
    def allocated_bytes(self) -> int:
        """What ``torch.cuda.max_memory_allocated`` should read during this phase."""
        return sum(c.bytes for c in self.components if c.in_allocator)

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    @property
    def allocated_gib(self) -> float:
        return self.allocated_bytes / GIB

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "moment": self.moment,
            "total_gib": round(self.total_gib, 4),
            "allocated_gib": round(self.allocated_gib, 4),
            "components": [c.to_dict() for c in self.components],
        }


@dataclass
class Suggestion:
    """Overrides (dotted keys) that make the plan fit, and the plan they give."""

    overrides: dict[str, Any]
    peak_gib: float
    headroom_gib: float

    @property
    def set_args(self) -> list[str]:
        return [f"{k}={_yaml_scalar(v)}" for k, v in self.overrides.items()]

    def to_dict(self) -> dict[str, Any]:
        return {
            "overrides": self.overrides,
            "set_args": self.set_args,
            "peak_gib": round(self.peak_gib, 4),
            "headroom_gib": round(self.headroom_gib, 4),
        }


@dataclass
class Plan:
    model: str
    shape: dict[str, Any]
    preset: str
    card: str
    device: str
    gpu_gib: float
    settings: dict[str, Any]
    params: dict[str, int]
    phases: list[PhasePlan]
    assumptions: Assumptions
    notes: list[str] = field(default_factory=list)
    suggestion: Optional[Suggestion] = None
    workers: dict[str, list[Component]] = field(default_factory=dict)  # host RAM of each local llama.cpp worker
    distributed: dict[str, Any] = field(default_factory=dict)  # GPUs, FSDP, global / per-GPU batch
    timing: Optional[Any] = None  # a homerlhf.memory.placement.Recommendation, when attached (attach_timing)
    # The generation chunk: {"chunk", "setting" (the config's: None, a number or "auto"), "kv_bytes_per_token",
    # and with a GPU budget "largest_that_fits" (homerlhf.memory.chunks)}
    generation: dict[str, Any] = field(default_factory=dict)
    # critic.model: both placements of the critic side by side (homerlhf.memory.critic_compare.critic_sides)
    critic: list[dict[str, Any]] = field(default_factory=list)
    # the checkpointed layers and offload, as chosen (homerlhf.memory.checkpointing.checkpointing_info)
    checkpointing: dict[str, Any] = field(default_factory=dict)

    @property
    def workers_host_gib(self) -> float:
        return sum(c.bytes for comps in self.workers.values() for c in comps) / GIB

    @property
    def peak(self) -> PhasePlan:
        return max(self.phases, key=lambda p: p.total_bytes)

    @property
    def peak_gib(self) -> float:
        return self.peak.total_gib

    @property
    def status(self) -> Optional[str]:
        """``fits`` (at least :data:`MARGIN` of the card free at the peak), ``tight`` (under the card
        by less than that: within the plan's error and the allocator's slack, so not promised), ``over``;
        None when there is no GPU budget to compare with (a CPU preset without --gpu-gib)."""
        if self.gpu_gib <= 0:
            return None
        if self.peak_gib > self.gpu_gib:
            return "over"
        return "fits" if self.headroom_gib >= MARGIN * self.gpu_gib else "tight"

    @property
    def fits(self) -> Optional[bool]:
        """True only with the margin; a tight plan does not count as fitting (it gets a suggestion)."""
        return None if self.status is None else self.status == "fits"

    @property
    def headroom_gib(self) -> Optional[float]:
        return None if self.gpu_gib <= 0 else self.gpu_gib - self.peak_gib

    def phase(self, name: str) -> PhasePlan:
        return next(p for p in self.phases if p.name == name)

    def verdict(self, gpu_hint: str = "pass --gpu-gib to plan for a card") -> str:
        """The plan in one line; ``gpu_hint``: how to give a budget where there is none (the CLI's flag)."""
        peak = self.peak
        where = f"peak {peak.total_gib:.2f} GiB in {peak.name} ({peak.moment})"
        status = self.status
        if status is None:
            return f"{where}; no GPU budget to check ({self.device} preset; {gpu_hint})"
        card = f"{self.card} ({self.gpu_gib:g} GiB)"
        share = self.headroom_gib / self.gpu_gib
        # One decimal when tight: 9.96% must not read as the 10% it falls short of.
        free = f"{self.headroom_gib:.2f} GiB headroom ({share:.1%} of the card)" if status == "tight" else \
            f"{self.headroom_gib:.2f} GiB headroom ({share:.0%} of the card)"
        if status == "fits":
            return f"fits {card}: {where}, {free}"
        if status == "tight":
            return (f"tight on {card}: {where}, only {free}; the plan is within 5% of peaks measured on an H200, "
                    f"not on this card, and the allocator needs slack: a fit needs {MARGIN:.0%} of the card free")
        return f"does NOT fit {card}: {where}, {-self.headroom_gib:.2f} GiB over"

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "shape": self.shape,
            "preset": self.preset,
            "card": self.card,
            "device": self.device,
            "gpu_gib": self.gpu_gib,
            "settings": self.settings,
            "params": self.params,
            "phases": [p.to_dict() for p in self.phases],
            "peak_phase": self.peak.name,
            "peak_gib": round(self.peak_gib, 4),
            "fits": self.fits,
            "status": self.status,
            "margin": MARGIN,
            "headroom_gib": None if self.headroom_gib is None else round(self.headroom_gib, 4),
            "verdict": self.verdict(),
            "suggestion": None if self.suggestion is None else self.suggestion.to_dict(),
            "assumptions": asdict(self.assumptions),
            "notes": self.notes,
            "workers_host": {role: [c.to_dict() for c in comps] for role, comps in self.workers.items()},
            "workers_host_gib": round(self.workers_host_gib, 4),
            "distributed": self.distributed,
            "time": None if self.timing is None else self.timing.to_dict(),
            "generation": self.generation,
            "critic": self.critic,
            "checkpointing": self.checkpointing,
        }


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# Share of the card a plan must leave free at its peak to be called a fit. The allocated bytes are
# calibrated to within 5% of three runs measured on an NVIDIA H200 (docs/memory.md); the margin also
# covers what max_memory_allocated does not see and was not measured under memory pressure (allocator
# fragmentation, the CUDA context) and cards of other kinds. A thinner margin is only "tight".
MARGIN = 0.10


# ---- the API ------------------------------------------------------------------------------------------
def settings_of(cfg: RunConfig) -> dict[str, Any]:
    """The config values the plan depends on (dotted keys)."""
    return {
        "algorithm": cfg.algorithm,
        "rollout.batch_size": cfg.rollout.batch_size,
        "rollout.chunk_size": cfg.rollout.chunk_size,
        "rollout.generation_chunk": cfg.rollout.generation_chunk,
        "rollout.max_prompt_len": cfg.rollout.max_prompt_len,
        "rollout.max_new_tokens": cfg.rollout.max_new_tokens,
        "ppo.mini_batch_size": cfg.ppo.mini_batch_size,
        "ppo.micro_batch_size": cfg.ppo.micro_batch_size,
        "ppo.logprob_chunk_size": cfg.ppo.logprob_chunk_size,
        "training.gradient_checkpointing": cfg.training.gradient_checkpointing,
        "training.checkpoint_every_n_layers": cfg.training.checkpoint_every_n_layers,
        "training.activation_offload": cfg.training.activation_offload,
        "actor.optimizer": cfg.actor.optimizer,
        "critic.optimizer": cfg.critic.optimizer,
        "actor.lora.r": cfg.actor.lora.r,
        "critic.lora.r": cfg.critic.lora.r,
        "critic.shared_adapter": cfg.critic.shared_adapter,
        "critic.model": cfg.critic.model,
        "quant.load_in_4bit": cfg.quant.load_in_4bit,
        "quant.double_quant": cfg.quant.double_quant,
        "quant.compute_dtype": cfg.quant.compute_dtype,
        "quant.upcast_non_quantized": cfg.quant.upcast_non_quantized,
        "ref.backend": cfg.ref.backend,
        "reward.backend": cfg.reward.backend,
        "distributed.gpus": cfg.distributed.gpus,
        "distributed.fsdp": cfg.distributed.fsdp,
    }


def param_counts(cfg: RunConfig, shape: ModelShape) -> dict[str, int]:
    """Parameters by kind: the base's parts, the adapters and the value head."""
    return {
        "total": shape.total_params,
        "quantized_linear": shape.linear_weight_params,
        "embeddings": shape.embedding_params,
        "lm_head": shape.lm_head_params,
        "norms": shape.norm_params,
        "biases": shape.linear_bias_params,
        "experts": shape.expert_weight_params,
        "router_and_expert_biases": shape.moe_small_params,
        "lora_actor": shape.adapter_params(cfg.actor.lora),
        "lora_critic": 0 if cfg.critic.shared_adapter or not cfg.has_critic else shape.adapter_params(cfg.critic.lora),
        "value_head": shape.hidden_size + 1 if cfg.has_critic else 0,
        "lora_reward": sum(rc.backend == "adapter" for _, rc in cfg.reward.all_rewards())
        * shape.adapter_params(cfg.rm.lora),
    }




def memory_view(cfg: RunConfig) -> RunConfig:
    """``cfg`` as the memory plan counts it: an unresolved ``reward.backend: auto`` as ``adapter``, the
    choice that holds the most memory the plan counts (an ``hf`` reward's model is counted by
    :func:`homerlhf.memory.placement.extra_gpu_bytes`), ``llamacpp`` under ``rollout.async``."""
    if cfg.reward.backend != "auto":
        return cfg
    backend = "llamacpp" if cfg.rollout.async_ else "adapter"
    return cfg.model_copy(update={"reward": cfg.reward.model_copy(update={"backend": backend})})


def persistent_of(cfg: RunConfig, shape: ModelShape, assumptions: Assumptions) -> list[Component]:
    """What one GPU holds in every phase: weights, adapters, optimizer states, buffers, workspaces."""
    persistent = per_gpu_persistent(cfg, shape, persistent_components(cfg, shape, assumptions))  # one GPU's
    return persistent + engine_components(cfg, shape, on_gpu=True)  # the llamacpp engine's layers on the GPU


def phase_plan(cfg: RunConfig, shape: ModelShape, assumptions: Assumptions, name: str,
               persistent: list[Component], **kwargs: Any) -> PhasePlan:
    """Phase ``name`` at its peak moment: ``persistent`` + its transients + the overhead outside the
    allocator. ``kwargs`` go to the phase's builder (generation: ``chunk``)."""
    moment, transient = PHASE_BUILDERS[name](cfg, shape, assumptions, **kwargs)
    transient += gradient_sync_components(cfg, shape) if name == "update" else []
    comps = persistent + transient
    allocated = sum(x.bytes for x in comps if x.in_allocator)
    return PhasePlan(name, moment, comps + overhead_components(cfg, allocated, assumptions))


def build_plan(cfg: RunConfig, shape: ModelShape, gpu_gib: Optional[float] = None, *,
               assumptions: Assumptions = Assumptions()) -> Plan:
    """Bytes per component per phase for ``cfg`` on ``shape``; ``gpu_gib`` defaults to the card's.

    ``cfg.rollout.generation_chunk`` must not be ``auto`` (resolve it first:
    :func:`homerlhf.memory.chunks.resolve_generation_chunk`); nothing is suggested here.
    """
    from homerlhf.memory.components import dtype_bytes, kv_bytes_per_token

    budget = cfg.card.gpu_gib if gpu_gib is None else float(gpu_gib)
    cfg = memory_view(cfg)
    assumptions = for_shape(assumptions, shape)
    persistent = persistent_of(cfg, shape, assumptions)
    phases = [phase_plan(cfg, shape, assumptions, name, persistent) for name in PHASES]
    notes = []
    if cfg.reward.backend == "hf":
        notes.append("reward.backend=hf: the in-process reward model's memory is not included")
    if cfg.ref.backend == "adapter_off":
        notes.append("ref.backend=adapter_off: reference log-probs are one more no-grad forward in scoring")
    if any(rc.backend == "adapter" for _, rc in cfg.reward.all_rewards()):
        notes.append("reward.backend=adapter: the reward LoRA (as rm.lora) + score head on the shared base, "
                     "scored by one more no-grad forward in scoring (ppo.micro_batch_size sequences)")
    _, a, _ = dtype_bytes(cfg, assumptions)
    return Plan(
        model=shape.name,
        shape=shape.to_dict(),
        preset=cfg.preset,
        card=cfg.card.name if gpu_gib is None else "GPU",
        device=cfg.card.device,
        gpu_gib=budget,
        settings=settings_of(cfg),
        params=param_counts(cfg, shape),
        phases=phases,
        assumptions=assumptions,
        notes=notes,
        workers=workers_host_bytes(cfg, shape),
        distributed=distributed_summary(cfg),
        generation={"chunk": cfg.rollout.generation_chunk_size, "setting": cfg.rollout.generation_chunk,
                    "kv_bytes_per_token": kv_bytes_per_token(shape, a)},
    )
