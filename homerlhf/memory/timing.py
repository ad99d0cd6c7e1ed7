"""Seconds per PPO iteration: per phase from throughputs, and the critical path.

Pure functions on a ``RunConfig`` and :class:`Throughputs` (tokens/s measured by ``homerlhf bench``,
cached per machine and model, or the documented defaults of :func:`default_throughputs`). Nothing
is loaded or timed here; the placements compared are :mod:`homerlhf.memory.placement`. What the trainer does (:mod:`homerlhf.ppo.collect`), and so what is counted:

- the batch is generated ``rollout.chunk_size`` prompts at a time;
- after each chunk's generation, its reference log-probs and then its scores are *submitted*: a
  llama.cpp worker (``llamacpp``) computes them in its own process while the trainer goes on, one
  request at a time per worker; an ``adapter_off`` reference or an ``adapter``/``hf`` reward model
  computes on the trainer's device in the trainer's own sequence (they share its modules or its
  device), before the chunk's old log-probs and values and the next chunk's generation;
- after the last chunk the trainer waits for the workers (the ``reference_reward_wait``);
- then the update: ``ppo.epochs`` passes of forward + backward over the whole batch.

Every sequence is counted at full length (``max_prompt_len + max_new_tokens``): an upper bound
when responses stop early.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from homerlhf.config.schema import RunConfig
from homerlhf.memory.shapes import ModelShape
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
    :data:`DEFAULT_SOURCE`)."""

    worker_ref: dict[int, float]
    worker_reward: dict[int, float]
    llama_gen: dict[int, float]
    trainer_gen: dict[int, float]
    trainer_forward: dict[int, float]
    trainer_train: dict[int, float]
    source: str = DEFAULT_SOURCE

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

    def to_dict(self) -> dict[str, Any]:
        return {k: ({str(t): v for t, v in val.items()} if isinstance(val, dict) else val)
                for k, val in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Throughputs":
        rates = {k: {int(t): float(v) for t, v in data[k].items()} for k in RATES}
        return cls(**rates, source=str(data.get("source", DEFAULT_SOURCE)))


# ---- defaults -----------------------------------------------------------------------------------------
# Effective FLOP/s of each kind of work, used when nothing is measured (a token through a model
# costs 2 x its matmul parameters in FLOPs; forward + backward 3x that). CPU figures: per physical
# core, from `homerlhf bench` of a 250 M Qwen3-shaped stand-in at 1 thread on our shared 2-core EPYC
# VM (2026-11-30, load average 11-20; docs/time.md), rounded; "gen" is per sequence (a chunk of c
# generates c times as fast), "llama_gen" per engine. GPU figures: NOT measured (no GPU run has
# calibrated them); orders of magnitude for a 24 GB consumer card with a bitsandbytes NF4 base.
CPU_FLOPS_PER_CORE = {"worker": 45e9, "reward_worker": 10e9, "llama_gen": 0.25e9, "forward": 28e9, "train": 33e9,
                      "gen": 0.35e9}
GPU_FLOPS = {"forward": 40e12, "train": 25e12}
GPU_GEN_TOKENS_PER_S_7B = 20.0  # one sequence; a batch of c runs c times as many until compute-bound


def matmul_params(shape: ModelShape, lm_head: bool = True) -> int:
    """Parameters one token multiplies through: every decoder linear layer and (``lm_head``) the
    output projection (the embedding matrix when tied)."""
    return shape.linear_weight_params + (shape.vocab_size * shape.hidden_size if lm_head else 0)


def default_throughputs(shape: ModelShape, cfg: RunConfig, cores: int) -> Throughputs:
    """Tokens/s from :data:`CPU_FLOPS_PER_CORE` / :data:`GPU_FLOPS` for ``shape``: marked
    :data:`DEFAULT_SOURCE`, for a plan on a machine (or model) that was never benched."""
    flops = 2.0 * matmul_params(shape)
    backbone = 2.0 * matmul_params(shape, lm_head=False)
    threads = range(1, cores + 1)
    per_core = CPU_FLOPS_PER_CORE
    if cfg.card.device == "cpu":
        trainer = {
            "trainer_gen": {t: t * per_core["gen"] / flops * cfg.rollout.chunk_size for t in threads},
            "trainer_forward": {t: t * per_core["forward"] / flops for t in threads},
            "trainer_train": {t: t * per_core["train"] / (3 * flops) for t in threads},
        }
    else:
        per_seq = GPU_GEN_TOKENS_PER_S_7B * 2 * 7e9 / flops
        trainer = {
            "trainer_gen": {0: min(per_seq * cfg.rollout.chunk_size, GPU_FLOPS["forward"] / flops)},
            "trainer_forward": {0: GPU_FLOPS["forward"] / flops},
            "trainer_train": {0: GPU_FLOPS["train"] / (3 * flops)},
        }
    return Throughputs(
        worker_ref={t: t * per_core["worker"] / flops for t in threads},
        worker_reward={t: t * per_core["reward_worker"] / backbone for t in threads},
        llama_gen={t: t * per_core["llama_gen"] / flops for t in threads},
        **trainer,
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


def _forwards(cfg: RunConfig) -> int:
    """Forwards per sequence to get old log-probs and values (and backward passes in the update):
    actor and critic each, one when the adapter is shared or there is no critic."""
    return 2 if cfg.has_critic and not cfg.critic.shared_adapter else 1


def iteration_time(cfg: RunConfig, rates: Throughputs, placement: Optional[Placement] = None, *,
                   cores: int, logical: Optional[int] = None) -> IterationTime:
    """Predicted seconds of one iteration of ``cfg`` under ``placement`` (default: the config's own).

    Per chunk of c sequences of L = prompt + new tokens: generation c x new / gen rate; reference and
    reward c x L / their rate (a worker's, or the trainer's forward rate on the device); old
    log-probs / values forwards x c x L / forward rate. The update: epochs x forwards x B x L /
    train rate. The rollout stage's wall clock follows the trainer's chunk loop (see the module
    docstring) with one queue per worker.
    """
    placement = placement or placement_of(cfg)
    threads = thread_counts(placement, cfg, cores, logical or cores)
    trainer_t = threads["trainer"]
    ro = cfg.rollout
    length = ro.max_prompt_len + ro.max_new_tokens
    gen_rate = (rates.rate("llama_gen", threads["llama_engine"]) if placement.engine == "llamacpp"
                else rates.rate("trainer_gen", trainer_t))
    forward = rates.rate("trainer_forward", trainer_t)

    def seconds(role: str, backend: str, tokens: int) -> tuple[float, bool]:
        """(seconds, on a worker) to score ``tokens`` for ``role``."""
        if backend == "llamacpp":
            return tokens / rates.rate(f"worker_{role}", threads[role]), True
        if backend == "function":
            return 0.0, False
        return tokens / forward, False  # adapter_off, adapter, hf: one forward on the trainer device

    busy = dict.fromkeys(PHASES, 0.0)
    where = {"generation": "trainer", "policy_scoring": "trainer", "update": "trainer"}
    t = ref_free = rm_free = 0.0
    for start in range(0, ro.batch_size, ro.chunk_size):
        c = min(ro.chunk_size, ro.batch_size - start)
        gen = c * ro.max_new_tokens / gen_rate
        t += gen
        busy["generation"] += gen
        # Submitted in this order after the chunk's generation (collect_experience): ref, reward.
        ref_s, ref_async = seconds("ref", placement.ref, c * length)
        ref_free = max(ref_free, t) + ref_s if ref_async else ref_free
        t += 0.0 if ref_async else ref_s
        rm_s, rm_async = seconds("reward", placement.reward, c * length)
        rm_free = max(rm_free, t) + rm_s if rm_async else rm_free
        t += 0.0 if rm_async else rm_s
        busy["reference"] += ref_s
        busy["reward"] += rm_s
        where["reference"], where["reward"] = ("worker" if ref_async else "trainer"), ("worker" if rm_async else "trainer")
        scoring = _forwards(cfg) * c * length / forward
        t += scoring
        busy["policy_scoring"] += scoring
    rollout = max(t, ref_free, rm_free)
    update = cfg.ppo.epochs * _forwards(cfg) * ro.batch_size * length / rates.rate("trainer_train", trainer_t)
    busy["update"] = update
    return IterationTime(placement, busy, where, rollout, rollout - t, update, threads, rates.source)


def phase_rows(it: IterationTime) -> list[list[Any]]:
    """[phase title, predicted seconds, where it runs] per phase, for tables."""
    where = {"trainer": "trainer (in sequence)", "worker": "llama.cpp worker (overlapped)"}
    return [[PHASE_TITLES[name], round(it.phases[name], 3), where[it.where[name]]] for name in PHASES]
