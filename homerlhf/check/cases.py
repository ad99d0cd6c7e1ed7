"""The cases of ``homerlhf check``, sized to a card: the preset it runs at (:func:`card_preset`), the
models and settings the planner says fits that preset's card, and each case's time estimate on the card
(:func:`estimated`). :func:`sized_cases` lists the cases: at the 4090 preset the ones our own GPU session
runs (:data:`REFERENCE`, their H200 figures in :data:`H200_S`), at another the same with its settings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

SMALL_MODEL = "Qwen/Qwen2.5-1.5B"
CRITIC_MODEL = "Qwen/Qwen2.5-0.5B"  # ppo-critic's critic.model: a smaller model of the policy's tokenizer
MAIN_MODELS = ("Qwen/Qwen2.5-14B", "Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-3B", "Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-0.5B")
MAIN_BUDGET_S = 240  # the PPO case's estimate on the card, at most (the 7B's 2 iterations: 77 s on an H200)
LOAD_S = 5  # loading the PPO case's model (a 7B on an H200), in its estimate
SMALL = ("rollout.batch_size=8", "rollout.chunk_size=8", "rollout.max_prompt_len=256", "rollout.max_new_tokens=64",
         "ppo.mini_batch_size=8")
REFERENCE = "4090"  # the preset of our own GPU session's cases, and of a card no preset names
FP16_PRESET = "t4-colab"
# Seconds on an H200 at the 4090 preset (t4-colab for the fp16 case): the PPO cases' wall seconds measured on
# one on 2026-12-04 (docs/gpu-runs/2026-12-04-h200) x 1.5, the preference cases' from the H200's rates; the
# arithmetic in scripts/gpu_session.sh. A case of another model or preset is scaled from its 4090 one by the planner.
H200_S = {"ppo": 77, "grpo": 10, "grpo-upcast": 6, "rloo": 5, "ppo-fp16": 15, "reward-adapter": 12, "resume": 20,
          "cli": 66, "dpo": 14, "kto": 12}
PREFERENCE = ("dpo", "kto")  # the preference cases' kinds: the stage's methods
PREFERENCE_STEPS = 2  # optimizer steps of a preference case (max_steps)
PREFERENCE_PAIRS = 32  # the pairs it trains on (DPO: 2 steps of 4 x 4 pairs at the 4090 preset), and 8 held out
PREFERENCE_HELD = 8  # held-out pairs: the held-out pass's 2 x batch_size rows per forward at the 4090 preset
# Every preference case's, after the preset's (the PPO cases' COMMON is of their stage): no tracker, no bar.
PREFERENCE_COMMON = ("logging.tensorboard=false", "logging.progress=false")
START_S = 10  # this process's start on the GPU machine (imports), estimated
BUILD_S_PER_B = 4.0  # building and saving a random checkpoint, per billion parameters (a 7B in ~30 s on an H200)


@dataclass(frozen=True)
class Case:
    name: str
    preset: str
    model: str  # a name of the planner's table: its published shape (the CPU smoke builds a tiny one)
    overrides: tuple[str, ...]  # over the preset and the run's common ones; {placeholders} are the run's files
    iterations: int
    estimate_s: int  # on the card the check is sized for (:func:`card_factor`), the model's build aside
    kind: str = "train"  # train | resume | cli
    keep: tuple[str, ...] = ()  # overrides that hold in the CPU smoke too (after its own)
    estimate_h200_s: Optional[int] = None  # on an H200 (None: as estimate_s)


def size_label(model: str) -> str:
    """'Qwen/Qwen2.5-7B' -> '7b'."""
    return model.rsplit("-", 1)[-1].lower()


def small_cases(preset: str, gib: float) -> list[Case]:
    """The Qwen2.5-1.5B cases at ``preset`` (H200 estimates; see the module docstring)."""
    fp16 = (Case("ppo-fp16-1.5b", FP16_PRESET, SMALL_MODEL, SMALL + ("ppo.mini_batch_size=4",), 2, H200_S["ppo-fp16"],
                 keep=("quant.compute_dtype=fp16", "ppo.mini_batch_size=2")) if gib >= 15 else
            Case("ppo-fp16-1.5b", preset, SMALL_MODEL, SMALL + ("ppo.mini_batch_size=4", "quant.compute_dtype=fp16"), 2,
                 H200_S["ppo-fp16"], keep=("quant.compute_dtype=fp16", "ppo.mini_batch_size=2")))
    grpo = SMALL + ("algorithm=grpo", "group.size=4")
    return [
        Case("grpo-1.5b", preset, SMALL_MODEL, grpo, 1, H200_S["grpo"]),
        # The GRPO run with the fp32 upcast of the H200 calibration: both dtype settings measured side by side.
        Case("grpo-1.5b-upcast", preset, SMALL_MODEL, grpo + ("quant.upcast_non_quantized=true",), 1,
             H200_S["grpo-upcast"]),
        Case("rloo-1.5b", preset, SMALL_MODEL, SMALL + ("algorithm=rloo", "group.size=4"), 1, H200_S["rloo"]),
        # Two optimizer steps an iteration (mini-batches of 4 of 8 rows; the smoke's of 2 of 4): the scaler steps.
        fp16,
        # PPO with the reward an adapter on the shared base and the critic a base of its own (critic.model).
        Case("reward-adapter-1.5b", preset, SMALL_MODEL, SMALL + ("reward.backend=adapter", "reward.model={reward_adapter}",
                                                                 "reward.function=null", "critic.model={critic_model}"),
             1, H200_S["reward-adapter"]),
        # Resumed exactly with every 2nd layer checkpointed and its inputs in host memory (activation offload).
        Case("resume-1.5b", preset, SMALL_MODEL, SMALL + ("rollout.max_new_tokens=32", "training.checkpoint_every_n_layers=2",
                                                         "training.activation_offload=true"), 1, H200_S["resume"],
             kind="resume"),
        Case("cli-1.5b", preset, SMALL_MODEL, ("rollout.batch_size=4", "rollout.chunk_size=4", "rollout.max_new_tokens=32",
                                               "ppo.mini_batch_size=4", "ppo.micro_batch_size=2", "data.prompts=builtin:demo"),
             1, H200_S["cli"], kind="cli", keep=("rollout.max_prompt_len=64",)),
    ]


def preference_cases(preset: str) -> list[Case]:
    """``dpo-1.5b`` and ``kto-1.5b`` at ``preset``: its settings, :data:`PREFERENCE_STEPS` optimizer steps."""
    return [Case(f"{m}-1.5b", preset, SMALL_MODEL, (f"{m}.max_steps={PREFERENCE_STEPS}",), PREFERENCE_STEPS,
                 H200_S[m], kind=m) for m in PREFERENCE]


def one_chunk(cfg) -> tuple[str, ...]:
    """A preset's settings for one chunk of prompts: its chunk as the batch and the mini-batch."""
    chunk = cfg.rollout.chunk_size
    return (f"rollout.batch_size={chunk}", f"ppo.mini_batch_size={chunk}")


# -- the card and its preset ----------------------------------------------------------------------------
def gpu_presets() -> dict:
    """name -> config of every preset with a GPU card."""
    from homerlhf.config import load_config, preset_names

    configs = {name: load_config(name) for name in preset_names()}
    return {name: cfg for name, cfg in configs.items() if cfg.card.device == "cuda" and cfg.card.gpu_gib}


def card_preset(device: str, device_gib: float) -> tuple[str, str]:
    """(the preset for the GPU ``device`` of ``device_gib``, why in words): the preset whose card is that GPU
    (the same model words and, within 10%, the same memory: :func:`homerlhf.memory.check_report.card_matches`).
    A card no preset names (an H200, an A100 40GB, an L4) runs at the ``4090`` preset when it holds its 24
    GiB (the process is capped at the preset's card either way), else at the largest preset it holds."""
    from homerlhf.check.runs import REPORTED_SHORT
    from homerlhf.memory.check_report import card_matches

    presets = gpu_presets()
    for name, cfg in presets.items():
        if card_matches(cfg.card.name, cfg.card.gpu_gib, device, device_gib):
            return name, f"the preset of the {cfg.card.name}"
    held = {name: cfg for name, cfg in presets.items() if cfg.card.gpu_gib <= device_gib / (1 - REPORTED_SHORT)}
    if REFERENCE in held:
        return REFERENCE, f"no preset names the {device}: the {REFERENCE} preset, within its card's memory"
    if not held:
        return min(presets, key=lambda n: presets[n].card.gpu_gib), \
            f"no preset fits the {device}'s {device_gib:g} GiB: the smallest card's preset"
    name = max(held, key=lambda n: held[n].card.gpu_gib)
    return name, f"no preset names the {device}: the largest preset within its {device_gib:g} GiB"


def device_spec(device: Optional[str], preset_card: str):
    """The published figures of the GPU ``device`` (:mod:`homerlhf.memory.cards`), else the preset's card's,
    else the H200's (what the estimates scale by)."""
    from homerlhf.memory.cards import CARDS, MEASURED, card_spec
    from homerlhf.memory.check_report import card_tokens

    if device:
        for spec in CARDS.values():
            if card_tokens(spec.name) and card_tokens(spec.name) == card_tokens(device):
                return spec
    return card_spec(preset_card) or MEASURED


# -- sizing: what the planner fits, and how long it takes ----------------------------------------------
COMMON = ("ref.backend=adapter_off", "reward.backend=function", "reward.function={reward_fn}:reward",
          "logging.tensorboard=false", "logging.progress=false")
# Names only, nothing is read (the critic's: the planner's table shape of the model the check builds).
PLANNING_FILES = {"reward_fn": "rewards.py", "reward_adapter": "reward-adapter", "critic_model": CRITIC_MODEL}


def case_config(preset: str, model: str, overrides, files: Optional[dict] = None):
    """The run config of a case on the table model ``model`` (its name: the planner reads its shape)."""
    from homerlhf.config import load_config

    listed = [o.format(**(files or PLANNING_FILES)) for o in COMMON + tuple(overrides)]
    return load_config(preset, overrides=[f"model.name_or_path={model}", *listed])


def iteration_s(cfg, model: str, spec) -> float:
    """The planner's seconds of one iteration of ``cfg`` on the card ``spec`` (the H200's rates scaled
    to it: :func:`homerlhf.memory.timing.default_throughputs`)."""
    from homerlhf.memory.chunks import resolve_generation_chunk
    from homerlhf.memory.shapes import builtin_shape
    from homerlhf.memory.timing import default_throughputs, iteration_time

    shape = builtin_shape(model)
    on = resolve_generation_chunk(cfg.model_copy(update={"card": cfg.card.model_copy(update={"name": spec.name})}), shape)
    return iteration_time(on, default_throughputs(shape, on, 1), cores=1).total_s


def fitting(cfg, model: str) -> Optional[tuple[str, ...]]:
    """The overrides that make ``cfg`` fit its card by the planner: () when it fits as it is, the plan's
    suggestion when that keeps the lengths, None when nothing does."""
    from homerlhf.memory.planner import plan
    from homerlhf.memory.shapes import builtin_shape

    planned = plan(cfg, builtin_shape(model), float(cfg.card.gpu_gib))
    if planned.fits:
        return ()
    extra = tuple(planned.suggestion.set_args) if planned.suggestion else ()
    return extra if extra and not any(a.startswith("rollout.max_") for a in extra) else None


def card_factor(cfg, model: str, spec) -> float:
    """How much longer ``cfg`` takes on the card ``spec`` than on the H200, by the planner."""
    from homerlhf.memory.cards import MEASURED

    return 1.0 if spec is MEASURED else iteration_s(cfg, model, spec) / iteration_s(cfg, model, MEASURED)


def estimated(case: Case, h200_s: float, spec) -> Case:
    """``case`` with its estimates: ``h200_s`` on the H200, times :func:`card_factor` on the card.

    A case's H200 seconds: :data:`H200_S` (the arithmetic in ``scripts/gpu_session.sh``); one of another
    model or preset: the 4090 case's seconds times the planner's iteration time of the two configs on an
    H200. The card factor scales the H200's rates to the card by its published figures
    (:mod:`homerlhf.memory.cards`); a preference case's forwards and backwards are priced on the card
    (:func:`preference_work_s`)."""
    cfg = case_config(case.preset, case.model, case.overrides)
    return replace(case, estimate_s=round(h200_s * card_factor(cfg, case.model, spec)), estimate_h200_s=round(h200_s))


def sized_small(case: Case, spec) -> Optional[Case]:
    """A 1.5B case at its preset, fitted (None: the planner fits it nowhere there) and estimated: its
    H200 seconds scaled from the reference preset's case by the planner's H200 iteration times."""
    from homerlhf.memory.cards import MEASURED

    extra = fitting(case_config(case.preset, case.model, case.overrides), case.model)
    if extra is None:
        return None
    case = replace(case, overrides=case.overrides + extra)
    key = case.name.replace("-1.5b", "")
    reference = replace(case, preset=FP16_PRESET if key == "ppo-fp16" else REFERENCE,
                        overrides=tuple(o for o in case.overrides if o not in extra and o != "quant.compute_dtype=fp16"))
    h200 = H200_S[key]
    if (reference.preset, reference.overrides) != (case.preset, case.overrides):
        ref_cfg = case_config(reference.preset, reference.model, reference.overrides)
        h200 *= iteration_s(case_config(case.preset, case.model, case.overrides), case.model, MEASURED) / \
            iteration_s(ref_cfg, reference.model, MEASURED)
    return estimated(case, h200, spec)


def preference_config(preset: str, model: str, overrides):
    """The run config of a preference case on the table model ``model``."""
    from homerlhf.config import load_config

    return load_config(preset, overrides=[f"model.name_or_path={model}", *PREFERENCE_COMMON, *overrides])


def preference_work_s(cfg, method: str, model: str, spec) -> float:
    """The planner's seconds of a preference case's forwards and backwards on the card ``spec`` (the H200's
    rates, :func:`homerlhf.memory.gpu_rates.gpu_flops`, scaled by FLOPs to the model and to the card): each
    step's rows trained, their no-grad forwards (DPO: the reference's; KTO: the reference's and both models'
    over the KL rows), and the held-out pass (before and after; KTO also over the pairs' answers as rated)."""
    from homerlhf.memory.cards import MEASURED
    from homerlhf.memory.shapes import builtin_shape
    from homerlhf.memory.gpu_rates import gpu_flops, matmul_params

    section = getattr(cfg, method)
    upcast = bool(cfg.quant.load_in_4bit and cfg.quant.upcast_non_quantized)
    flops = {k: v * spec.flops / MEASURED.flops for k, v in gpu_flops(upcast).items()}
    per_token = 2 * matmul_params(builtin_shape(model))
    rows = section.max_steps * section.batch_size * section.grad_accum * (2 if method == "dpo" else 1)
    forwards = rows * (1 if method == "dpo" else 3)
    held = PREFERENCE_HELD * (4 if method == "dpo" else 8)  # chosen and rejected, before and after (+ as rated)
    tokens = section.max_len
    return (3 * rows * tokens * per_token / flops["train"]) + (forwards + held) * tokens * per_token / flops["forward"]


def sized_preference(case: Case, spec) -> Optional[Case]:
    """A preference case at its preset, fitted by ``plan --algorithm`` (its suggestion: fewer rows per
    forward, more accumulated; None when none fits) and estimated: its H200 seconds with its
    forwards and backwards priced on the card instead (:func:`preference_work_s`)."""
    from homerlhf.memory.cards import MEASURED
    from homerlhf.memory.preference import preference_plan
    from homerlhf.memory.shapes import builtin_shape

    cfg = preference_config(case.preset, case.model, case.overrides)
    planned = preference_plan(cfg, builtin_shape(case.model), case.kind, float(cfg.card.gpu_gib))
    if not planned.fits:
        if planned.suggestion is None:
            return None
        case = replace(case, overrides=case.overrides + tuple(planned.suggestion.set_args))
        cfg = preference_config(case.preset, case.model, case.overrides)
    h200 = H200_S[case.kind]
    on_card = h200 - preference_work_s(cfg, case.kind, case.model, MEASURED) + \
        preference_work_s(cfg, case.kind, case.model, spec)
    return replace(case, estimate_s=round(on_card), estimate_h200_s=h200)


def main_case(preset: str, spec) -> Optional[Case]:
    """The PPO case: the largest of :data:`MAIN_MODELS` no larger than the preset's model that fits the
    preset's card, 2 iterations within :data:`MAIN_BUDGET_S` on the card, else 1 (see :func:`sized_cases`)."""
    from homerlhf.memory.cards import MEASURED
    from homerlhf.memory.shapes import builtin_shape

    presets = gpu_presets()
    own = builtin_shape(presets[preset].model.name_or_path)
    ref_cfg = case_config(REFERENCE, "Qwen/Qwen2.5-7B", one_chunk(presets[REFERENCE]))
    per_iteration = (H200_S["ppo"] - LOAD_S) / 2 / iteration_s(ref_cfg, "Qwen/Qwen2.5-7B", MEASURED)
    fits = []
    for model in MAIN_MODELS:
        if own is not None and builtin_shape(model).total_params > own.total_params:
            continue
        settings = one_chunk(presets[preset])
        extra = fitting(case_config(preset, model, settings), model)
        if extra is None:
            continue
        cfg = case_config(preset, model, settings + extra)
        for iterations in (2, 1):
            h200 = LOAD_S + iterations * per_iteration * iteration_s(cfg, model, MEASURED)
            case = estimated(Case(f"ppo-{size_label(model)}", preset, model, settings + extra, iterations, 0), h200, spec)
            if case.estimate_s <= MAIN_BUDGET_S:
                return case
        fits.append(case)
    return min(fits, key=lambda c: c.estimate_s) if fits else None  # none within the budget: the quickest


def sized_cases(preset: str, spec) -> tuple[list[Case], list[str]]:
    """(every case for ``preset`` on the card ``spec``: the PPO case first, then the other PPO cases and
    then the preference ones, each from the quickest to the slowest (a run cut short by a timeout loses
    the fewest), lines naming the cases the planner fits nowhere on that card (nor with a suggestion that
    keeps their lengths)). The cases:

    - ``ppo-<size>`` (:func:`main_case`): PPO on the largest model of :data:`MAIN_MODELS` no larger than the
      preset's own that the planner fits at the preset's settings (one chunk of prompts; the settings its
      plan suggests when they keep the lengths), 2 iterations when they take at most :data:`MAIN_BUDGET_S`
      on the card, else 1, else the next model (none within it: the quickest): Qwen2.5-7B at the 4090 preset;
    - ``grpo-1.5b``, ``grpo-1.5b-upcast``, ``rloo-1.5b``, ``reward-adapter-1.5b``, ``resume-1.5b``,
      ``cli-1.5b``: Qwen2.5-1.5B, 8 prompts of 256 + 64 tokens; ``reward-adapter-1.5b`` with a critic of
      its own (:data:`CRITIC_MODEL`, random weights on the same tokenizer), ``resume-1.5b`` with every 2nd
      layer checkpointed and their inputs in host memory;
    - ``ppo-fp16-1.5b``: the fp16 path (its GradScaler) at the ``t4-colab`` preset where the card holds its
      15 GiB, else at the card's preset with ``quant.compute_dtype=fp16``;
    - ``dpo-1.5b``, ``kto-1.5b``: ``homerlhf dpo`` / ``kto`` at the preset's settings, :data:`PREFERENCE_STEPS`
      steps on :data:`PREFERENCE_PAIRS` pairs, the held-out pass on :data:`PREFERENCE_HELD`
      (:mod:`homerlhf.check.preference_case`), last: the PPO cases run without ``datasets`` and ``trl``
      (absent, as on our GPU machine: :mod:`homerlhf.check.cli_case`), which the preference stage needs."""
    gib = float(gpu_presets()[preset].card.gpu_gib)
    main, rest, preference, left = main_case(preset, spec), [], [], []
    if main is None:
        left.append(f"ppo: no model of {', '.join(MAIN_MODELS)} fits the {preset} preset's card by the planner")
    for case in small_cases(preset, gib) + preference_cases(preset):
        sized = (sized_preference if case.kind in PREFERENCE else sized_small)(case, spec)
        if sized is None:
            left.append(f"{case.name}: the planner fits it nowhere on the {preset} preset's card")
        else:
            (preference if case.kind in PREFERENCE else rest).append(sized)
    return ([main] if main else []) + sorted(rest, key=lambda c: c.estimate_s) + \
        sorted(preference, key=lambda c: c.estimate_s), left


def largest_case(preset: str, spec) -> Case:
    """The table's largest model that the planner says fits the preset's card at its settings as the
    PPO case runs them (one chunk of prompts), or with the settings the plan suggests when they keep
    the lengths, for one iteration (H200: 3 ms a layer a decode step; the update by FLOPs)."""
    from homerlhf.memory.shapes import BUILTIN_SHAPES, builtin_shape

    settings, fits = one_chunk(gpu_presets()[preset]), []
    for name in BUILTIN_SHAPES:
        extra = fitting(case_config(preset, name, settings), name)
        if extra is not None:
            fits.append((builtin_shape(name).total_params, name, extra))
    _, name, extra = max(fits)
    shape, cfg = builtin_shape(name), case_config(preset, name, settings)
    h200 = 10 + shape.num_layers * 0.003 * cfg.rollout.max_new_tokens + 8 * shape.total_params / 7.6e9
    return estimated(Case(f"largest-{name.split('/')[-1]}", preset, name, settings + extra, 1, 0), h200, spec)


def estimated_seconds(todo: list[Case], h200: bool = False) -> int:
    """The estimate of running ``todo`` (on the card, or ``h200``): this process's start, each model's
    build once, each case."""
    from homerlhf.memory.shapes import builtin_shape

    models = {c.model for c in todo} | {CRITIC_MODEL for c in todo if "{critic_model}" in " ".join(c.overrides)}
    builds = sum(BUILD_S_PER_B * builtin_shape(m).total_params / 1e9 for m in models)
    return round(START_S + builds + sum((c.estimate_h200_s or c.estimate_s) if h200 else c.estimate_s for c in todo))
