"""The pieces of a memory plan: byte counts of what a PPO run keeps on the GPU.

Each function counts one kind of memory (NF4 weights, LoRA adapters, optimizer states, saved
activations, log-prob buffers, ...) from a :class:`~homerlhf.memory.shapes.ModelShape` and a
``RunConfig``; :mod:`homerlhf.memory.phases` puts them together per phase. Formulas and their
sources are in ``docs/memory.md``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Iterable, Optional

from homerlhf.config.schema import RunConfig
from homerlhf.memory.experts import (chunk_bytes as experts_chunk_bytes, experts_nf4_bytes, moe_layer_transient,
                                     moe_saved_per_token)
from homerlhf.memory.shapes import ModelShape, critic_shape

GIB = 1024**3
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

    cuda_context_gib: float = 0.5  # CUDA context and kernels, outside the torch allocator (not measured)
    fragmentation: float = 0.10  # reserved-but-unallocated blocks, as a fraction of allocated bytes
    attention: str = "sdpa"  # "sdpa" never materialises (T x T) scores; "eager" does
    scoring_batch: str = "chunk"  # scoring forwards run on a whole rollout chunk ("micro": micro-batches)
    # PyTorch gives each (cuBLAS handle, stream) a workspace from its caching allocator: 32 MiB on
    # compute capability 9.x-12.x (Hopper, Blackwell), 8.125 MiB before. Handles are per thread: one
    # for the trainer's thread and one for autograd's backward thread (made at the first backward),
    # each on its default stream; the static decoder's side stream adds one (the trainer's handle on
    # it: :func:`cublas_workspaces`). Counted at the larger size on every card.
    cublas_workspace_mib: float = 32.0
    cublas_handles: int = 2
    # The optimizer has stepped: its states exist, and the last step's gradients are still held through
    # the next generation and scoring (the next update's zero_grad frees them). False: the first
    # iteration, before any step (or while an fp16 loss scaler has skipped every step so far).
    after_first_step: bool = True
    # Whether those gradients are held; None: as ``after_first_step``. False for the iteration right
    # after a resume: the checkpoint's optimizer states are loaded, but new parameters have no gradients.
    held_gradients: Optional[bool] = None
    # The generation phase's decoder: "hf" (HF generate, a DynamicCache grown by torch.cat), "static" (a
    # decode loop over a preallocated static cache, its step captured as a CUDA graph) or "any": the larger.
    decoder: str = "any"


def for_shape(assumptions: Assumptions, shape: ModelShape) -> Assumptions:
    """``assumptions`` for a model whose attention transformers runs eager (gpt-oss's sinks) whatever is assumed."""
    return replace(assumptions, attention="eager") if shape.eager_attention else assumptions


@dataclass
class Component:
    name: str
    kind: str  # weights | adapters | optimizer | gradients | activations | kv_cache | logits | buffers | overhead
    bytes: int
    in_allocator: bool = True  # counted by torch.cuda.max_memory_allocated
    note: str = ""
    dtype: str = ""  # what the bytes hold: "nf4", "bf16", "fp32", "8-bit", "int64", ...; "" for mixed or none

    @property
    def gib(self) -> float:
        return self.bytes / GIB

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gib": round(self.gib, 4)}


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


def _optimizer_state_bytes(shape: ModelShape, lora, optimizer: str) -> int:
    """Adam's states for one adapter's LoRA matrices (A: r x in, B: out x r) in every layer; on the
    experts (``lora.experts``) one A (r E x in) and one B (out x r E) per fused weight."""
    r = lora.r
    numels = [n for lin in _targeted(shape, lora.target_modules) for n in (r * lin.in_features, lin.out_features * r)]
    if getattr(lora, "experts", False) and shape.is_moe:
        e = shape.num_experts
        numels += [n for out, inp in shape.expert_matrices() for n in (r * e * inp, out * r * e)]
    return adam_state_bytes(numels, optimizer) * shape.num_layers


def layer_saved_bytes_per_token(shape: ModelShape, a: int, t: int, lora_r: int, targets="all-linear",
                                lora_experts: bool = False) -> float:
    """Bytes one decoder layer saves for backward, per token (frozen 4-bit base + fp32 LoRA, sdpa).

    a: activation bytes, t: sequence length. Saved: each RMSNorm's fp32 input (its ``pow`` and
    ``mul``: 4h per norm whatever a); sdpa's q, GQA-repeated k and v, and output (4 q_dim); the MLP's
    gate, act(gate) and up (3 I); the additive attention mask (t per token); each LoRA A output (r,
    fp32); each LoRA A input, in LoRA's fp32: with a = 4 that is the tensor the layer made (the norm
    outputs, 2h, and the MLP's product, I, at a), with 16-bit activations peft's fp32 copy of it, one
    per adapted linear (4 x its in-features). A frozen 4-bit matmul saves no input: its input-gradient
    needs only the weight (bitsandbytes ``MatMul4Bit``). Checked against saved-tensor hooks in the tests.
    A mixture of experts: the attention as here (LoRA on it: the attention norm's output is its input) and
    what its MoE layer saves (:func:`homerlhf.memory.experts.moe_saved_per_token`).
    """
    h, i, q = shape.hidden_size, shape.intermediate_size, shape.q_dim
    linears = _targeted(shape, targets)
    if shape.is_moe:  # attention as below; the experts' own (homerlhf.memory.experts)
        moe = moe_saved_per_token(shape, a, lora_r, lora_experts)
        inputs = a * h if a == 4 else 4 * sum(lin.in_features for lin in linears)
        return a * (4 * q + t) + 4 * lora_r * len(linears) + 8 * h + inputs + moe
    shared = a * (3 * i + 4 * q + t) + 4 * lora_r * len(linears)
    if a == 4:  # LoRA reads the layer's own fp32 tensors
        return shared + 8 * h + a * (2 * h + i)
    return shared + 8 * h + 4 * sum(lin.in_features for lin in linears)


def _targeted(shape: ModelShape, targets) -> list:
    """The decoder layer's linears LoRA adapts (``lora.target_modules``)."""
    linears = shape.layer_linears()
    return linears if targets == "all-linear" else [lin for lin in linears if lin.name in set(targets)]


def forward_layer_transient_per_token(shape: ModelShape, a: int, c: int, lora_mlp: bool = True) -> float:
    """Peak extra bytes per token while one layer runs without grad: residual + normed, then the
    larger of attention (q, repeated k/v, output) and the MLP.

    MLP under LoRA (peft's 4-bit ``Linear``, LoRA in fp32): while ``up_proj`` runs, act(gate) is alive
    beside the base output's defensive clone, the LoRA B output and it times its scale: (2a + 8) I,
    and with 16-bit activations peft's fp32 copy of the input too (4h). Without LoRA on the MLP (the
    adapter-off reference): act(gate), up and their product, 3 a I (or act(gate) and up in both
    dtypes, 2 a I + c I, were that larger). These match the allocator's events of a real peft +
    bitsandbytes MLP exactly, with a = 4 and with a = 2 (``tests/memory/test_components.py``).
    """
    h, i, q = shape.hidden_size, shape.intermediate_size, shape.q_dim
    if shape.is_moe:  # its experts' layer per token; the dequantized chunk is a weight transient
        mlp = moe_layer_transient(shape, 1, a, c, lora_mlp)
    else:
        mlp = (2 * a + 8) * i + (4 * h if a != 4 else 0) if lora_mlp else max(3 * a, 2 * a + c) * i
    attention = 4 * a * q + (c * h if c != a else 0)
    if lora_mlp and a != 4:  # o_proj's LoRA on a 16-bit attention output: its fp32 copy, B's output, scaled
        attention = max(attention, a * q + 4 * q + 2 * a * h + 8 * h)
    return 2 * a * h + max(attention, mlp)


def lora_on_mlp(lora, shape: Optional[ModelShape] = None) -> bool:
    """Whether a LoRA section (``actor.lora``, ``rm.lora``) adapts the MLP's up projection (of a mixture of
    experts ``shape``: the experts, ``lora.experts``)."""
    if shape is not None and shape.is_moe:
        return bool(getattr(lora, "experts", False))
    return lora.target_modules == "all-linear" or bool({"up_proj", "gate_up_proj"} & set(lora.target_modules))


def dequantized_bytes(cfg: RunConfig, shape: ModelShape, c: int) -> int:
    """The largest weight a 4-bit forward dequantizes at once: the largest linear, or a mixture of
    experts' chunk of experts (``quant.expert_chunk_mib``) when larger."""
    chunk = experts_chunk_bytes(cfg, shape, c) if shape.is_moe else 0
    return max(shape.largest_linear_params * c, chunk)


def trainable_grad_bytes(cfg: RunConfig, shape: ModelShape) -> int:
    """fp32 gradients of everything PPO trains: the actor's LoRA, and the critic's LoRA (unless shared)
    and value head, on the critic's own base with ``critic.model``."""
    grads = shape.adapter_params(cfg.actor.lora) * 4
    on = critic_shape(cfg) or shape
    if cfg.has_critic:
        grads += (on.hidden_size + 1) * 4
    if cfg.has_critic and not cfg.critic.shared_adapter:
        grads += on.adapter_params(cfg.critic.lora) * 4
    return grads


def critic_base_components(cfg: RunConfig, assumptions: Assumptions) -> list[Component]:
    """``critic.model``'s frozen base: its decoder's linears (NF4, or the compute dtype without 4-bit),
    embeddings, norms and biases as the policy's; no LM head (the critic loads its decoder alone)."""
    own = critic_shape(cfg)
    if own is None:
        return []
    c, _, nq = dtype_bytes(cfg, assumptions)
    compute, _ = dtype_names(cfg)
    if cfg.quant.load_in_4bit:
        linears = Component("critic base linear weights (NF4)", "weights",
                            int(own.linear_weight_params * nf4_bytes_per_param(cfg.quant.double_quant)),
                            note=own.name, dtype=cfg.quant.quant_type)
    else:
        linears = Component("critic base linear weights", "weights", own.linear_weight_params * c, note=own.name,
                            dtype=compute)
    rest = (own.embedding_params + own.norm_params + own.linear_bias_params) * nq
    return [linears, Component("critic base embeddings + norms + biases", "weights", rest,
                               dtype="fp32" if nq == 4 else compute, note="no LM head")]


def held_gradients(cfg: RunConfig, shape: ModelShape, assumptions: Assumptions) -> list[Component]:
    """The last optimizer step's gradients, held through generation and scoring until the next update
    zeroes them (``optimizer.zero_grad(set_to_none=True)`` at its start); none before the first step."""
    held = assumptions.after_first_step if assumptions.held_gradients is None else assumptions.held_gradients
    if not held:
        return []
    return [Component("gradients held from the last step", "gradients", trainable_grad_bytes(cfg, shape),
                      note="freed when the next update starts", dtype="fp32")]


def kv_bytes_per_token(shape: ModelShape, a: int) -> int:
    """K and V of every layer for one token: 2 x layers x kv_heads x head_dim x ``a`` bytes (the
    activation dtype: a 4-bit base's k/v projections return their input's dtype, so fp32 under
    ``quant.upcast_non_quantized``, the compute dtype otherwise)."""
    return 2 * shape.num_layers * shape.kv_dim * a


def lengths(cfg: RunConfig) -> tuple[int, int, int]:
    p, n = cfg.rollout.max_prompt_len, cfg.rollout.max_new_tokens
    return p, n, p + n


def dtype_bytes(cfg: RunConfig, assumptions: Assumptions = Assumptions()) -> tuple[int, int, int]:
    """(compute c, activation a, non-quantized parameter) bytes: a 4-bit base under
    ``quant.upcast_non_quantized`` keeps its other weights, and so the residual stream, in fp32;
    otherwise both are in the compute dtype."""
    c = _DTYPE_BYTES[compute_name(cfg)]
    upcast = cfg.quant.load_in_4bit and cfg.quant.upcast_non_quantized
    return c, (4 if upcast else c), (4 if upcast else c)


def compute_name(cfg: RunConfig) -> str:
    """The compute dtype's name ("auto": bf16 on CUDA, fp32 on a CPU)."""
    name = cfg.quant.compute_dtype
    if name == "auto":
        return "bf16" if cfg.card.device == "cuda" else "fp32"
    return name


def dtype_names(cfg: RunConfig) -> tuple[str, str]:
    """(compute, activation) dtype names, for the plan's dtype column."""
    c, a, _ = dtype_bytes(cfg)
    compute = compute_name(cfg)
    return compute, (compute if a == c else "fp32")


def persistent_components(cfg: RunConfig, shape: ModelShape, assumptions: Assumptions) -> list[Component]:
    c, a, nq = dtype_bytes(cfg, assumptions)
    compute, _ = dtype_names(cfg)
    nq_name = "fp32" if nq == 4 else compute
    comps = []
    if cfg.quant.load_in_4bit:
        per = nf4_bytes_per_param(cfg.quant.double_quant)
        note = f"{per:.4f} B/param: 4-bit codes + absmax per {NF4_BLOCK}" + (" (double quant)" if cfg.quant.double_quant else "")
        comps.append(Component("base linear weights (NF4)", "weights", int(shape.linear_weight_params * per), note=note,
                               dtype=cfg.quant.quant_type))
    else:
        comps.append(Component("base linear weights", "weights", shape.linear_weight_params * c, dtype=compute))
    comps.extend(experts_components(cfg, shape, c, nq))
    why = ["quant.upcast_non_quantized"] if nq != c else []
    tied = ["tied LM head"] if shape.tie_word_embeddings else []
    logits = [] if nq == 4 else ["fp32 logits, fp32 accumulation"]
    comps.append(Component("embeddings", "weights", shape.embedding_params * nq, dtype=nq_name,
                           note="; ".join(why + tied + (logits if tied else []))))
    if shape.lm_head_params:
        comps.append(Component("LM head", "weights", shape.lm_head_params * nq, note="; ".join(why + logits),
                               dtype=nq_name))
    comps.append(Component("norms + biases", "weights", (shape.norm_params + shape.linear_bias_params) * nq,
                           dtype=nq_name, note="compute in fp32 inside" if nq != 4 else ""))
    actor_lora = shape.adapter_params(cfg.actor.lora)
    comps.append(Component("LoRA actor", "adapters", actor_lora * 4, dtype="fp32",
                           note=f"r={cfg.actor.lora.r}" + (" (+ experts)" if lora_on_mlp(cfg.actor.lora, shape)
                                                            and shape.is_moe else "")))
    comps.extend(critic_adapter_components(cfg, shape) + critic_base_components(cfg, assumptions))
    comps.extend(adapter_reward_components(cfg, shape))
    comps.extend(workspace_components(cfg, assumptions))
    roles = (("actor", cfg.actor), ("critic", cfg.critic)) if cfg.has_critic else (("actor", cfg.actor),)
    for role, sec in roles if assumptions.after_first_step else ():  # states are made at the first step
        on = (critic_shape(cfg) or shape) if role == "critic" else shape
        if role == "critic" and cfg.critic.shared_adapter:
            states = 8 * (on.hidden_size + 1)  # only the value head
        else:
            states = _optimizer_state_bytes(on, sec.lora, sec.optimizer)
            if role == "critic":
                states += 8 * (on.hidden_size + 1)
        paged = sec.optimizer.startswith("paged")
        comps.append(Component(
            f"optimizer states {role} ({sec.optimizer})", "optimizer", states, in_allocator=not paged,
            note="unified memory, evictable to CPU" if paged else "",
            dtype="fp32" if sec.optimizer == "adamw" else "8-bit",
        ))
    _, n, t = lengths(cfg)
    # ids + attention mask (int64) per position; ~8 fp32 per response token (log-probs, ref log-probs,
    # values, rewards, advantages, returns, masks).
    exp = cfg.rollout.batch_size * (t * 16 + n * 8 * 4)
    comps.append(Component("experience buffer", "buffers", exp, note=f"{cfg.rollout.batch_size} samples",
                           dtype="int64 + fp32"))
    if cfg.rollout.async_:
        # The batch sampled ahead, while this one trains: ids, masks, behaviour and reference log-probs.
        ahead = cfg.rollout.batch_size * (t * 16 + n * 2 * 4)
        comps.append(Component("experience batch ahead (async)", "buffers", ahead,
                               note=f"{cfg.rollout.batch_size} samples", dtype="int64 + fp32"))
    return comps


def experts_components(cfg: RunConfig, shape: ModelShape, c: int, nq: int) -> list[Component]:
    """A mixture of experts' experts (NF4 with a 4-bit base, else the compute dtype) and its router, expert
    biases and attention sinks (the non-quantized dtype); nothing for a dense model."""
    if not shape.is_moe:
        return []
    where = f"{shape.num_layers} layers x {shape.num_experts} experts"
    if cfg.quant.load_in_4bit:
        experts = Component("experts (NF4)", "weights", experts_nf4_bytes(shape, cfg.quant.double_quant),
                            dtype=cfg.quant.quant_type, note=f"{where}, quantized per expert")
    else:
        experts = Component("experts", "weights", shape.expert_weight_params * c, dtype=compute_name(cfg), note=where)
    small = Component("router + expert biases + sinks", "weights", shape.moe_small_params * nq,
                      dtype="fp32" if nq == 4 else compute_name(cfg), note="frozen")
    return [experts, small]


def critic_adapter_components(cfg: RunConfig, shape: ModelShape) -> list[Component]:
    """The critic's LoRA (none when shared) and value head, fp32, on its own base's shape with
    ``critic.model``; nothing without a critic (GRPO / RLOO)."""
    if not cfg.has_critic:
        return []
    on = critic_shape(cfg) or shape
    where = f" on {on.name}" if on is not shape else ""
    lora = [] if cfg.critic.shared_adapter else [Component(
        "LoRA critic", "adapters", on.adapter_params(cfg.critic.lora) * 4,
        note=f"r={cfg.critic.lora.r}{where}", dtype="fp32")]
    return lora + [Component("value head", "adapters", (on.hidden_size + 1) * 4, dtype="fp32", note=where.strip())]


def adapter_reward_components(cfg: RunConfig, shape: ModelShape) -> list[Component]:
    """Each ``reward.backend: adapter`` reward on the policy's base: its LoRA (shaped as ``rm.lora``,
    which ``homerlhf reward`` trains with) and score head, fp32; no copy of the base."""
    count = sum(rc.backend == "adapter" for _, rc in cfg.reward.all_rewards())
    if not count:
        return []
    lora = cfg.rm.lora
    per = shape.adapter_params(lora) * 4 + shape.hidden_size * 4
    return [Component("LoRA reward + score head", "adapters", count * per, dtype="fp32",
                      note=f"{count} x (r={lora.r} as rm.lora; head 1 x {shape.hidden_size})")]


def planned_decoder(cfg: RunConfig, assumptions: Assumptions) -> str:
    """The decoder the generation phase is planned for: the assumption, narrowed by ``rollout.decoder``
    when the config names one (``auto`` may fall back from the captured loop to HF generate: both)."""
    if assumptions.decoder != "any":
        return assumptions.decoder
    return cfg.rollout.decoder if cfg.rollout.decoder in ("hf", "static") else "any"


def cublas_workspaces(cfg: RunConfig, assumptions: Assumptions) -> int:
    """(cuBLAS handle, stream) pairs with a workspace: each handle on its thread's default stream, and
    the trainer's handle on the static decoder's side stream (its warm-up and capture run there, and a
    warm-up runs before a step can be declined), when that decoder may run (``static`` or ``any``)."""
    return assumptions.cublas_handles + (planned_decoder(cfg, assumptions) != "hf")


def workspace_components(cfg: RunConfig, assumptions: Assumptions) -> list[Component]:
    """cuBLAS workspaces: allocated by PyTorch's caching allocator at a (handle, stream)'s first matmul, kept."""
    if cfg.card.device != "cuda":
        return []
    n, mib = cublas_workspaces(cfg, assumptions), assumptions.cublas_workspace_mib
    side = n - assumptions.cublas_handles
    where = f"{assumptions.cublas_handles} handle{'s' * (assumptions.cublas_handles != 1)} on the default stream"
    return [Component("cuBLAS workspaces", "overhead", int(n * mib * 2**20),
                      note=f"{n} x {mib:g} MiB: {where}" + (" + the static decoder's side stream" if side else ""))]


def overhead_components(cfg: RunConfig, allocated: int, assumptions: Assumptions) -> list[Component]:
    if cfg.card.device != "cuda":
        return []
    return [
        Component("CUDA context", "overhead", int(assumptions.cuda_context_gib * GIB), in_allocator=False),
        Component("allocator fragmentation", "overhead", int(assumptions.fragmentation * allocated), in_allocator=False,
                  note=f"{assumptions.fragmentation:.0%} of allocated"),
    ]


def logprob_buffer_bytes(batch: int, n: int, cfg: RunConfig, shape: ModelShape) -> int:
    """fp32 (B, chunk, V) logits, log-softmax, softmax (entropy) and its product/grad: 4 buffers."""
    chunk = min(cfg.ppo.logprob_chunk_size, n)
    return 4 * batch * chunk * shape.vocab_size * 4

