"""The memory planner: bytes per component for each PPO phase, a verdict for a card, and suggestions.

Pure functions on a :class:`~homerlhf.memory.shapes.ModelShape` and a ``RunConfig``; nothing is
loaded or allocated. Formulas and their sources are in ``docs/memory.md``. What the trainer does,
and so what is counted:

- the base is NF4 (``bnb_4bit_use_double_quant``) and ``prepare_model_for_kbit_training`` casts every
  other parameter (embeddings, LM head, norms) to fp32 — and with them the residual stream, so
  activations and the KV cache are fp32 too (``Assumptions.upcast_non_quantized``);
- **generation** samples ``rollout.chunk_size`` prompts at a time with a KV cache;
- **scoring** runs no-grad forwards of the actor (old log-probs), critic (values) and, with
  ``ref.backend: adapter_off``, the adapter-less base, on a rollout chunk; log-probs are computed
  ``ppo.logprob_chunk_size`` positions at a time;
- **update** runs forward/backward on ``ppo.micro_batch_size`` sequences, accumulating LoRA grads
  of actor and critic over a mini-batch; optimizer states stay resident between iterations.

A phase's peak is the largest of a few moments (e.g. prefill vs. last decode step); the components
shown are those of the peak moment, so they add up to the phase total.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional

from homerlhf.config.schema import RunConfig
from homerlhf.memory.shapes import ModelShape

GIB = 1024**3
PHASES = ("generation", "scoring", "update")
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# bitsandbytes NF4: two 4-bit codes per byte, one absmax per 64-weight block. Double quant stores
# that absmax as 8 bits plus one fp32 constant per 256 absmax values.
NF4_BLOCK = 64
NF4_DQ_BLOCK = 256
# bitsandbytes 8-bit optimizers: blockwise quantized states (block 256, fp32 absmax); tensors with
# fewer than 4096 elements keep 32-bit states (Optimizer8bit's min_8bit_size).
OPT8_BLOCK = 256
OPT8_MIN_SIZE = 4096


def nf4_bytes_per_param(double_quant: bool) -> float:
    if double_quant:
        return 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_DQ_BLOCK)
    return 0.5 + 4 / NF4_BLOCK


@dataclass(frozen=True)
class Assumptions:
    """What the estimate cannot read from the config; defaults follow homerlhf's trainer."""

    cuda_context_gib: float = 0.5  # CUDA context + cuBLAS workspace, outside the torch allocator
    fragmentation: float = 0.10  # reserved-but-unallocated blocks, as a fraction of allocated bytes
    upcast_non_quantized: bool = True  # prepare_model_for_kbit_training: non-4-bit params to fp32
    attention: str = "sdpa"  # "sdpa" never materialises (T x T) scores; "eager" does
    scoring_batch: str = "chunk"  # scoring forwards run on a whole rollout chunk ("micro": micro-batches)


@dataclass
class Component:
    name: str
    kind: str  # weights | adapters | optimizer | gradients | activations | kv_cache | logits | buffers | overhead
    bytes: int
    in_allocator: bool = True  # counted by torch.cuda.max_memory_allocated
    note: str = ""

    @property
    def gib(self) -> float:
        return self.bytes / GIB

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gib": round(self.gib, 4)}


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

    @property
    def peak(self) -> PhasePlan:
        return max(self.phases, key=lambda p: p.total_bytes)

    @property
    def peak_gib(self) -> float:
        return self.peak.total_gib

    @property
    def fits(self) -> Optional[bool]:
        """None when there is no GPU budget to compare with (a CPU preset without --gpu-gib)."""
        return None if self.gpu_gib <= 0 else self.peak_gib <= self.gpu_gib

    @property
    def headroom_gib(self) -> Optional[float]:
        return None if self.gpu_gib <= 0 else self.gpu_gib - self.peak_gib

    def phase(self, name: str) -> PhasePlan:
        return next(p for p in self.phases if p.name == name)

    def verdict(self) -> str:
        peak = self.peak
        where = f"peak {peak.total_gib:.2f} GiB in {peak.name} ({peak.moment})"
        if self.fits is None:
            return f"{where}; no GPU budget to check ({self.device} preset; pass --gpu-gib to plan for a card)"
        if self.fits:
            return f"fits {self.card} ({self.gpu_gib:g} GiB): {where}, {self.headroom_gib:.2f} GiB headroom"
        return f"does NOT fit {self.card} ({self.gpu_gib:g} GiB): {where}, {-self.headroom_gib:.2f} GiB over"

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
            "headroom_gib": None if self.headroom_gib is None else round(self.headroom_gib, 4),
            "verdict": self.verdict(),
            "suggestion": None if self.suggestion is None else self.suggestion.to_dict(),
            "assumptions": asdict(self.assumptions),
            "notes": self.notes,
        }


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# ---- the pieces -------------------------------------------------------------------------------------
def adam_state_bytes(numels: Iterable[int], optimizer: str) -> int:
    """Bytes of Adam's two moments for parameters of these sizes under ``optimizer``."""
    total = 0
    for numel in numels:
        if optimizer == "adamw" or numel < OPT8_MIN_SIZE:
            total += 8 * numel  # exp_avg + exp_avg_sq in fp32
        else:
            # two uint8 states, their fp32 absmax per block and two 256-entry fp32 quantile maps
            total += 2 * numel + 2 * 4 * math.ceil(numel / OPT8_BLOCK) + 2 * 256 * 4
    return total


def _optimizer_state_bytes(shape: ModelShape, r: int, targets, optimizer: str) -> int:
    """Adam's states for one adapter's LoRA matrices (A: r x in, B: out x r) in every layer."""
    linears = shape.layer_linears()
    if targets != "all-linear":
        linears = [lin for lin in linears if lin.name in set(targets)]
    numels = [n for lin in linears for n in (r * lin.in_features, lin.out_features * r)]
    return adam_state_bytes(numels, optimizer) * shape.num_layers


def _layer_saved_bytes_per_token(shape: ModelShape, a: int, t: int, lora_r: int) -> float:
    """Bytes one decoder layer saves for backward, per token (frozen 4-bit base + LoRA, sdpa).

    a: activation bytes, t: sequence length. Saved: each RMSNorm's input and output (the output is
    the LoRA A input; 2h per norm); sdpa's q, GQA-repeated k and v, and output (4 q_dim); the
    MLP's gate, act(gate), up and their product (4 I); the additive attention mask (t per token);
    each LoRA A output (r). A frozen 4-bit matmul saves no input: its input-gradient needs only the
    weight (bitsandbytes ``MatMul4Bit``). Checked against saved-tensor hooks in the tests.
    """
    h, i, q = shape.hidden_size, shape.intermediate_size, shape.q_dim
    n_lin = len(shape.layer_linears())
    return a * (4 * h + 4 * q + 4 * i + t) + 4 * lora_r * n_lin


def _forward_layer_transient_per_token(shape: ModelShape, a: int, c: int) -> float:
    """Peak extra bytes per token while one layer runs without grad: residual + normed, then the
    larger of attention (q, repeated k/v, output) and MLP (act(gate), up, product + its cast)."""
    h, i, q = shape.hidden_size, shape.intermediate_size, shape.q_dim
    return 2 * a * h + max(4 * a * q + c * h, 3 * a * i + c * i)


def _lengths(cfg: RunConfig) -> tuple[int, int, int]:
    p, n = cfg.rollout.max_prompt_len, cfg.rollout.max_new_tokens
    return p, n, p + n


def _dtype_bytes(cfg: RunConfig, assumptions: Assumptions) -> tuple[int, int, int]:
    """(compute c, activation a, non-quantized parameter) bytes."""
    name = cfg.quant.compute_dtype
    if name == "auto":
        name = "bf16" if cfg.card.device == "cuda" else "fp32"
    c = _DTYPE_BYTES[name]
    upcast = cfg.quant.load_in_4bit and assumptions.upcast_non_quantized
    return c, (4 if upcast else c), (4 if upcast else c)


def _persistent(cfg: RunConfig, shape: ModelShape, assumptions: Assumptions) -> list[Component]:
    c, a, nq = _dtype_bytes(cfg, assumptions)
    comps = []
    if cfg.quant.load_in_4bit:
        per = nf4_bytes_per_param(cfg.quant.double_quant)
        note = f"{per:.4f} B/param: 4-bit codes + absmax per {NF4_BLOCK}" + (" (double quant)" if cfg.quant.double_quant else "")
        comps.append(Component("base linear weights (NF4)", "weights", int(shape.linear_weight_params * per), note=note))
    else:
        comps.append(Component("base linear weights", "weights", shape.linear_weight_params * c))
    dtype = "fp32" if nq == 4 else "compute dtype"
    comps.append(Component("embeddings", "weights", shape.embedding_params * nq, note=dtype + (", tied LM head" if shape.tie_word_embeddings else "")))
    if shape.lm_head_params:
        comps.append(Component("LM head", "weights", shape.lm_head_params * nq, note=dtype))
    comps.append(Component("norms + biases", "weights", shape.norm_params * nq + shape.linear_bias_params * c))
    actor_lora = shape.lora_params(cfg.actor.lora.r, cfg.actor.lora.target_modules)
    comps.append(Component("LoRA actor", "adapters", actor_lora * 4, note=f"r={cfg.actor.lora.r}, fp32"))
    if not cfg.critic.shared_adapter:
        critic_lora = shape.lora_params(cfg.critic.lora.r, cfg.critic.lora.target_modules)
        comps.append(Component("LoRA critic", "adapters", critic_lora * 4, note=f"r={cfg.critic.lora.r}, fp32"))
    comps.append(Component("value head", "adapters", (shape.hidden_size + 1) * 4))
    for role, sec in (("actor", cfg.actor), ("critic", cfg.critic)):
        if role == "critic" and cfg.critic.shared_adapter:
            states = 8 * (shape.hidden_size + 1)  # only the value head
        else:
            states = _optimizer_state_bytes(shape, sec.lora.r, sec.lora.target_modules, sec.optimizer)
            if role == "critic":
                states += 8 * (shape.hidden_size + 1)
        paged = sec.optimizer.startswith("paged")
        comps.append(Component(
            f"optimizer states {role} ({sec.optimizer})", "optimizer", states, in_allocator=not paged,
            note="unified memory, evictable to CPU" if paged else "",
        ))
    _, n, t = _lengths(cfg)
    # ids + attention mask (int64) per position; ~8 fp32 per response token (log-probs, ref log-probs,
    # values, rewards, advantages, returns, masks).
    exp = cfg.rollout.batch_size * (t * 16 + n * 8 * 4)
    comps.append(Component("experience buffer", "buffers", exp, note=f"{cfg.rollout.batch_size} samples"))
    return comps


def _overhead(cfg: RunConfig, allocated: int, assumptions: Assumptions) -> list[Component]:
    if cfg.card.device != "cuda":
        return []
    return [
        Component("CUDA context", "overhead", int(assumptions.cuda_context_gib * GIB), in_allocator=False),
        Component("allocator fragmentation", "overhead", int(assumptions.fragmentation * allocated), in_allocator=False,
                  note=f"{assumptions.fragmentation:.0%} of allocated"),
    ]


def _logprob_buffers(batch: int, n: int, cfg: RunConfig, shape: ModelShape) -> int:
    """fp32 (B, chunk, V) logits, log-softmax, softmax (entropy) and its product/grad: 4 buffers."""
    chunk = min(cfg.ppo.logprob_chunk_size, n)
    return 4 * batch * chunk * shape.vocab_size * 4


def _generation(cfg, shape, assumptions) -> tuple[str, list[Component]]:
    c, a, _ = _dtype_bytes(cfg, assumptions)
    b = cfg.rollout.chunk_size
    p, n, t = _lengths(cfg)
    kv_per_token = 2 * shape.num_layers * shape.kv_dim * a
    logits_per_row = shape.vocab_size * (16 + (12 if cfg.rollout.top_p < 1 else 0))
    dequant = Component("dequantized weight", "activations", shape.largest_linear_params * c,
                        note="largest linear, bf16 copy per matmul") if cfg.quant.load_in_4bit else None
    prefill = b * p * _forward_layer_transient_per_token(shape, a, c) + b * p * p * a  # + the additive causal mask
    if assumptions.attention == "eager":
        prefill += 2 * b * shape.num_heads * p * p * a
    moments = {
        "prefill": [
            Component("KV cache", "kv_cache", b * p * kv_per_token, note=f"{b} x {p} prompt tokens"),
            Component("prefill activations", "activations", int(prefill), note=f"one layer over {b} x {p} tokens"),
            Component("sampling logits", "logits", b * logits_per_row, note="last position, fp32 + warpers"),
        ],
        "last decode step": [
            # DynamicCache grows by torch.cat: one layer's K or V briefly exists twice.
            Component("KV cache", "kv_cache", b * t * kv_per_token * (shape.num_layers + 1) // shape.num_layers,
                      note=f"{b} x {t} tokens, 2 x {shape.num_layers} layers x {shape.kv_dim} x {a} B"),
            Component("decode activations", "activations", int(b * _forward_layer_transient_per_token(shape, a, c))),
            Component("sampling logits", "logits", b * logits_per_row, note="fp32 + warpers"),
        ],
    }
    for comps in moments.values():
        if dequant:
            comps.append(dequant)
    return _largest(moments)


def _scoring(cfg, shape, assumptions) -> tuple[str, list[Component]]:
    c, a, _ = _dtype_bytes(cfg, assumptions)
    b = cfg.rollout.chunk_size if assumptions.scoring_batch == "chunk" else cfg.ppo.micro_batch_size
    p, n, t = _lengths(cfg)
    hidden = b * t * shape.hidden_size * a
    layer = b * t * _forward_layer_transient_per_token(shape, a, c) + b * t * t * a
    if assumptions.attention == "eager":
        layer += 2 * b * shape.num_heads * t * t * a
    outputs = b * n * 4 * 4  # log-probs, entropy, values, ref log-probs: (B, N) fp32
    moments = {
        "forward (actor/critic/ref)": [
            Component("hidden states", "activations", hidden, note=f"{b} x {t} tokens ({assumptions.scoring_batch})"),
            Component("layer activations (no grad)", "activations", int(layer)),
        ],
        "actor log-probs": [
            Component("hidden states", "activations", hidden, note=f"{b} x {t} tokens"),
            Component("log-prob chunk buffers", "logits", _logprob_buffers(b, n, cfg, shape),
                      note=f"{b} x {min(cfg.ppo.logprob_chunk_size, n)} x {shape.vocab_size} fp32 x 4"),
            Component("scoring outputs", "buffers", outputs),
        ],
    }
    if cfg.quant.load_in_4bit:
        moments["forward (actor/critic/ref)"].append(
            Component("dequantized weight", "activations", shape.largest_linear_params * c))
    return _largest(moments)


def _update(cfg, shape, assumptions) -> tuple[str, list[Component]]:
    c, a, _ = _dtype_bytes(cfg, assumptions)
    m = cfg.ppo.micro_batch_size
    p, n, t = _lengths(cfg)
    tokens = m * t
    r = max(cfg.actor.lora.r, cfg.critic.lora.r)
    per_layer = _layer_saved_bytes_per_token(shape, a, t, r)
    h, i = shape.hidden_size, shape.intermediate_size
    ckpt = cfg.training.gradient_checkpointing
    if ckpt:
        saved = Component("checkpointed layer inputs", "activations", tokens * h * a * (shape.num_layers + 1),
                          note=f"{m} x {t} tokens x {shape.num_layers + 1} x h")
        recompute = Component("recomputed layer", "activations", int(tokens * per_layer), note="one layer in backward")
    else:
        saved = Component("saved activations", "activations", int(tokens * per_layer * shape.num_layers + tokens * h * a),
                          note=f"{m} x {t} tokens x {shape.num_layers} layers, no checkpointing")
        recompute = None
    attn_scores = None
    if assumptions.attention == "eager":
        count = 1 if ckpt else shape.num_layers
        attn_scores = Component("attention scores", "activations", 2 * count * m * shape.num_heads * t * t * a)
    bwd = Component("backward transients", "activations", tokens * (2 * i + 2 * h) * a, note="grads of one layer's MLP")
    grads = shape.lora_params(cfg.actor.lora.r, cfg.actor.lora.target_modules) * 4 + (shape.hidden_size + 1) * 4
    if not cfg.critic.shared_adapter:
        grads += shape.lora_params(cfg.critic.lora.r, cfg.critic.lora.target_modules) * 4
    grad = Component("LoRA + value head grads", "gradients", grads, note="fp32, accumulated over the mini-batch")
    lp = Component("log-prob chunk buffers", "logits", _logprob_buffers(m, n, cfg, shape),
                   note=f"{m} x {min(cfg.ppo.logprob_chunk_size, n)} x {shape.vocab_size} fp32 x 4, recomputed per chunk")
    loss = Component("PPO loss tensors", "buffers", m * n * 4 * 12)
    layer_bwd = [grad, saved] + ([recompute] if recompute else []) + [bwd]
    if attn_scores:
        layer_bwd.append(attn_scores)
    moments = {
        "actor loss backward": [grad, saved, lp, loss] + ([attn_scores] if attn_scores and not ckpt else []),
        "layer backward": layer_bwd,
    }
    if cfg.quant.load_in_4bit:
        dq = Component("dequantized weight", "activations", shape.largest_linear_params * c)
        for comps in moments.values():
            comps.append(dq)
    return _largest(moments)


def _largest(moments: dict[str, list[Component]]) -> tuple[str, list[Component]]:
    name = max(moments, key=lambda k: sum(x.bytes for x in moments[k]))
    return name, moments[name]


# ---- the API ------------------------------------------------------------------------------------------
def settings_of(cfg: RunConfig) -> dict[str, Any]:
    """The config values the plan depends on (dotted keys)."""
    return {
        "rollout.batch_size": cfg.rollout.batch_size,
        "rollout.chunk_size": cfg.rollout.chunk_size,
        "rollout.max_prompt_len": cfg.rollout.max_prompt_len,
        "rollout.max_new_tokens": cfg.rollout.max_new_tokens,
        "ppo.mini_batch_size": cfg.ppo.mini_batch_size,
        "ppo.micro_batch_size": cfg.ppo.micro_batch_size,
        "ppo.logprob_chunk_size": cfg.ppo.logprob_chunk_size,
        "training.gradient_checkpointing": cfg.training.gradient_checkpointing,
        "actor.optimizer": cfg.actor.optimizer,
        "critic.optimizer": cfg.critic.optimizer,
        "actor.lora.r": cfg.actor.lora.r,
        "critic.lora.r": cfg.critic.lora.r,
        "critic.shared_adapter": cfg.critic.shared_adapter,
        "quant.load_in_4bit": cfg.quant.load_in_4bit,
        "quant.double_quant": cfg.quant.double_quant,
        "quant.compute_dtype": cfg.quant.compute_dtype,
        "ref.backend": cfg.ref.backend,
        "reward.backend": cfg.reward.backend,
    }


def plan(
    cfg: RunConfig,
    shape: ModelShape,
    gpu_gib: Optional[float] = None,
    *,
    assumptions: Assumptions = Assumptions(),
    with_suggestion: bool = True,
) -> Plan:
    """Bytes per component per phase for ``cfg`` on ``shape``; ``gpu_gib`` defaults to the card's.

    When the plan does not fit, ``plan.suggestion`` holds overrides that do (see :func:`suggest`).
    """
    budget = cfg.card.gpu_gib if gpu_gib is None else float(gpu_gib)
    persistent = _persistent(cfg, shape, assumptions)
    phases = []
    for name, build in (("generation", _generation), ("scoring", _scoring), ("update", _update)):
        moment, transient = build(cfg, shape, assumptions)
        comps = persistent + transient
        allocated = sum(x.bytes for x in comps if x.in_allocator)
        phases.append(PhasePlan(name, moment, comps + _overhead(cfg, allocated, assumptions)))
    notes = []
    if cfg.reward.backend == "hf":
        notes.append("reward.backend=hf: the in-process reward model's memory is not included")
    if cfg.ref.backend == "adapter_off":
        notes.append("ref.backend=adapter_off: reference log-probs are one more no-grad forward in scoring")
    params = {
        "total": shape.total_params,
        "quantized_linear": shape.linear_weight_params,
        "embeddings": shape.embedding_params,
        "lm_head": shape.lm_head_params,
        "norms": shape.norm_params,
        "biases": shape.linear_bias_params,
        "lora_actor": shape.lora_params(cfg.actor.lora.r, cfg.actor.lora.target_modules),
        "lora_critic": 0 if cfg.critic.shared_adapter else shape.lora_params(cfg.critic.lora.r, cfg.critic.lora.target_modules),
        "value_head": shape.hidden_size + 1,
    }
    result = Plan(
        model=shape.name,
        shape=shape.to_dict(),
        preset=cfg.preset,
        card=cfg.card.name if gpu_gib is None else "GPU",
        device=cfg.card.device,
        gpu_gib=budget,
        settings=settings_of(cfg),
        params=params,
        phases=phases,
        assumptions=assumptions,
        notes=notes,
    )
    if with_suggestion and result.fits is False:
        result.suggestion = suggest(cfg, shape, budget, assumptions=assumptions)
    return result


def apply_overrides(cfg: RunConfig, overrides: dict[str, Any]) -> RunConfig:
    """A new validated config with dotted-key overrides (the config itself is never mutated)."""
    from homerlhf.config.loader import deep_merge, validate

    nested: dict[str, Any] = {}
    for key, value in overrides.items():
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return validate(deep_merge(cfg.model_dump(mode="python"), nested))


def _halvings(value: int) -> list[int]:
    out = [value]
    while out[-1] > 1:
        out.append(max(1, out[-1] // 2))
    return out


def _round_len(value: float) -> int:
    return max(16, int(value) // 16 * 16)


LENGTH_SCALES = (1.0, 0.75, 0.5, 0.375, 0.25)
EIGHT_BIT = "paged_adamw_8bit"


def candidate_overrides(cfg: RunConfig) -> Iterable[tuple[tuple[float, float], dict[str, Any]]]:
    """(cost, overrides) over micro-batch, rollout chunk, lengths, checkpointing and optimizer.

    Cost is (share of length cut, slowdown proxy): shorter sequences change the task, so they come
    last; among the rest, checkpointing costs ~30% speed, each halving of micro-batch or chunk ~15%.
    """
    mini = cfg.ppo.mini_batch_size
    micros = [m for m in range(cfg.ppo.micro_batch_size, 0, -1) if mini % m == 0]
    chunks = _halvings(cfg.rollout.chunk_size)
    ckpts = sorted({cfg.training.gradient_checkpointing, True})
    optims = [None] + ([EIGHT_BIT] if (cfg.actor.optimizer, cfg.critic.optimizer) != (EIGHT_BIT, EIGHT_BIT) else [])
    for micro, chunk, scale, ckpt, optim in itertools.product(micros, chunks, LENGTH_SCALES, ckpts, optims):
        over: dict[str, Any] = {}
        if micro != cfg.ppo.micro_batch_size:
            over["ppo.micro_batch_size"] = micro
        if chunk != cfg.rollout.chunk_size:
            over["rollout.chunk_size"] = chunk
        if scale != 1.0:
            over["rollout.max_prompt_len"] = _round_len(cfg.rollout.max_prompt_len * scale)
            over["rollout.max_new_tokens"] = _round_len(cfg.rollout.max_new_tokens * scale)
        if ckpt != cfg.training.gradient_checkpointing:
            over["training.gradient_checkpointing"] = ckpt
        if optim:
            over["actor.optimizer"] = optim
            over["critic.optimizer"] = optim
        slowdown = (
            0.3 * (ckpt and not cfg.training.gradient_checkpointing)
            + 0.05 * bool(optim)
            + 0.15 * math.log2(cfg.ppo.micro_batch_size / micro)
            + 0.15 * math.log2(cfg.rollout.chunk_size / chunk)
        )
        yield (1.0 - scale, slowdown), over


def suggest(
    cfg: RunConfig,
    shape: ModelShape,
    gpu_gib: Optional[float] = None,
    *,
    assumptions: Assumptions = Assumptions(),
) -> Optional[Suggestion]:
    """The cheapest overrides (see :func:`candidate_overrides`) whose plan fits; None if none does."""
    budget = cfg.card.gpu_gib if gpu_gib is None else float(gpu_gib)
    if budget <= 0:
        return None
    best: Optional[tuple[tuple[float, float], dict[str, Any], Plan]] = None
    for cost, over in candidate_overrides(cfg):
        if best is not None and cost >= best[0]:
            continue
        trial = plan(apply_overrides(cfg, over), shape, budget, assumptions=assumptions, with_suggestion=False)
        if trial.fits:
            best = (cost, over, trial)
    if best is None:
        return None
    _, over, trial = best
    return Suggestion(overrides=over, peak_gib=trial.peak_gib, headroom_gib=trial.headroom_gib)


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


def predicted_peaks(cfg: RunConfig, model_path: Optional[str] = None) -> dict[str, float]:
    """``{phase: predicted allocated GiB}`` to log beside ``PhaseMeter.peaks()`` at run time.

    ``model_path``: the resolved local model dir (default: ``cfg.model.name_or_path``).
    """
    from homerlhf.memory.shapes import resolve_shape

    shape = resolve_shape(model_path or cfg.model.name_or_path, revision=cfg.model.revision)
    result = plan(cfg, shape, with_suggestion=False)
    return {p.name: p.allocated_gib for p in result.phases}
