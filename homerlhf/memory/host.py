"""Host RAM of a run's local llama.cpp workers: bytes per component, counted like the GPU plan.

Counted per worker: the GGUF weights (memory-mapped, so resident once read), the KV cache of one
packed decode, llama.cpp's output buffer (the ref worker's logits rows, the reward worker's
embeddings), and the ref worker's log-softmax transient, which
:func:`homerlhf.workers.logsoftmax.token_logprobs` bounds to :data:`LOGSOFTMAX_CHUNK_BYTES`.
Not counted: llama.cpp's compute buffer (graph intermediates of one decode) and the Python server.

The ``llamacpp`` rollout engine (in the trainer's process) holds one more copy of the base, its KV
cache for one rollout chunk and that chunk's logits rows: in host RAM, or, for the layers a CUDA
build offloads (``rollout.engine_gpu_layers``), in GPU memory outside torch's allocator
(:func:`engine_components`; the GPU share goes into the GPU plan).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from homerlhf.memory.components import Component
from homerlhf.memory.recompute import offload_host_components
from homerlhf.memory.shapes import ModelShape

if TYPE_CHECKING:  # pragma: no cover
    from homerlhf.config.schema import RunConfig

# The ref worker's log-softmax works on at most this many bytes of float32 logits rows at a time.
LOGSOFTMAX_CHUNK_BYTES = 16 * 1024**2
# The engine's defaults (homerlhf.workers.engine.Engine): tokens per decode and sequences per pack.
DECODE_TOKENS = 1024
MAX_SEQS = 64
GGUF_BYTES_PER_PARAM = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}  # q8_0: 32 int8 + an f16 scale


def worker_kv_tokens(cfg: "RunConfig", role: str) -> int:
    """KV cells of a worker the trainer starts: one decode packs up to max(ctx, 1024) tokens."""
    rc = getattr(cfg, role)
    ctx = rc.ctx or (cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens)
    return max(ctx, DECODE_TOKENS)


def worker_components(cfg: "RunConfig", shape: ModelShape, role: str) -> list[Component]:
    """What one local ``role`` worker (``ref`` or ``reward``) holds in host RAM at its peak.

    ``shape``: the served model's (the reward model is taken to have the policy's shape when it is
    trained from the policy's base, which is how ``homerlhf reward`` builds it)."""
    rc = getattr(cfg, role)
    kv = worker_kv_tokens(cfg, role)
    # A reward backbone has no LM head (its score head is a vector, kept in Python).
    params = shape.total_params - (shape.lm_head_params if role == "reward" else 0)
    weights = int(params * GGUF_BYTES_PER_PARAM[rc.outtype])
    kv_bytes = kv * shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * (4 if rc.f32_kv_cache else 2)
    comps = [
        Component("GGUF weights", "weights", weights, in_allocator=False, note=f"{rc.outtype}, memory-mapped"),
        Component("KV cache", "kv_cache", kv_bytes, in_allocator=False,
                  note=f"{kv} tokens, {'f32' if rc.f32_kv_cache else 'f16'}"),
    ]
    if role == "ref":
        rows = min(kv, MAX_SEQS * cfg.rollout.max_new_tokens)  # one output row per response token of a decode
        comps.append(Component("logits buffer", "logits", rows * shape.vocab_size * 4, in_allocator=False,
                               note=f"{rows} rows x {shape.vocab_size} float32"))
        chunk = min(rows * shape.vocab_size * 4, max(LOGSOFTMAX_CHUNK_BYTES, shape.vocab_size * 4))
        comps.append(Component("log-softmax chunk", "activations", chunk, in_allocator=False,
                               note="float32 rows, one chunk at a time"))
    else:
        comps.append(Component("embeddings buffer", "buffers", kv * shape.hidden_size * 4, in_allocator=False,
                               note=f"{kv} tokens x {shape.hidden_size} float32"))
    return comps


def engine_gpu_fraction(cfg: "RunConfig", shape: ModelShape) -> float:
    """The share of the engine's layers (weights and KV cache) on the GPU: 0 unless the run trains
    on CUDA with the llamacpp engine and offloads layers."""
    layers = cfg.rollout.engine_gpu_layers
    if cfg.rollout.engine != "llamacpp" or cfg.card.device != "cuda" or layers == 0:
        return 0.0
    return 1.0 if layers < 0 else min(layers, shape.num_layers) / shape.num_layers


def engine_components(cfg: "RunConfig", shape: ModelShape, on_gpu: bool) -> list[Component]:
    """The llamacpp engine's memory on the GPU (``on_gpu``) or in host RAM; nothing for the hf
    engine. Weights and KV cache split by :func:`engine_gpu_fraction`; the logits rows of one
    decode stay in host memory."""
    rollout = cfg.rollout
    if rollout.engine != "llamacpp":
        return []
    share = engine_gpu_fraction(cfg, shape)
    share = share if on_gpu else 1.0 - share
    tokens = rollout.chunk_size * (rollout.max_prompt_len + rollout.max_new_tokens)
    weights = shape.total_params * GGUF_BYTES_PER_PARAM[rollout.engine_outtype]
    kv = tokens * shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * (4 if rollout.engine_f32_kv_cache else 2)
    where = f"{share:.0%} of the layers" if 0 < share < 1 else ""
    comps = [
        Component("engine GGUF base", "weights", int(weights * share), in_allocator=False,
                  note=", ".join(x for x in (rollout.engine_outtype, where) if x)),
        Component("engine KV cache", "kv_cache", int(kv * share), in_allocator=False,
                  note=f"{tokens} tokens, {'f32' if rollout.engine_f32_kv_cache else 'f16'}"),
    ]
    if not on_gpu:
        comps.append(Component("engine logits rows", "logits", rollout.chunk_size * shape.vocab_size * 4,
                               in_allocator=False, note=f"{rollout.chunk_size} x {shape.vocab_size} float32"))
    return [c for c in comps if c.bytes > 0]


def workers_host_bytes(cfg: "RunConfig", shape: ModelShape) -> dict[str, list[Component]]:
    """``{role: components}`` for every worker the run starts on this machine, and the llamacpp
    rollout engine's host share (role ``engine``), and the pinned memory of ``training.activation_offload``
    (role ``activation offload``)."""
    from homerlhf.memory.threads import local_worker_roles

    out = {role: worker_components(cfg, shape, role) for role in local_worker_roles(cfg)}
    engine = engine_components(cfg, shape, on_gpu=False)
    if engine:
        out["engine"] = engine
    offload = offload_host_components(cfg, shape)  # training.activation_offload: pinned, not a worker's
    if offload:
        out["activation offload"] = offload
    return out
