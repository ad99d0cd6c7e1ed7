"""``homerlhf bench``: tokens/s of every kind of work an iteration does, measured on this machine.

For the run's model (or, when its weights are not on this machine, a random-init stand-in built from
its shape: throughput depends on the shape, not on the weights' values) (:func:`bench`): a llama.cpp
ref worker and reward worker scoring, each its own process over HTTP as in a run, at each thread count
a placement would give them (:func:`homerlhf.memory.threads.split_threads`); the llamacpp rollout
engine generating (``rollout.engine_threads`` or all cores); the policy as the trainer loads it
generating with HF ``generate``, one no-grad forward and one forward + backward on the trainer device
(CPU: at each thread share; a GPU: a generation chunk at the run's lengths, scaled by chunk in the
time model). The figures go to a JSON file in the cache (``bench/``), keyed by the machine (CPU model,
physical cores, torch, its device and the GPU's name) and the model's shape and dtypes, where
``homerlhf plan`` and a run's ``auto`` placement find them (:func:`cached_throughputs`).
"""

from __future__ import annotations

import hashlib
import json
import platform
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from homerlhf.config.schema import RunConfig
from homerlhf.errors import UserError
from homerlhf.memory.shapes import ModelShape
from homerlhf.memory.threads import physical_cores, run_thread_shares, split_threads
from homerlhf.memory.timing import RATES, Throughputs

QUICK_PROMPT, QUICK_NEW, QUICK_SEQS = 24, 12, 4
QUICK_GPU_NEW = 16  # decode steps a quick bench times on a GPU


# ---- the cache ----------------------------------------------------------------------------------------
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name(device: str) -> Optional[str]:
    """The GPU a ``cuda`` trainer runs on (its name is part of the cache key), None elsewhere."""
    import torch

    return torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else None


def machine_info(device: str) -> dict[str, Any]:
    """What the figures depend on besides the model: CPU, physical cores, torch, the GPU."""
    import torch

    return {"cpu": cpu_name(), "cores": physical_cores(), "torch": torch.__version__, "device": device,
            "gpu": gpu_name(device)}


def source_label(device: str, kind: str, quick: bool) -> str:
    """Where measured figures come from: the date, the GPU (a ``cuda`` trainer's) and the CPU."""
    gpu = gpu_name(device)
    machine = f"{gpu} + {cpu_name()}" if gpu else cpu_name()
    return (f"measured {time.strftime('%Y-%m-%d')} on {machine} ({physical_cores()} cores)"
            + ("" if kind == "model" else ", stand-in") + (", quick" if quick else ""))


def model_info(cfg: RunConfig, shape: ModelShape) -> dict[str, Any]:
    """The model as far as its speed goes: its shape (not its name or weights) and the dtypes the
    run computes and exports in."""
    dims = {k: v for k, v in shape.to_dict().items() if k not in ("name", "source", "published_params_b")}
    return {"shape": dims, "quant": cfg.quant.model_dump(), "ref_outtype": cfg.ref.outtype,
            "reward_outtype": cfg.reward.outtype, "engine_outtype": cfg.rollout.engine_outtype,
            "f32_kv_cache": [cfg.ref.f32_kv_cache, cfg.reward.f32_kv_cache], "lora_r": cfg.actor.lora.r}


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_path(cfg: RunConfig, shape: ModelShape) -> Path:
    from homerlhf.paths import cache_dir

    return cache_dir("bench") / f"{_digest(machine_info(cfg.card.device))}-{_digest(model_info(cfg, shape))}.json"


def cached_throughputs(cfg: RunConfig, shape: ModelShape) -> Optional[Throughputs]:
    """The figures ``homerlhf bench`` measured for this machine and model, or None."""
    path = cache_path(cfg, shape)
    try:
        return Throughputs.from_dict(json.loads(path.read_text())["throughputs"])
    except (OSError, ValueError, KeyError):
        return None


def _save(cfg: RunConfig, shape: ModelShape, rates: Throughputs, details: dict[str, Any]) -> Path:
    path = cache_path(cfg, shape)
    record = {"machine": machine_info(cfg.card.device), "model": model_info(cfg, shape),
              "throughputs": rates.to_dict(), "details": details}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)
    return path


# ---- the models measured ------------------------------------------------------------------------------
def standin_dir(shape: ModelShape, kind: str = "causal") -> Path:
    """A random-init ``kind`` (``causal`` or ``reward``: sequence classifier) model of ``shape``,
    built once into the cache, with the builtin tokenizer (its embedding keeps the shape's rows)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from homerlhf.paths import cache_dir
    from homerlhf.tiny import build_tokenizer

    out = cache_dir("bench", "standin", f"{kind}-{_digest(model_info_shape(shape))}")
    if (out / "config.json").is_file():
        return out
    tokenizer = build_tokenizer()
    config = shape.to_hf_config()
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    torch.manual_seed(0)
    if kind == "reward":
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def model_info_shape(shape: ModelShape) -> dict[str, Any]:
    return {k: v for k, v in shape.to_dict().items() if k not in ("name", "source", "published_params_b")}


def policy_dir(cfg: RunConfig, shape: ModelShape, standin: bool) -> tuple[Path, str]:
    """(the policy's model dir, "model" or "stand-in"): the run's own when it is on this machine."""
    from homerlhf.models.registry import resolve_model_dir

    if not standin:
        try:
            return resolve_model_dir(cfg.model.name_or_path), "model"
        except UserError:
            pass
    return standin_dir(shape), "stand-in"


def reward_dir(cfg: RunConfig, shape: ModelShape, standin: bool) -> Path:
    """The exported reward dir to time: the run's reward model when it has one here, else a stand-in
    of the policy's shape."""
    from homerlhf.workers.backends import cached_reward_dir

    if not standin and cfg.reward.backend in ("llamacpp", "hf") and cfg.reward.model:
        try:
            return cached_reward_dir(cfg.reward.model, cfg.reward.outtype)
        except UserError:
            pass
    return cached_reward_dir(str(standin_dir(shape, "reward")), cfg.reward.outtype)


# ---- timing -------------------------------------------------------------------------------------------
def _ids(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def best_seconds(fn: Callable[[], Any], repeat: int = 2, sync: Optional[Callable[[], None]] = None) -> float:
    """Best seconds of ``repeat`` calls of ``fn()`` after a warm-up call (the first call allocates
    buffers; the best of a few is the least disturbed by other processes). ``sync``: waits for the
    work ``fn`` queued (``torch.cuda.synchronize`` on a GPU, whose kernels run asynchronously)."""
    sync = sync or (lambda: None)
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def thread_plan(cfg: RunConfig, cores: int, quick: bool = False) -> tuple[list[int], list[int]]:
    """(worker threads, trainer threads) to measure: what 1 or 2 local workers, with the trainer on
    the CPU or not, would each get (explicit ``threads`` settings included); trainer [0] on a GPU.
    ``quick``: only what the config's own placement gives (the time model scales the others)."""
    on_cpu = cfg.card.device == "cpu"
    if quick:
        shares = run_thread_shares(cfg, cores)
        worker = shares.worker or split_threads(cores, 1, on_cpu).worker
        return sorted({cfg.ref.threads or worker, cfg.reward.threads or worker}), [shares.trainer] if on_cpu else [0]
    workers = {split_threads(cores, k, on_cpu).worker for k in (1, 2)}
    workers |= {t for t in (cfg.ref.threads, cfg.reward.threads) if t}
    trainer = sorted({split_threads(cores, k, True).trainer for k in (0, 1, 2)}) if on_cpu else [0]
    return sorted(workers), trainer


def worker_rate(role: str, model: Path, threads: int, prompts, responses, f32_kv: bool) -> float:
    """Tokens/s of a llama.cpp ``role`` worker (its own process, over HTTP, as a run uses it)
    scoring the pairs: prompt + response tokens per second of request."""
    from homerlhf.workers.backends import connect
    from homerlhf.workers.process import WorkerProcess

    ctx = len(prompts[0]) + len(responses[0])
    backend = connect(role, process=WorkerProcess(role, model, threads=threads, ctx=ctx, f32_kv_cache=f32_kv))
    try:
        call = backend.logprobs if role == "ref" else backend.score
        seconds = best_seconds(lambda: call(prompts, responses))
    finally:
        backend.close()
    return len(prompts) * ctx / seconds


def trainer_rates(policy, cfg: RunConfig, prompts, responses, gen_new: Optional[int] = None,
                  train_rows: Optional[int] = None) -> dict[str, float]:
    """Tokens/s of the policy on its device: HF generation (generated tokens, chunk of ``prompts``,
    ``gen_new`` new tokens each, default the responses' length), a no-grad actor forward and an actor
    forward + backward (of the first ``train_rows`` sequences; prompt + response tokens)."""
    import torch

    from homerlhf.ppo.engines import HFEngine
    from homerlhf.ppo.rollout import pad_sequences

    new = len(responses[0])
    sync = torch.cuda.synchronize if policy.device.type == "cuda" else None
    rollout = cfg.rollout.model_copy(update={"max_new_tokens": gen_new or new, "max_prompt_len": len(prompts[0])})
    engine = HFEngine(policy)
    steps = []
    gen_s = best_seconds(lambda: steps.append(engine.generate(prompts, rollout).response_ids.shape[1]), sync=sync)
    p_ids, p_mask = pad_sequences(prompts, policy.tokenizer.pad_token_id, "left", policy.device)
    r_ids, r_mask = pad_sequences(responses, policy.tokenizer.pad_token_id, "right", policy.device)
    ids, mask = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1)
    rows = train_rows or len(ids)

    def forward():
        with torch.no_grad():
            policy.actor_logprobs(ids, mask, new)

    def train():
        logprobs, _ = policy.actor_logprobs(ids[:rows], mask[:rows], new)
        logprobs.sum().backward()
        policy.model.zero_grad(set_to_none=True)

    policy.model.train()
    fwd_s, train_s = best_seconds(forward, sync=sync), best_seconds(train, sync=sync)
    return {"trainer_gen": len(prompts) * steps[-1] / gen_s, "trainer_forward": ids.numel() / fwd_s,
            "trainer_train": ids[:rows].numel() / train_s}


def bench(cfg: RunConfig, shape: ModelShape, *, quick: bool = False, force: bool = False,
          standin: bool = False, say: Callable[[str], None] = print) -> tuple[Throughputs, Path, bool]:
    """Measure (or, unless ``force``, read from the cache) this machine's throughputs for ``cfg``'s
    model. Returns (the figures, the cache file, whether they were measured now).

    ``quick``: QUICK_SEQS sequences of QUICK_PROMPT + QUICK_NEW tokens at the config's own thread
    shares (tiny counts: under a minute on 2 cores for the tiny models); else a rollout chunk at the
    run's lengths, at every thread share a placement could give. A policy on a GPU is timed on
    :func:`gpu_inputs` either way (tiny counts would time kernel launches, not the card)."""
    from tqdm.auto import tqdm

    cached = None if force else cached_throughputs(cfg, shape)
    if cached is not None and (quick or not cached.source.endswith(", quick")):  # a full bench replaces quick figures
        return cached, cache_path(cfg, shape), False
    ro = cfg.rollout
    n = min(ro.chunk_size, QUICK_SEQS) if quick else ro.chunk_size
    p_len, r_len = (min(ro.max_prompt_len, QUICK_PROMPT), min(ro.max_new_tokens, QUICK_NEW)) if quick \
        else (ro.max_prompt_len, ro.max_new_tokens)
    worker_threads, trainer_threads = thread_plan(cfg, physical_cores(), quick)
    prompts, responses = _ids(n, p_len, min(shape.vocab_size, 512), 0), _ids(n, r_len, min(shape.vocab_size, 512), 1)
    rates: dict[str, dict[int, float]] = {k: {} for k in RATES}
    steps = ["prepare models"] + [f"{role} worker, {t} threads" for role in ("ref", "reward") for t in worker_threads] \
        + [f"policy on {cfg.card.device}" + (f", {t} threads" if t else "") for t in trainer_threads] + ["llamacpp engine"]
    bar = tqdm(total=len(steps), desc="bench", unit="step")
    step = bar.set_postfix_str
    step(steps[0])
    model_dir, kind = policy_dir(cfg, shape, standin)
    ref_gguf = _ref_gguf(cfg, model_dir)
    rm_dir = reward_dir(cfg, shape, standin or kind == "stand-in")
    bar.update(1)
    for role, path in (("ref", ref_gguf), ("reward", rm_dir)):
        for t in worker_threads:
            step(f"{role} worker, {t} threads")
            kv = getattr(cfg, role).f32_kv_cache
            rates[f"worker_{role}"][t] = worker_rate(role, path, t, prompts, responses, kv)
            bar.update(1)
    policy = _load_policy(cfg, model_dir)
    gpu = gpu_inputs(cfg, shape, quick) if policy.device.type == "cuda" else None
    try:
        for t in trainer_threads:
            step(f"policy on {cfg.card.device}" + (f", {t} threads" if t else ""))
            with _torch_threads(t):
                measured = trainer_rates(policy, cfg, *gpu) if gpu else trainer_rates(policy, cfg, prompts, responses)
                for key, value in measured.items():
                    rates[key][t] = value
            bar.update(1)
        step("llamacpp engine")
        engine_t = ro.engine_threads or _logical_cores()
        rates["llama_gen"][engine_t] = _engine_rate(cfg, policy, str(model_dir), prompts, r_len)
        bar.update(1)
    finally:
        bar.close()
    result = Throughputs(**rates, source=source_label(cfg.card.device, kind, quick), gen_chunk=len(gpu[0]) if gpu else 0)
    details = {"model_dir": str(model_dir), "kind": kind, "sequences": n, "prompt_len": p_len, "new_tokens": r_len,
               "quick": quick, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "gpu_trainer": None if gpu is None else {"sequences": len(gpu[0]), "new_tokens": gpu[2],
                                                        "train_rows": gpu[3]}}
    path = _save(cfg, shape, result, details)
    say(f"[homerlhf] bench: saved to {path}")
    return result, path, True


def gpu_inputs(cfg: RunConfig, shape: ModelShape, quick: bool) -> tuple[list, list, int, int]:
    """(prompts, responses, new tokens to generate, rows to train on) for timing a policy on a GPU: a
    generation chunk of sequences at the run's lengths, QUICK_GPU_NEW decode steps when ``quick`` (a
    step costs about the same from the first to the last), forward + backward on a micro-batch as the
    update runs it."""
    ro = cfg.rollout
    n = ro.generation_chunk if isinstance(ro.generation_chunk, int) else ro.chunk_size
    vocab = min(shape.vocab_size, 512)
    prompts, responses = _ids(n, ro.max_prompt_len, vocab, 0), _ids(n, ro.max_new_tokens, vocab, 1)
    new = min(ro.max_new_tokens, QUICK_GPU_NEW) if quick else ro.max_new_tokens
    return prompts, responses, new, min(n, cfg.ppo.micro_batch_size)


def _ref_gguf(cfg: RunConfig, model_dir: Path) -> Path:
    from homerlhf.workers.backends import cached_ref_gguf

    return cached_ref_gguf(str(model_dir), cfg.ref.outtype, cfg.ref.from_nf4, cfg.quant, cfg.card.device)


def _load_policy(cfg: RunConfig, model_dir: Path):
    from homerlhf.models.policy import PolicyModel

    return PolicyModel.from_config(cfg, str(model_dir))


def _logical_cores() -> int:
    import os

    return max(1, os.cpu_count() or 1)


class _torch_threads:
    """torch's intra-op threads set to ``threads`` for a block (0: left as they are, a GPU)."""

    def __init__(self, threads: int):
        self.threads = threads

    def __enter__(self):
        import torch

        self.before = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)

    def __exit__(self, *exc):
        import torch

        torch.set_num_threads(self.before)


def _engine_rate(cfg: RunConfig, policy, model_dir: str, prompts, new_tokens: int) -> float:
    """Generated tokens/s of the llamacpp rollout engine (prompt processing included) on ``prompts``."""
    from homerlhf.workers.rollout_engine import llamacpp_engine

    with tempfile.TemporaryDirectory(prefix="homerlhf-bench-") as tmp:
        engine_cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"chunk_size": len(prompts)})})
        engine = llamacpp_engine(engine_cfg, policy, model_dir, Path(tmp))
        try:
            engine.sync(policy)
            rollout = cfg.rollout.model_copy(update={"max_new_tokens": new_tokens})
            steps = []
            seconds = best_seconds(lambda: steps.append(engine.generate(prompts, rollout).response_ids.shape[1]))
        finally:
            engine.close()
    return len(prompts) * steps[-1] / seconds


def describe(rates: Throughputs) -> list[str]:
    """One line per kind of work: tokens/s by thread count."""
    names = {"worker_ref": "llama.cpp ref worker (prompt processing)", "worker_reward": "llama.cpp reward worker",
             "llama_gen": "llama.cpp rollout engine (generation)", "trainer_gen": "policy HF generation",
             "trainer_forward": "policy forward (no grad)", "trainer_train": "policy forward + backward"}
    lines = []
    for kind in RATES:
        table = getattr(rates, kind)
        figures = ", ".join(f"{v:,.0f} tok/s" + (f" @ {t} threads" if t else " (GPU)") for t, v in sorted(table.items()))
        lines.append(f"{names[kind]}: {figures}")
    return lines

