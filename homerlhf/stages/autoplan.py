"""``auto`` settings resolved when a PPO run starts: where the reference and reward models run
(``ref.backend`` / ``reward.backend: auto``) and how many prompts are generated at once
(``rollout.generation_chunk: auto``).

The choice is the fastest placement that fits the card (:func:`homerlhf.memory.placement.choose`),
by this machine's throughputs: ``homerlhf bench`` figures from the cache; on a CUDA machine that has
none yet, a ``bench --quick`` now (once; its figures are cached); elsewhere, and under ``accelerate
launch`` (every rank must choose alike without measuring at once), the documented defaults. Roles
the config names are kept as named. The choice is printed with the alternatives' seconds per
iteration, and the resolved values are what the run's ``config.yaml`` records. A resumed run keeps
the choice its checkpoint was written with.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional, Sequence

from homerlhf.config import RunConfig
from homerlhf.memory.shapes import ModelShape
from homerlhf.memory.timing import Throughputs

SAY_PREFIX = "[homerlhf] "


def has_auto(cfg: RunConfig) -> bool:
    return "auto" in (cfg.ref.backend, cfg.reward.backend) or cfg.rollout.generation_chunk == "auto"


def run_rates(cfg: RunConfig, shape: ModelShape, say: Callable[[str], None] = print) -> Throughputs:
    """This machine's throughputs for ``cfg``'s model: cached bench figures; else, on a CUDA machine
    (one process), a quick bench now; else the documented defaults."""
    from homerlhf.memory.threads import physical_cores
    from homerlhf.memory.timing import default_throughputs
    from homerlhf.workers.bench import cached_throughputs

    cached = cached_throughputs(cfg, shape)
    if cached is not None:
        return cached
    if cfg.card.device == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) == 1 and _cuda():
        from homerlhf.memory.placement import Placement, with_placement
        from homerlhf.workers.bench import bench

        say(SAY_PREFIX + "placement auto: no bench figures for this machine and model yet; measuring them once "
            "(homerlhf bench --quick)")
        measured = with_placement(cfg, Placement("llamacpp", "llamacpp", cfg.rollout.engine))
        return bench(measured, shape, quick=True, say=say)[0]
    return default_throughputs(shape, cfg, physical_cores())


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_auto(cfg: RunConfig, *, shape: Optional[ModelShape] = None, rates: Optional[Throughputs] = None,
                 rewards: Optional[Sequence[str]] = None, saved: Optional[RunConfig] = None,
                 reward_given: bool = False, say: Callable[[str], None] = print) -> RunConfig:
    """``cfg`` with every ``auto`` resolved (a config without one is returned as it is).

    ``rates``: throughputs (default: :func:`run_rates`); ``rewards``: the backends the reward model can
    run on (default: from its files, :func:`homerlhf.models.reward_kinds.possible_reward_backends`);
    ``saved``: the config of the checkpoint a resumed run continues from, whose choices are kept;
    ``reward_given``: the run's reward is a ready backend (its placement is not the config's to pick)."""
    if not has_auto(cfg):
        return cfg
    if saved is not None:
        return _keep_saved(cfg, saved)
    from homerlhf.memory.placement import choice_lines, recommend, resolve_placement
    from homerlhf.memory.render import shape_for
    from homerlhf.memory.threads import physical_cores
    from homerlhf.models.reward_kinds import possible_reward_backends

    shape = shape or shape_for(cfg)
    planned = cfg
    if reward_given:  # e.g. CallableReward: nothing on a worker, nothing on the GPU
        planned = cfg.model_copy(update={"reward": cfg.reward.model_copy(update={"backend": "function"})})
    if rewards is None and not reward_given:
        rewards = possible_reward_backends(cfg.reward.model, cfg.model.name_or_path, build=True)
    rates = rates or run_rates(cfg, shape, say)
    rec = recommend(planned, shape, rates, cores=physical_cores(), logical=max(1, os.cpu_count() or 1),
                    rewards=rewards)
    for line in choice_lines(rec, planned):
        say(SAY_PREFIX + line)
    resolved = resolve_placement(planned, rec)
    if reward_given:
        resolved = resolved.model_copy(update={"reward": cfg.reward})
    return resolved


def _keep_saved(cfg: RunConfig, saved: RunConfig) -> RunConfig:
    """The checkpoint's resolved values for ``cfg``'s ``auto`` settings."""
    update = {}
    if cfg.ref.backend == "auto":
        update["ref"] = cfg.ref.model_copy(update={"backend": saved.ref.backend})
    if cfg.reward.backend == "auto":
        update["reward"] = cfg.reward.model_copy(update={"backend": saved.reward.backend})
    if cfg.rollout.generation_chunk == "auto":
        update["rollout"] = cfg.rollout.model_copy(update={"generation_chunk": saved.rollout.generation_chunk})
    return cfg.model_copy(update=update)


def resolve_for_run(cfg: RunConfig, resume: Optional[str | Path], reward_given: bool) -> RunConfig:
    """:func:`resolve_auto` at the start of ``homerlhf train`` (``resume``: the run dir continued)."""
    if not has_auto(cfg):
        return cfg
    saved = None
    if resume is not None:
        from homerlhf.ppo.resuming import find_resume_checkpoint, saved_config

        saved = saved_config(find_resume_checkpoint(Path(resume)))
    return resolve_auto(cfg, saved=saved, reward_given=reward_given)
