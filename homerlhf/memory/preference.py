"""Memory plans of ``homerlhf dpo`` and ``homerlhf kto`` (``homerlhf plan --algorithm dpo|kto``).

A DPO step is the PPO update's kind of work on other rows: forward and backward of the policy's LoRA
on the shared 4-bit base over ``2 x batch_size`` sequences of up to ``max_len`` tokens (each pair's
chosen and rejected answer; KTO: each answer and the mismatched answer of its KL estimate), after a
no-grad forward of the reference over the same rows (the base with adapters off, or TRL's ``ref``
adapter: one LoRA more, no second base). So the plan is the PPO planner's (:mod:`homerlhf.memory.plans`)
on the view :func:`preference_view` builds: no critic, no generation, no reward model, the
reference forward counted as the scoring phase and the training step as the update phase. The
optimizer is the HF Trainer's AdamW (fp32 states); the answer takes half of ``max_len`` in the
log-prob buffers. What the TRL trainers allocate on a GPU is predicted / not run on a GPU.
"""

from __future__ import annotations

from typing import Optional

from homerlhf.config.schema import RunConfig
from homerlhf.memory.plans import Plan, Suggestion, build_plan
from homerlhf.memory.shapes import ModelShape

METHODS = ("dpo", "kto")
PHASE_NAMES = {"scoring": "reference forward", "update": "train step"}


def preference_view(cfg: RunConfig, method: str) -> RunConfig:
    """``cfg`` as the PPO planner counts a ``method`` run: its rows as the micro-batch, ``max_len`` as
    prompt + response, the reference as ``adapter_off``, nothing generated or scored by a reward."""
    section = getattr(cfg, method)
    rows = 2 * section.batch_size
    answer = section.max_len // 2
    data = cfg.model_dump(mode="json", by_alias=True)
    data["algorithm"] = "grpo"
    data["ppo"] = {**data["ppo"], "group_size": 2, "micro_batch_size": rows, "mini_batch_size": rows,
                   "kl_in": None, "dr_grpo": False, "loss_aggregation": None}
    data["rollout"] = {**data["rollout"], "batch_size": rows, "chunk_size": rows, "generation_chunk": None,
                       "max_prompt_len": section.max_len - answer, "max_new_tokens": answer, "async": False,
                       "engine": "hf"}
    data["actor"] = {**data["actor"], "optimizer": "adamw"}
    data["ref"] = {**data["ref"], "backend": "adapter_off", "url": None}
    data["reward"] = {**data["reward"], "backend": "function", "function": "none.py:none", "model": None,
                      "url": None, "components": []}
    return RunConfig.model_validate(data)


def preference_plan(cfg: RunConfig, shape: ModelShape, method: str, gpu_gib: Optional[float] = None) -> Plan:
    """The plan of a ``method`` run: the reference forward and the train step; a suggestion (smaller
    rows per step with more accumulation, then gradient checkpointing) when it does not fit."""
    plan = _plan(cfg, shape, method, gpu_gib)
    if plan.fits is False:
        plan.suggestion = _suggest(cfg, shape, method, gpu_gib)
    return plan


def _plan(cfg: RunConfig, shape: ModelShape, method: str, gpu_gib: Optional[float]) -> Plan:
    section = getattr(cfg, method)
    plan = build_plan(preference_view(cfg, method), shape, gpu_gib)
    plan.phases = [p for p in plan.phases if p.name in PHASE_NAMES]
    for phase in plan.phases:
        phase.name = PHASE_NAMES[phase.name]
    plan.workers = {}
    rows = "pairs (chosen + rejected)" if method == "dpo" else "answers (+ their KL answers)"
    plan.notes = [f"{method}: {section.batch_size} {rows} per forward, {section.grad_accum} accumulated per step, "
                  f"up to {section.max_len} tokens each; the reference is the starting policy on the same base",
                  "TRL's trainers on a GPU: predicted / not run on a GPU"]
    plan.settings = {**plan.settings, "algorithm": method, f"{method}.batch_size": section.batch_size,
                     f"{method}.max_len": section.max_len, f"{method}.grad_accum": section.grad_accum}
    return plan


def _with(cfg: RunConfig, method: str, **changes) -> RunConfig:
    data = cfg.model_dump(mode="json", by_alias=True)
    for key, value in changes.items():
        section, name = key.split("__")
        data[section] = {**data[section], name: value}
    return RunConfig.model_validate(data)


def _suggest(cfg: RunConfig, shape: ModelShape, method: str, gpu_gib: Optional[float]) -> Optional[Suggestion]:
    section = getattr(cfg, method)
    batch, accum, ckpt = section.batch_size, section.grad_accum, cfg.training.gradient_checkpointing
    while True:
        if batch > 1:
            batch, accum = batch // 2, accum * 2
        elif not ckpt:
            ckpt = True
        else:
            return None
        trial = _with(cfg, method, **{f"{method}__batch_size": batch, f"{method}__grad_accum": accum,
                                      "training__gradient_checkpointing": ckpt})
        plan = _plan(trial, shape, method, gpu_gib)
        if plan.fits:
            overrides = {f"{method}.batch_size": batch, f"{method}.grad_accum": accum}
            if ckpt != cfg.training.gradient_checkpointing:
                overrides["training.gradient_checkpointing"] = ckpt
            return Suggestion(overrides, plan.peak_gib, plan.headroom_gib)


def print_preference_plan(plan: Plan, console=None) -> None:
    """One table per phase, the verdict and the suggestion (no generation, workers or time)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from homerlhf.memory.render import precision_line, suggestion_line

    console = console or Console(width=110)
    console.print(f"Memory plan ({plan.settings['algorithm']}): {plan.model} ({plan.params['total'] / 1e9:.2f} B params) "
                  f"on {plan.card}" + (f" ({plan.gpu_gib:g} GiB)" if plan.gpu_gib else "") + f", preset {plan.preset}",
                  highlight=False)
    console.print(precision_line(plan), highlight=False)
    for phase in plan.phases:
        table = Table(title=f"{phase.name}: peak at {phase.moment}", title_justify="left")
        for col in ("component", "GiB", "dtype", "note"):
            table.add_column(col, justify="right" if col == "GiB" else "left")
        for comp in phase.components:
            table.add_row(escape(comp.name), f"{comp.gib:.2f}", escape(comp.dtype), escape(comp.note))
        table.add_row("total", f"{phase.total_gib:.2f}", "", f"allocated (torch): {phase.allocated_gib:.2f} GiB")
        console.print(table)
    prefix = {"fits": "OK: ", "tight": "TIGHT: ", "over": "NO: ", None: ""}[plan.status]
    console.print(prefix + plan.verdict(), highlight=False)
    if plan.fits is False:
        console.print(suggestion_line(plan), highlight=False)
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False)
