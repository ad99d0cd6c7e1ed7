"""Memory plans of ``homerlhf dpo`` and ``homerlhf kto`` (``homerlhf plan --algorithm dpo|kto``).

A DPO step is the PPO update's kind of work on other rows: forward and backward of the policy's LoRA
on the shared 4-bit base over ``2 x batch_size`` sequences of up to ``max_len`` tokens (each pair's
chosen and rejected answer; KTO: each answer and the mismatched answer of its KL estimate), after a
no-grad forward of the reference over the same rows (the base with adapters off, or TRL's ``ref``
adapter: one LoRA more, no second base). So the plan is the PPO planner's (:mod:`homerlhf.memory.plans`)
on the view :func:`preference_view` builds: no critic, no generation, no reward model, the
reference forward counted as the scoring phase and the training step as the update phase. The
optimizer is the HF Trainer's AdamW (fp32 states); the answer takes half of ``max_len`` in the
log-prob buffers. The held-out pass after training (:mod:`homerlhf.stages.preference_eval`) is a
phase of its own (:func:`held_out_phase`). What the TRL trainers allocate on a GPU is predicted / not
run on a GPU.
"""

from __future__ import annotations

from typing import Optional

from homerlhf.config.schema import RunConfig
from homerlhf.memory.components import (Assumptions, Component, dtype_bytes, dtype_names,
                                        forward_layer_transient_per_token, lora_on_mlp, overhead_components)
from homerlhf.memory.plans import Plan, PhasePlan, Suggestion, build_plan, persistent_of
from homerlhf.memory.shapes import ModelShape

METHODS = ("dpo", "kto")
PHASE_NAMES = {"scoring": "reference forward", "update": "train step"}
HELD_OUT = "held-out pass"
TRAINING = "training"  # what a run meters as one phase: TRL's train(), its reference forwards and train steps
METERED = {TRAINING: tuple(PHASE_NAMES.values()), HELD_OUT: (HELD_OUT,)}


def preference_view(cfg: RunConfig, method: str) -> RunConfig:
    """``cfg`` as the PPO planner counts a ``method`` run: its rows as the micro-batch, ``max_len`` as
    prompt + response, the reference as ``adapter_off``, nothing generated or scored by a reward."""
    section = getattr(cfg, method)
    rows = 2 * section.batch_size
    answer = section.max_len // 2
    data = cfg.model_dump(mode="json", by_alias=True)
    data["algorithm"] = "grpo"
    data["ppo"] = {**data["ppo"], "micro_batch_size": rows, "mini_batch_size": rows}
    data["group"] = {"size": 2, "kl_in": None, "dr_grpo": False, "loss_aggregation": None}
    data["rollout"] = {**data["rollout"], "batch_size": rows, "chunk_size": rows, "generation_chunk": None,
                       "max_prompt_len": section.max_len - answer, "max_new_tokens": answer, "async": False,
                       "engine": "hf", "decoder": "hf"}  # nothing decodes: no static decoder's side stream
    data["actor"] = {**data["actor"], "optimizer": "adamw"}
    data["ref"] = {**data["ref"], "backend": "adapter_off", "url": None}
    data["reward"] = {**data["reward"], "backend": "function", "function": "none.py:none", "model": None,
                      "url": None, "components": []}
    return RunConfig.model_validate(data)


def held_out_batch(cfg: RunConfig, method: str) -> tuple[int, int]:
    """``(rows per forward, log-prob chunk in tokens)`` the held-out pass starts with: the rows of one
    training forward (``2 x batch_size``), ``ppo.logprob_chunk_size`` answer positions per row. Out of
    memory, both halve with the rows (:func:`homerlhf.stages.preference_eval.completion_logprobs`)."""
    rows = 2 * getattr(cfg, method).batch_size
    return rows, rows * cfg.ppo.logprob_chunk_size


def held_out_phase(cfg: RunConfig, shape: ModelShape, method: str,
                   assumptions: Assumptions = Assumptions()) -> tuple[str, list[Component]]:
    """The held-out pass's peak moment and its transients (:func:`held_out_moments`)."""
    moments = held_out_moments(cfg, shape, method, assumptions)
    name = max(moments, key=lambda k: sum(x.bytes for x in moments[k]))
    return name, moments[name]


def held_out_moments(cfg: RunConfig, shape: ModelShape, method: str,
                     assumptions: Assumptions = Assumptions()) -> dict[str, list[Component]]:
    """The held-out pass's transients at each of its two moments: a no-grad forward of the decoder over ``rows``
    sequences of up to ``max_len`` tokens (as the reference forward), then the answers' positions gathered
    and the LM head with a log-softmax over ``chunk`` of them at a time
    (:func:`homerlhf.models.sequence_logprobs.answer_logprobs`): the chunk's fp32 logits and one fp32
    temporary as large (``logsumexp``'s shifted copy), never the full (rows, width, V) logits."""
    view = preference_view(cfg, method)
    c, a, _ = dtype_bytes(view, assumptions)
    act = dtype_names(view)[1]
    rows, chunk = held_out_batch(cfg, method)
    t = getattr(cfg, method).max_len
    answers = rows * (t - 1)  # at most every position but each row's first
    layer = rows * t * forward_layer_transient_per_token(shape, a, c, lora_on_mlp(cfg.actor.lora)) + rows * t * t * a
    if assumptions.attention == "eager":
        layer += 2 * rows * shape.num_heads * t * t * a
    ids = Component("token ids, indices, log-probs", "buffers", rows * t * 16 + answers * 28, dtype="int64",
                    note="ids and mask; per answer position its row, column, target and fp32 log-prob")
    forward = [Component("hidden states", "activations", rows * t * shape.hidden_size * a, dtype=act,
                         note=f"{rows} x {t} tokens"),
               Component("layer activations (no grad)", "activations", int(layer), dtype=act), ids]
    if cfg.quant.load_in_4bit:
        forward.append(Component("dequantized weight", "activations", shape.largest_linear_params * c,
                                 dtype=dtype_names(view)[0]))
    logprobs = [Component("answer hidden states", "activations", answers * shape.hidden_size * a, dtype=act,
                          note=f"the answers' positions of {rows} rows, gathered"),
                Component("log-prob chunk", "logits", 2 * min(chunk, answers) * shape.vocab_size * 4, dtype="fp32",
                          note=f"{min(chunk, answers)} x {shape.vocab_size} x 4: logits and logsumexp's temporary"),
                ids]
    return {"forward": forward, "answer log-probs": logprobs}


def _held_out_plan(cfg: RunConfig, shape: ModelShape, method: str) -> PhasePlan:
    view = preference_view(cfg, method)
    moment, transient = held_out_phase(cfg, shape, method)
    comps = persistent_of(view, shape, Assumptions()) + transient
    allocated = sum(x.bytes for x in comps if x.in_allocator)
    return PhasePlan(HELD_OUT, moment, comps + overhead_components(view, allocated, Assumptions()))


def preference_plan(cfg: RunConfig, shape: ModelShape, method: str, gpu_gib: Optional[float] = None) -> Plan:
    """The plan of a ``method`` run: the reference forward, the train step and the held-out pass; a
    suggestion (smaller rows per step with more accumulation, then gradient checkpointing) when it does
    not fit."""
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
    plan.phases.append(_held_out_plan(cfg, shape, method))
    plan.workers = {}
    rows = "pairs (chosen + rejected)" if method == "dpo" else "answers (+ their KL answers)"
    plan.notes = [f"{method}: {section.batch_size} {rows} per forward, {section.grad_accum} accumulated per step, "
                  f"up to {section.max_len} tokens each; the reference is the starting policy on the same base",
                  "held-out pass: {} rows per forward, the LM head over {} answer tokens at a time (halved when "
                  "out of memory)".format(*held_out_batch(cfg, method)),
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


def metered_phases(plan: Plan) -> dict[str, PhasePlan]:
    """The planned phase each phase a run meters (:data:`METERED`, the stage's ``peak_mem_gib``) peaks in:
    ``training`` the larger of the reference forward and the train step, ``held-out pass`` itself."""
    by_name = {p.name: p for p in plan.phases}
    return {metered: max((by_name[n] for n in names), key=lambda p: p.allocated_bytes)
            for metered, names in METERED.items()}


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
