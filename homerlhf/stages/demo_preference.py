"""`homerlhf demo --method dpo|kto`: the builtin task learned from its preference pairs directly.

The same SFT model as the RL demo (``builtin:demo-sft``, built once then cached), the same 1,800
training pairs its reward model learns from (``builtin:demo-pairs``), but no reward model and no
sampling during training: TRL's DPO (or KTO, each pair one good and one bad answer) trains the
policy's LoRA on the 4-bit base (:mod:`homerlhf.stages.preference`), the reference being the SFT
model itself (adapters off). Then the RL demo's held-out evaluation and verdict
(:func:`homerlhf.stages.demo.before_after`, :func:`homerlhf.stages.demo.verdict`): 8 answers to each
of the 40 held-out prompts per side at temperature 0.7, the task's checker and the well-formed
check; the KL in the verdict is measured on those answers (:func:`answer_log_ratio`), as it is for
every method of docs/demo.md's side-by-side table.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from homerlhf.config import RunConfig, load_config
from homerlhf.errors import UserError

METHODS = ("dpo", "kto")
# The recipe on top of the cpu-tiny preset: the policy's LoRA (actor.lora, r=8 on every linear layer)
# on the NF4 demo-sft model. DPO: 96 steps of 16 pairs (1,536 of the 1,800), lr 1e-3, beta 1.0
# (not TRL's 0.1: at 0.1 a learning rate that moved the policy at all took the chosen replies down too),
# and TRL's sft loss on the chosen answers at weight 10 beside the DPO loss (RPO): without it, or at
# weight 3, every DPO run lost 0.07-0.24 of its well-formed answers (facts garbled where a rejected reply
# was pushed down), whichever kinds of pairs it trained on. KTO: 64 steps of 32 answers, lr 1.5e-3.
# Measured on AMD EPYC, 1 thread (docs/demo.md, "DPO and KTO beside RL", has every recipe tried): DPO said
# "improved" on seeds 0-2 under default and AVX2 kernels; KTO on seed 0 only.
RECIPE = {
    "dpo": ["dpo.lr=1e-3", "dpo.beta=1.0", "dpo.sft_weight=10.0", "dpo.batch_size=16", "dpo.grad_accum=1",
            "dpo.max_len=112", "dpo.max_steps=96", "dpo.warmup_ratio=0.05", "checkpoint.every=96"],
    "kto": ["kto.lr=1.5e-3", "kto.beta=1.0", "kto.batch_size=32", "kto.grad_accum=1", "kto.max_len=112",
            "kto.max_steps=64", "kto.warmup_ratio=0.05", "checkpoint.every=64"],
}
DATA, EVAL_DATA = "builtin:demo-pairs", "builtin:demo-pairs-heldout"


def preference_demo_config(out: Path, method: str, seed: int = 0, overrides: tuple[str, ...] = ()) -> RunConfig:
    if method not in METHODS:
        raise UserError(f"demo --method {method!r}: choose dpo or kto (or --algorithm grpo, rloo or ppo for RL)")
    return load_config("cpu-tiny", overrides=[*RECIPE[method], f"output_dir={out}", f"seed={seed}",
                                              "logging.progress=false", "checkpoint.keep=1", *overrides])


def _log(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def answer_log_ratio(checkpoint: Path, cfg: RunConfig, rows: list[dict[str, Any]]) -> float:
    """Mean over the held-out answers of the trained policy of ``log p_policy(y|x) - log p_SFT(y|x)``,
    summed over the answer's tokens (nats per answer): the KL to the SFT model, estimated on the
    answers the evaluation sampled (temperature 0.7), the same way for every method compared."""
    import torch

    from homerlhf.models.sequence_logprobs import answer_logprobs
    from homerlhf.models.side_by_side import EvalModels

    models = EvalModels(cfg, checkpoint)
    model = models.model

    def logps() -> list[float]:  # one row at a time, the LM head over 64 of its positions at a time
        return [float(answer_logprobs(model, [row["prompt_ids"] + row["after_ids"]], [len(row["prompt_ids"])], 0,
                                      64)[0].sum()) for row in rows]

    try:
        with torch.no_grad():
            after = logps()
            with model.disable_adapter():
                before = logps()
    finally:
        models.close()
    return sum(a - b for a, b in zip(after, before)) / len(rows)


def write_markdown(rows: list[dict[str, Any]], figures, verdict_line: str, method: str, path: Path) -> Path:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ") or "(empty)"

    lines = [f"# Before / after {method.upper()} on {len(rows)} held-out answers", "", f"**{verdict_line}**", "",
             f"| figure | before (SFT) | after {method.upper()} |", "|---|---|---|"]
    lines += [f"| {name} | {b:.3f} | {a:.3f} |" for name, (b, a) in figures.items()]
    lines += ["", f"| prompt | before (SFT) | after {method.upper()} |", "|---|---|---|"]
    lines += [f"| {cell(r['prompt'])} | {cell(r['before'])} | {cell(r['after'])} |" for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_preference_demo(out: str | Path, method: str, overwrite: bool = False, seed: int = 0) -> dict[str, Any]:
    """The demo with ``method`` instead of RL; returns the figures, the verdict and the times."""
    import torch

    from homerlhf.models.registry import resolve_model
    from homerlhf.stages.demo import before_after, held_out_figures, verdict
    from homerlhf.stages.preference import run_preference
    from homerlhf.stages.preference_start import RUN_FILE

    out = Path(out)
    cfg = preference_demo_config(out, method, seed)
    if any((out / name).exists() for name in (RUN_FILE, "checkpoints", "metrics.jsonl")) and not overwrite:
        raise UserError(f"{out} already holds a run; pass --overwrite or choose another --out")
    _log(f"torch CPU kernels: {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    times: dict[str, float] = {}
    _log("1/3 tokenizer + tiny Llama + SFT on the builtin polite/on-topic task")
    t0 = time.perf_counter()
    resolve_model(cfg.model.name_or_path)
    times["SFT (tiny model, built once then cached)"] = time.perf_counter() - t0
    _log(f"2/3 {method.upper()} (TRL) on the {DATA} pairs, from the SFT model: no reward model, no sampling")
    t0 = time.perf_counter()
    summary = run_preference(method, cfg, out, data=[DATA], eval_data=EVAL_DATA, overwrite=overwrite)
    times[method.upper()] = time.perf_counter() - t0
    _log("3/3 the held-out evaluation before/after (the RL demo's)")
    t0 = time.perf_counter()
    checkpoint = Path(summary["checkpoint"])
    rows = before_after(checkpoint, cfg, scored=False)
    figures = held_out_figures(rows)
    kl = answer_log_ratio(checkpoint, cfg, rows)
    improved, verdict_line = verdict(figures, kl)
    write_markdown(rows, figures, verdict_line, method, out / "before_after.md")
    (out / "before_after.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    times["held-out evaluation"] = time.perf_counter() - t0
    result = {"method": method, "seed": seed, "figures": {k: list(v) for k, v in figures.items()}, "kl": kl,
              "improved": improved, "verdict": verdict_line, "times": times, "held_out_pairs": summary["held_out"],
              "checkpoint": str(checkpoint)}
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    for name, (before, after) in figures.items():
        _log(f"held-out ({len(rows)}) {name}: {before:.3f} -> {after:.3f}")
    _log(f"KL to the SFT model on those answers: {kl:.3f} nats/answer; "
         + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()))
    print(verdict_line, flush=True)
    return result
