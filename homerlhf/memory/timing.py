"""Seconds per PPO iteration: per phase from throughputs, and the critical path.

Pure functions on a ``RunConfig`` and :class:`Throughputs` (tokens/s measured by ``homerlhf bench``,
cached per machine and model, or the documented defaults of :func:`default_throughputs`). Nothing is
loaded or timed here; the placements compared are :mod:`homerlhf.memory.placement`; what the trainer
does, and so what is counted, is :func:`iteration_time`'s. Every sequence is counted at full length
(``max_prompt_len + max_new_tokens``): an upper bound when responses stop early.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from homerlhf.config.schema import RunConfig
from homerlhf.memory.cards import MEASURED, card_spec
from homerlhf.memory.gpu_rates import GPU_MEASURED_CHUNK, gpu_source, gpu_trainer_rates, matmul_params
from homerlhf.memory.recompute import checkpointing_seconds
from homerlhf.memory.shapes import ModelShape, critic_shape, resolve_shape
from homerlhf.memory.threads import split_threads

PHASES = ("generation", "reference", "reward", "policy_scoring", "update")
PHASE_TITLES = {
    "generation": "generation",
    "reference": "reference log-probs",
    "reward": "reward scoring",
    "policy_scoring": "old log-probs / values",
    "update": "update",
}
RATES = ("worker_ref", "worker_reward", "llama_gen", "trainer_gen", "trainer_forward", "trainer_train")
DEFAULT_SOURCE = "default, not measured"


@dataclass
class Throughputs:
    """Tokens per second, each by thread count (``{threads: tokens/s}``; threads 0: a GPU).

    ``worker_ref`` / ``worker_reward``: a llama.cpp worker scoring prompt + response tokens (the
    ref's log-probs, the reward backbone's last hidden state); ``llama_gen``: the llamacpp rollout
    engine, generated tokens (its prompt processing included); ``trainer_gen``: the policy's HF
    ``generate`` on the trainer device at the run's chunk size, generated tokens; ``trainer_forward``:
    one no-grad forward of the policy (NF4 base + LoRA), tokens; ``trainer_train``: one forward +
    backward, tokens. ``source``: where the figures come from (a bench date and machine, or
    :data:`DEFAULT_SOURCE`). ``gen_chunk``: the chunk a GPU's ``trainer_gen`` was measured at. A GPU
    decode step of an NF4 + LoRA model is bound by kernel launches, its time about the same whatever
    the chunk, so the model scales that figure by chunk / ``gen_chunk`` (capped at the forward rate);
    0: taken at the run's own chunk, not scaled (the CPU's figures). ``kernels``: which kernels the GPU
    figures are for (the H200 defaults': not those a policy chooses now, see the constant)."""

    worker_ref: dict[int, float]
    worker_reward: dict[int, float]
    llama_gen: dict[int, float]
    trainer_gen: dict[int, float]
    trainer_forward: dict[int, float]
    trainer_train: dict[int, float]
    source: str = DEFAULT_SOURCE
    gen_chunk: int = 0
    # The kernels the GPU figures were measured with (``homerlhf.models.cuda_kernels.MEASURED_KERNELS``:
    # precision, TF32, attention); "" for figures not from a GPU measurement (the CPU's, a bench's own).
    kernels: str = ""

    def rate(self, kind: str, threads: int) -> float:
        """Tokens/s of ``kind`` at ``threads``: the measured figure, else the nearest measured one
        scaled linearly by the thread count (llama.cpp and torch matmuls scale about so on
        physical cores); on a GPU (threads 0) the figure as it is."""
        table = getattr(self, kind)
        if threads in table:
            return table[threads]
        if not table:
            raise KeyError(f"no {kind} throughput")
        nearest = min(table, key=lambda t: (abs(t - threads), -t))
        return table[nearest] if nearest == 0 or threads == 0 else table[nearest] * threads / nearest

    def generation_rate(self, threads: int, chunk: int) -> float:
        """Generated tokens/s of the trainer's own ``generate`` at ``chunk`` prompts at once: the
        figure as measured, or on a GPU (``gen_chunk``) scaled by chunk / ``gen_chunk`` up to the
        forward rate (a decode step cannot outrun a forward over as many tokens)."""
        rate = self.rate("trainer_gen", threads)
        if not self.gen_chunk:
            return rate
        scaled = rate * chunk / self.gen_chunk
        return min(scaled, self.rate("trainer_forward", threads)) if self.trainer_forward else scaled

    def to_dict(self) -> dict[str, Any]:
        return {k: ({str(t): v for t, v in val.items()} if isinstance(val, dict) else val)
                for k, val in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Throughputs":
        rates = {k: {int(t): float(v) for t, v in data[k].items()} for k in RATES}
        return cls(**rates, source=str(data.get("source", DEFAULT_SOURCE)), gen_chunk=int(data.get("gen_chunk", 0)),
                   kernels=str(data.get("kernels", "")))


# ---- defaults -----------------------------------------------------------------------------------------
# Effective FLOP/s of each kind of work (a token through a model costs 2 x its matmul parameters in
# FLOPs; forward + backward 3x that). CPU figures: per physical core, from `homerlhf bench` of a 250 M
# Qwen3-shaped stand-in at 1 thread on our shared 2-core EPYC VM (2026-11-30, load average 11-20;
# docs/time.md), rounded; "gen" is per sequence (a chunk of c generates c times as fast), "llama_gen"
# per engine; not measured on the machine a plan is for. "llama_gen": the demo's shape at 1 engine thread
# (2026-12-02, 1,300-1,460 tok/s at chunks 4-32; the 250 M's was timed at 2 threads under load: docs/time.md).
CPU_FLOPS_PER_CORE = {"worker": 45e9, "reward_worker": 10e9, "llama_gen": 2.5e9, "forward": 28e9, "train": 33e9,
                      "gen": 0.35e9}
# HF generate on the CPU also pays a fixed cost per decoder layer per step, whatever the chunk (NF4
# dequantized, LoRA, Python): the demo's shape (4 layers), 1 thread, 43-53 ms a step at chunks 4-32.
CPU_HF_DECODE_S_PER_LAYER = 10.5e-3
def default_throughputs(shape: ModelShape, cfg: RunConfig, cores: int) -> Throughputs:
    """Tokens/s for ``shape`` when this machine was never benched: the CPU's from
    :data:`CPU_FLOPS_PER_CORE`, a GPU trainer's from the H200 measurements scaled to the preset's card
    (:func:`gpu_trainer_rates`). Marked :data:`DEFAULT_SOURCE` on a CPU card, and with
    :func:`gpu_source` for the GPU's on a GPU card."""
    flops = 2.0 * matmul_params(shape)
    backbone = 2.0 * matmul_params(shape, lm_head=False)
    threads = range(1, cores + 1)
    per_core = CPU_FLOPS_PER_CORE
    gen_chunk, source, kernels = 0, DEFAULT_SOURCE, ""
    if cfg.card.device == "cpu":
        chunk = cfg.rollout.generation_chunk if isinstance(cfg.rollout.generation_chunk, int) else cfg.rollout.chunk_size
        trainer = {
            "trainer_gen": {t: chunk / (shape.num_layers * CPU_HF_DECODE_S_PER_LAYER + flops / (t * per_core["gen"]))
                            for t in threads},
            "trainer_forward": {t: t * per_core["forward"] / flops for t in threads},
            "trainer_train": {t: t * per_core["train"] / (3 * flops) for t in threads},
        }
    else:
        from homerlhf.models.cuda_kernels import MEASURED_KERNELS

        from homerlhf.models.static_decode import resolve_decoder

        upcast = bool(cfg.quant.load_in_4bit and cfg.quant.upcast_non_quantized)
        decoder = "hf" if shape.is_moe else resolve_decoder(cfg.rollout.decoder, "cuda")  # 4-bit experts: declined
        trainer = gpu_trainer_rates(shape, card_spec(cfg.card.name) or MEASURED, decoder, upcast)
        gen_chunk = GPU_MEASURED_CHUNK
        source = f"GPU: {gpu_source(cfg.card.name)}; CPU workers: {DEFAULT_SOURCE}"
        kernels = MEASURED_KERNELS
    return Throughputs(
        worker_ref={t: t * per_core["worker"] / flops for t in threads},
        worker_reward={t: t * per_core["reward_worker"] / backbone for t in threads},
        llama_gen={t: t * per_core["llama_gen"] / flops for t in threads},
        **trainer, source=source, gen_chunk=gen_chunk, kernels=kernels,
    )


# ---- the time model -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """Where the reference, the reward model and the rollout run (``ref.backend``, ``reward.backend``,
    ``rollout.engine``)."""

    ref: str
    reward: str
    engine: str

    def overrides(self) -> dict[str, str]:
        return {"ref.backend": self.ref, "reward.backend": self.reward, "rollout.engine": self.engine}

    def label(self) -> str:
        return f"ref {self.ref}, reward {self.reward}, rollout {self.engine}"


@dataclass
class IterationTime:
    """Predicted seconds of one iteration: busy seconds per phase, and the wall clock."""

    placement: Placement
    phases: dict[str, float]  # busy seconds of each phase (PHASES), wherever it runs
    where: dict[str, str]  # phase -> "trainer" or "worker" (off the trainer's sequence)
    rollout_s: float  # generation + scoring stage, wall: the critical path
    wait_s: float  # of which the trainer waits for the workers after its last chunk
    update_s: float
    threads: dict[str, int]  # worker / trainer / llama engine threads the rates were taken at
    source: str

    @property
    def total_s(self) -> float:
        return self.rollout_s + self.update_s

    @property
    def critical(self) -> str:
        """What bounds the rollout stage: the trainer's own sequence, or a worker."""
        return "trainer" if self.wait_s <= 1e-9 else "workers"

    def to_dict(self) -> dict[str, Any]:
        return {"placement": self.placement.overrides(), "phases": {k: round(v, 4) for k, v in self.phases.items()},
                "where": self.where, "rollout_s": round(self.rollout_s, 4), "wait_s": round(self.wait_s, 4),
                "update_s": round(self.update_s, 4), "total_s": round(self.total_s, 4), "critical": self.critical,
                "threads": self.threads, "source": self.source}


def placement_of(cfg: RunConfig) -> Placement:
    return Placement(cfg.ref.backend, cfg.reward.backend, cfg.rollout.engine)


def thread_counts(placement: Placement, cfg: RunConfig, cores: int, logical: int) -> dict[str, int]:
    """Threads each process would get under ``placement``: explicit settings win, else the split of
    :func:`homerlhf.memory.threads.split_threads` (trainer 0: on a GPU)."""
    local = [role for role in ("ref", "reward")
             if getattr(placement, role) == "llamacpp" and not getattr(cfg, role).url]
    shares = split_threads(cores, len(local), cfg.card.device == "cpu")
    threads = {"trainer": shares.trainer, "llama_engine": cfg.rollout.engine_threads or logical}
    for role in ("ref", "reward"):
        threads[role] = getattr(cfg, role).threads or shares.worker
    return threads


def _forwards(cfg: RunConfig, shape: Optional[ModelShape] = None) -> float:
    """Forwards per sequence to get old log-probs and values (and backward passes in the update):
    actor and critic each, one when the adapter is shared or there is no critic. A critic on a base of
    its own (``critic.model``) costs its share of one: its decoder's matmul parameters over the
    policy's (``shape``; default the config's model), no LM head."""
    if not cfg.has_critic or cfg.critic.shared_adapter:
        return 1
    own = critic_shape(cfg)
    if own is None:
        return 2
    policy = shape or resolve_shape(cfg.model.name_or_path, cfg.model.revision)
    return 1 + matmul_params(own, lm_head=False) / matmul_params(policy)


def _passes(cfg: RunConfig, shape: ModelShape) -> list[ModelShape]:
    """The models one update pass runs forward and backward: the actor, and the critic (on its own base
    with ``critic.model``) unless it shares the actor's adapter or there is none."""
    if not cfg.has_critic or cfg.critic.shared_adapter:
        return [shape]
    return [shape, critic_shape(cfg) or shape]


def iteration_time(cfg: RunConfig, rates: Throughputs, placement: Optional[Placement] = None, *,
                   cores: int, logical: Optional[int] = None, shape: Optional[ModelShape] = None) -> IterationTime:
    """Predicted seconds of one iteration of ``cfg`` under ``placement`` (default: the config's own).

    Per generation chunk of c sequences (``rollout.generation_chunk``, resolved) of L = prompt + new
    tokens: generation c x new / gen rate (:meth:`Throughputs.generation_rate`); reference and
    reward c x L / their rate (a worker's, or the trainer's forward rate on the device); old
    log-probs / values forwards x c x L / forward rate. The update: epochs x forwards x B x L /
    train rate (with ``shape``: x the recompute share, + offload copies, :mod:`homerlhf.memory.recompute`).
    The rollout stage's wall clock follows the trainer's chunk loop (:mod:`homerlhf.ppo.collect`) with
    one queue per worker; under ``rollout.async`` with the llamacpp engine, the next batch is made while
    this one is scored and updated (:func:`_ahead`). After each chunk's generation its reference
    log-probs and scores are *submitted*: a llama.cpp worker computes them in its own process while the
    trainer goes on, one request at a time per worker; an ``adapter_off`` reference or an
    ``adapter``/``hf`` reward model computes on the trainer's device in the trainer's own sequence,
    before the chunk's old log-probs and values and the next chunk's generation. After the last chunk
    the trainer waits for the workers (``reference_reward_wait``), then updates.
    """
    placement = placement or placement_of(cfg)
    threads = thread_counts(placement, cfg, cores, logical or cores)
    trainer_t = threads["trainer"]
    ro = cfg.rollout
    length = ro.max_prompt_len + ro.max_new_tokens
    gen_chunk = ro.generation_chunk_size
    gen_rate = (rates.rate("llama_gen", threads["llama_engine"]) if placement.engine == "llamacpp"
                else rates.generation_rate(trainer_t, gen_chunk))
    forward = rates.rate("trainer_forward", trainer_t)

    def seconds(role: str, backend: str, tokens: int) -> tuple[float, bool]:
        """(seconds, on a worker) to score ``tokens`` for ``role``."""
        if backend == "llamacpp":
            return tokens / rates.rate(f"worker_{role}", threads[role]), True
        if backend == "function":
            return 0.0, False
        return tokens / forward, False  # adapter_off, adapter, hf: one forward on the trainer device

    chunks = []  # per chunk: generation, (ref s, on a worker), (reward s, on a worker), old log-probs / values
    for start in range(0, ro.batch_size, gen_chunk):
        c = min(gen_chunk, ro.batch_size - start)
        chunks.append((c * ro.max_new_tokens / gen_rate, seconds("ref", placement.ref, c * length),
                       seconds("reward", placement.reward, c * length), _forwards(cfg, shape) * c * length / forward))
    update = cfg.ppo.epochs * _forwards(cfg, shape) * ro.batch_size * length / rates.rate("trainer_train", trainer_t)
    if shape is not None:  # recomputed layers and offload copies (homerlhf.memory.recompute)
        update = checkpointing_seconds(cfg, _passes(cfg, shape), update, cfg.ppo.epochs * ro.batch_size)
    busy = {"generation": sum(ch[0] for ch in chunks), "reference": sum(ch[1][0] for ch in chunks),
            "reward": sum(ch[2][0] for ch in chunks), "policy_scoring": sum(ch[3] for ch in chunks), "update": update}
    ahead = ro.async_ and placement.engine == "llamacpp"
    ref_worker, rm_worker = chunks[0][1][1], chunks[0][2][1]
    where = {"generation": "ahead" if ahead else "trainer", "policy_scoring": "trainer", "update": "trainer",
             "reference": "worker" if ref_worker else "trainer",
             "reward": "worker" if rm_worker else ("ahead" if ahead else "trainer")}
    rollout, wait = _ahead(chunks, update) if ahead else _in_sequence(chunks)
    return IterationTime(placement, busy, where, rollout, wait, update, threads, rates.source)


def _in_sequence(chunks) -> tuple[float, float]:
    """(rollout stage wall, of which the trainer's wait for the workers after its last chunk): per
    chunk the trainer generates, submits the reference then the reward (a worker queues it, one
    request at a time; on the trainer it computes right there), then scores the chunk."""
    t = ref_free = rm_free = 0.0
    for gen, (ref_s, ref_async), (rm_s, rm_async), scoring in chunks:
        t += gen
        ref_free = max(ref_free, t) + ref_s if ref_async else ref_free
        t += 0.0 if ref_async else ref_s
        rm_free = max(rm_free, t) + rm_s if rm_async else rm_free
        t += 0.0 if rm_async else rm_s
        t += scoring
    rollout = max(t, ref_free, rm_free)
    return rollout, rollout - t


def _ahead(chunks, update: float) -> tuple[float, float]:
    """``rollout.async`` in its steady state: (rollout stage wall, of which the wait for the batch
    ahead). The next batch is made in the background (the engine's chunks, the workers' requests
    queued behind them, an in-process reward in that thread) while the trainer scores this batch
    (old log-probs / values, an ``adapter_off`` reference) and updates; the trainer waits when the
    background takes longer (threads competing for the same cores: not modelled)."""
    made = ref_free = rm_free = own = 0.0
    for gen, (ref_s, ref_async), (rm_s, rm_async), scoring in chunks:
        made += gen
        ref_free = max(ref_free, made) + ref_s if ref_async else ref_free
        own += scoring + (0.0 if ref_async else ref_s)
        rm_free = max(rm_free, made) + rm_s if rm_async else rm_free
        made += 0.0 if rm_async else rm_s
    wait = max(0.0, max(made, ref_free, rm_free) - own - update)
    return own + wait, wait


def human_seconds(seconds: float) -> str:
    """A duration as a person reads it: 0.04 s, 42.0 s, 7.5 min, 3.2 h, 5.4 days."""
    if seconds < 1:
        return f"{seconds:.2f} s"
    if seconds < 90:
        return f"{seconds:.1f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def phase_rows(it: IterationTime) -> list[list[Any]]:
    """[phase title, predicted seconds, where it runs] per phase, for tables."""
    where = {"trainer": "trainer (in sequence)", "worker": "llama.cpp worker (overlapped)",
             "ahead": "the next batch, made during this one (rollout.async)"}
    return [[PHASE_TITLES[name], round(it.phases[name], 3), where[it.where[name]]] for name in PHASES]
