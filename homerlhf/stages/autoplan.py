"""``auto`` settings resolved when a run starts: where the reference and reward models run
(``ref.backend`` / ``reward.backend: auto``), what samples the rollouts (``rollout.engine: auto``),
how many prompts are generated at once (``rollout.generation_chunk: auto``), and which layers the update
checkpoints and where their inputs wait (``training.checkpoint_every_n_layers`` / ``activation_offload:
auto``: :mod:`homerlhf.memory.checkpointing`, within the chosen placement); and the actor's learning rate
(``actor.lr: auto``: by the policy's size, :mod:`homerlhf.config.learning_rates`).

The choice is the fastest placement that fits the card (:func:`homerlhf.memory.placement.choose`), by the
throughputs at hand: this machine's ``homerlhf bench`` figures from the cache, else the documented
defaults (:func:`resolve_auto`). A run's start plans; it never measures, so every rank of ``accelerate
launch`` chooses alike. Roles the config names are kept as named; a resumed run keeps the choice its
checkpoint was written with; the resolved values are what the run's ``config.yaml`` records.
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
    settings = (cfg.ref.backend, cfg.reward.backend, cfg.rollout.engine, cfg.rollout.generation_chunk, cfg.actor.lr)
    return "auto" in settings or cfg.training.has_auto


def resolve_actor_lr(cfg: RunConfig, shape: ModelShape, say: Callable[[str], None] = print) -> RunConfig:
    """``actor.lr: auto`` -> the rate for the policy's size (:mod:`homerlhf.config.learning_rates`), said."""
    if cfg.actor.lr != "auto":
        return cfg
    from homerlhf.config.learning_rates import auto_actor_lr, auto_lr_line

    say(SAY_PREFIX + auto_lr_line(shape.total_params))
    return cfg.model_copy(update={"actor": cfg.actor.model_copy(update={"lr": auto_actor_lr(shape.total_params)})})


# Policy architectures whose LoRA the llamacpp engine swaps in exactly, as tested (the engine's
# behaviour log-probs against the trainer's before and after updates: tests/workers/test_rollout_engine.py).
# ``auto`` takes the engine for these only; any family the export serves can name it.
ENGINE_VERIFIED = ("llama", "qwen2")


def unavailable_engines(cfg: RunConfig) -> dict[str, str]:
    """Rollout engines this run's ``auto`` may not take, with why: llamacpp without llama-cpp-python
    (:func:`homerlhf.memory.placement.unavailable_engines`), for a policy whose architecture the GGUF
    export does not serve, or one not among :data:`ENGINE_VERIFIED` (its ``config.json`` read, as
    :func:`homerlhf.stages.preflight.check_run` reads it; a model not on this machine: not checked)."""
    from homerlhf.errors import UserError
    from homerlhf.memory.placement import unavailable_engines as missing
    from homerlhf.stages.preflight import ENGINE_SWITCH, check_exportable, model_config

    out = missing()
    if cfg.rollout.engine != "auto" or "llamacpp" in out:
        return out
    name = cfg.model.name_or_path
    config = model_config(name, cfg.model.revision)
    try:
        if config is not None:
            check_exportable(config, name, "rollout", cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens)
    except UserError as exc:
        out["llamacpp"] = str(exc).removesuffix(f"; {ENGINE_SWITCH}")
        return out
    kind = (config or {}).get("model_type")
    if config is not None and kind not in ENGINE_VERIFIED:
        out["llamacpp"] = (f"{name}: the engine's LoRA swap is verified for {' and '.join(ENGINE_VERIFIED)} policies, "
                           f"not {kind} (name rollout.engine=llamacpp to use it)")
    return out


def run_rates(cfg: RunConfig, shape: ModelShape) -> tuple[Throughputs, bool]:
    """(the throughputs ``cfg``'s model is planned with, whether ``homerlhf bench`` measured them):
    this machine's cached bench figures, else the documented defaults. Nothing is measured here."""
    from homerlhf.memory.threads import physical_cores
    from homerlhf.memory.timing import default_throughputs
    from homerlhf.workers.bench import cached_throughputs

    cached = cached_throughputs(cfg, shape)
    if cached is not None:
        return cached, True
    return default_throughputs(shape, cfg, physical_cores()), False


def default_rates_line(rec, cfg: RunConfig) -> str:
    """What to say when the documented defaults chose the placement: whether an alternative that fits
    comes within 2x of the choice (then this machine's own figures may well choose otherwise), and
    that ``homerlhf bench`` measures them for the next run."""
    from homerlhf.memory.placement import explicit

    chosen = rec.current
    others = [c for c in rec.candidates if c is not chosen and c.fits and explicit(c.time.placement, cfg)]
    close = [c for c in others if c.time.total_s <= CLOSE * chosen.time.total_s]
    head = "  chosen by default rates (no `homerlhf bench` figures for this machine and model)"
    if close:
        head += f"; {close[0].time.placement.label()} is within {CLOSE:g}x of it"
    elif others:
        head += f"; every alternative that fits is over {CLOSE:g}x slower by them"
    else:
        head += "; no other placement fits"
    return head + ": `homerlhf bench` with this run's preset and --set measures them, and later runs choose by them"


CLOSE = 2.0  # an alternative within this factor of the choice may win on this machine's own figures


def resolve_auto(cfg: RunConfig, *, shape: Optional[ModelShape] = None, rates: Optional[Throughputs] = None,
                 rewards: Optional[Sequence[str]] = None, saved: Optional[RunConfig] = None,
                 reward_given: bool = False, say: Callable[[str], None] = print) -> RunConfig:
    """``cfg`` with every ``auto`` resolved (a config without one is returned as it is).

    ``rates``: throughputs (default: :func:`run_rates`, without measuring); ``rewards``: the backends the reward model can
    run on (default: from its files, :func:`homerlhf.models.reward_kinds.possible_reward_backends`);
    ``saved``: the config of the checkpoint a resumed run continues from, whose choices are kept;
    ``reward_given``: the run's reward is a ready backend (its placement is not the config's to pick).

    No export, no worker and no model is started to choose (measuring is ``homerlhf bench``'s job). The
    choice is printed with the alternatives' seconds per iteration (an ``auto`` engine's with both
    engines' seconds per phase) and, when the defaults decided, a line naming ``homerlhf bench``. The
    llamacpp engine is no candidate where :func:`unavailable_engines` says so; ``auto`` then takes
    ``hf`` and says why."""
    if not has_auto(cfg):
        return cfg
    if saved is not None:
        return _keep_saved(cfg, saved)
    from homerlhf.memory.checkpointing import run_start_lines
    from homerlhf.memory.placement import choice_lines, is_auto, recommend, resolve_placement
    from homerlhf.memory.render import shape_for
    from homerlhf.memory.threads import physical_cores
    from homerlhf.models.reward_kinds import possible_reward_backends

    shape = shape or shape_for(cfg)
    cfg = resolve_actor_lr(cfg, shape, say)
    if not has_auto(cfg):
        return cfg
    planned = cfg
    if reward_given:  # e.g. CallableReward: nothing on a worker, nothing on the GPU
        planned = cfg.model_copy(update={"reward": cfg.reward.model_copy(update={"backend": "function"})})
    if rewards is None and not reward_given and cfg.reward.backend == "auto":  # a named reward keeps its backend
        rewards = possible_reward_backends(cfg.reward.model, cfg.model.name_or_path, build=True)
    measured = rates is not None
    if rates is None:
        rates, measured = run_rates(cfg, shape)
    rec = recommend(planned, shape, rates, cores=physical_cores(), logical=max(1, os.cpu_count() or 1),
                    rewards=rewards, unavailable=unavailable_engines(cfg))
    for line in choice_lines(rec, planned):
        say(SAY_PREFIX + line)
    if not measured and is_auto(planned):
        say(SAY_PREFIX + default_rates_line(rec, planned))
    resolved = resolve_placement(planned, rec)
    for line in run_start_lines(resolved, shape) if cfg.training.has_auto else ():  # the plan's checkpointing
        say(SAY_PREFIX + line)
    if reward_given:
        resolved = resolved.model_copy(update={"reward": cfg.reward})
    return resolved


def _keep_saved(cfg: RunConfig, saved: RunConfig) -> RunConfig:
    """The checkpoint's resolved values for ``cfg``'s ``auto`` settings."""
    update, rollout = {}, {}
    if cfg.actor.lr == "auto":
        update["actor"] = cfg.actor.model_copy(update={"lr": saved.actor.lr})
    if cfg.ref.backend == "auto":
        update["ref"] = cfg.ref.model_copy(update={"backend": saved.ref.backend})
    if cfg.reward.backend == "auto":
        update["reward"] = cfg.reward.model_copy(update={"backend": saved.reward.backend})
    for key in ("engine", "generation_chunk"):
        if getattr(cfg.rollout, key) == "auto":
            rollout[key] = getattr(saved.rollout, key)
    training = {key: getattr(saved.training, key) for key in ("checkpoint_every_n_layers", "activation_offload")
                if getattr(cfg.training, key) == "auto"}
    if training:
        update["training"] = cfg.training.model_copy(update=training)
    if rollout:
        update["rollout"] = cfg.rollout.model_copy(update=rollout)
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
