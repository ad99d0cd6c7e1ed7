"""Host RAM of the local llama.cpp workers, against hand-derived byte counts."""

from __future__ import annotations

from homerlhf.config import load_config
from homerlhf.memory.host import LOGSOFTMAX_CHUNK_BYTES, worker_components, workers_host_bytes
from homerlhf.memory.planner import plan
from homerlhf.memory.shapes import resolve_shape


def _bytes(comps) -> dict[str, int]:
    return {c.name: c.bytes for c in comps}


def test_qwen25_7b_workers_of_the_4090_preset_by_hand(preset_named):
    cfg = preset_named()  # ref f16, reward q8_0; 512 + 256 tokens -> KV of 1024 cells
    shape = resolve_shape("Qwen/Qwen2.5-7B")  # 28 layers, 4 KV heads x 128, vocab 152,064, hidden 3,584
    ref = _bytes(worker_components(cfg, shape, "ref"))
    assert ref["GGUF weights"] == shape.total_params * 2
    assert ref["KV cache"] == 1024 * 28 * 2 * 4 * 128 * 2 == 58_720_256  # cells x layers x (k, v) x kv_dim x f16
    assert ref["logits buffer"] == 1024 * 152_064 * 4 == 622_854_144  # min(1024, 64 x 256) output rows
    assert ref["log-softmax chunk"] == LOGSOFTMAX_CHUNK_BYTES == 16 * 1024**2
    reward = _bytes(worker_components(cfg, shape, "reward"))
    # no LM head in a reward backbone; q8_0 = 34 bytes per 32 weights
    assert reward["GGUF weights"] == int((shape.total_params - 152_064 * 3_584) * 34 / 32)
    assert reward["embeddings buffer"] == 1024 * 3_584 * 4
    assert "log-softmax chunk" not in reward


def test_only_local_llamacpp_workers_are_counted_and_the_plan_carries_them(preset_named):
    shape = resolve_shape("Qwen/Qwen2.5-7B")
    assert list(workers_host_bytes(preset_named(), shape)) == ["ref", "reward"]
    remote = preset_named("4090", "ref.backend=adapter_off", "reward.url=http://cpu-box:8601")
    assert workers_host_bytes(remote, shape) == {}
    p = plan(preset_named("4090", "ref.f32_kv_cache=true"), shape)
    assert _bytes(p.workers["ref"])["KV cache"] == 2 * 58_720_256
    total = sum(c.bytes for comps in p.workers.values() for c in comps)
    assert p.to_dict()["workers_host_gib"] == round(total / 1024**3, 4)


def test_the_llamacpp_engine_copy_of_the_base_in_host_ram_or_on_the_gpu_by_hand(preset_named):
    shape = resolve_shape("Qwen/Qwen2.5-7B")  # 28 layers, 4 KV heads x 128, vocab 152,064
    base = preset_named()  # 512 + 256 tokens, chunk of 16 (the preset's)
    chunk = base.rollout.chunk_size
    tokens = chunk * (512 + 256)
    kv = tokens * 28 * 2 * 4 * 128 * 2  # cells x layers x (k, v) x kv_dim x f16
    assert "engine" not in workers_host_bytes(base, shape)  # the hf engine: no copy

    host = preset_named("4090", "rollout.engine=llamacpp")  # f16 export, no layer offloaded
    engine = _bytes(workers_host_bytes(host, shape)["engine"])
    assert engine == {"engine GGUF base": shape.total_params * 2, "engine KV cache": kv,
                      "engine logits rows": chunk * 152_064 * 4}
    p_host = plan(host, shape)
    assert p_host.peak_gib == plan(base, shape).peak_gib  # nothing on the GPU

    gpu = preset_named("4090", "rollout.engine=llamacpp", "rollout.engine_gpu_layers=-1")
    p_gpu = plan(gpu, shape)
    on_gpu = _bytes(c for c in p_gpu.phases[0].components if c.name.startswith("engine"))
    assert on_gpu == {"engine GGUF base": shape.total_params * 2, "engine KV cache": kv}
    assert p_gpu.peak_gib > p_host.peak_gib + shape.total_params * 2 / 1024**3 * 0.99
    assert _bytes(p_gpu.workers["engine"]) == {"engine logits rows": chunk * 152_064 * 4}
    assert p_gpu.phases[0].allocated_gib == p_host.phases[0].allocated_gib  # llama.cpp's, not torch's allocator

    half = preset_named("4090", "rollout.engine=llamacpp", "rollout.engine_gpu_layers=14")  # 14 of 28
    split = plan(half, shape)
    gpu_part = _bytes(c for c in split.phases[0].components if c.name.startswith("engine"))
    assert gpu_part["engine GGUF base"] == int(shape.total_params * 2 * 0.5)
    assert _bytes(split.workers["engine"])["engine GGUF base"] == int(shape.total_params * 2 * 0.5)


def test_async_mode_holds_one_more_batch_of_experience_by_hand(preset_named):
    shape = resolve_shape("Qwen/Qwen2.5-7B")
    sync = plan(preset_named("4090", "rollout.engine=llamacpp"), shape)
    cfg = preset_named("4090", "rollout.engine=llamacpp", "rollout.async=true")
    ahead = _bytes(plan(cfg, shape).phases[0].components)["experience batch ahead (async)"]
    b, p, n = cfg.rollout.batch_size, cfg.rollout.max_prompt_len, cfg.rollout.max_new_tokens
    assert ahead == b * ((p + n) * 16 + n * 2 * 4)  # int64 ids + mask per position, 2 fp32 log-probs per token
    assert plan(cfg, shape).phases[0].allocated_bytes == sync.phases[0].allocated_bytes + ahead
