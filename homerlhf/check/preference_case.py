"""The ``dpo`` and ``kto`` cases of ``homerlhf check``: the preference stage as ``homerlhf dpo`` / ``kto``
runs it (:func:`homerlhf.stages.preference.run_preference`: TRL's trainer on the NF4 base with a new LoRA,
the reference the base with its adapters off), on pairs the check writes, measured against
``homerlhf plan --algorithm dpo|kto`` (:func:`homerlhf.memory.preference.preference_plan`).

**The pairs**: :data:`~homerlhf.check.cases.PREFERENCE_PAIRS` for training and
:data:`~homerlhf.check.cases.PREFERENCE_HELD` held out
(``prompt`` / ``chosen`` / ``rejected`` JSONL), words of a fixed list sized with the case's tokenizer:
each answer half of ``max_len`` with its end-of-turn token, each prompt longer than the rest, which
the stage cuts to fit (``data.overlong: truncate``). Every row is then as long as the plan counts
(its worst case, as the PPO cases' random responses run to ``max_new_tokens``).

**The phases** the stage meters (its ``peak_mem_gib``): ``training`` (TRL's ``train()``, compared with
the larger of the plan's reference forward and train step) and the ``held-out pass``.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import time
from pathlib import Path

# The words of the pairs: the chosen answers of the first list, the rejected of the second, the prompts of
# the third (each row starts its list at another word: no two rows alike).
CHOSEN_WORDS = ("thanks", "glad", "to", "help", "here", "is", "a", "clear", "and", "kind", "answer", "for", "you")
REJECTED_WORDS = ("no", "go", "away", "that", "is", "wrong", "and", "rude", "never", "ask", "again", "bad")
PROMPT_WORDS = ("tell", "me", "about", "tea", "cats", "snow", "maps", "bees", "the", "moon", "rivers", "bread",
                "owls", "ice", "salt", "wind")


def sized_text(tokenizer, words: tuple[str, ...], start: int, n_tokens: int) -> str:
    """Words of ``words`` from index ``start`` on (cycling; where the next one would not fit, the first
    after it that does) until they hold ``n_tokens`` tokens: exactly where a word of the list is one token
    (each is, in the tiny tokenizer the check saves its models with). A byte-level BPE splits text at
    spaces before merging, so a text's tokens are its words'."""
    def cost(word: str, first: bool) -> int:
        return len(tokenizer(word if first else " " + word, add_special_tokens=False)["input_ids"])

    costs = {(w, first): cost(w, first) for w in words for first in (True, False)}
    out, used = [], 0
    while True:
        following = (words[(start + len(out) + k) % len(words)] for k in range(len(words)))
        word = next((w for w in following if used + costs[w, not out] <= n_tokens), None)
        if word is None:
            return " ".join(out)
        used += costs[word, not out]
        out.append(word)


def pairs(tokenizer, max_len: int, first: int, n: int) -> list[dict]:
    """``n`` pairs (rows ``first`` ... ``first + n - 1``) whose rows run to ``max_len`` tokens: see the
    module docstring."""
    answer = max_len // 2 - 1  # + the end-of-turn token: the plan's half of max_len
    return [{"prompt": f"{i}. " + sized_text(tokenizer, PROMPT_WORDS, i, max_len),
             "chosen": sized_text(tokenizer, CHOSEN_WORDS, i, answer),
             "rejected": sized_text(tokenizer, REJECTED_WORDS, i, answer)} for i in range(first, first + n)]


def write_pairs(folder: Path, model_dir: Path, max_len: int) -> tuple[str, str]:
    """The training and held-out pairs' files in ``folder``, for the tokenizer of ``model_dir``."""
    from homerlhf.check.cases import PREFERENCE_HELD, PREFERENCE_PAIRS
    from homerlhf.models.policy import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for name, first, n in (("train", 0, PREFERENCE_PAIRS), ("held", PREFERENCE_PAIRS, PREFERENCE_HELD)):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in pairs(tokenizer, max_len, first, n)))
        files.append(str(path))
    return files[0], files[1]


def logged(run_dir: Path) -> tuple[dict, int]:
    """(TRL's first logged step in ``metrics.jsonl``: its loss and reward figures, before the first update,
    when the policy is its reference: DPO's sigmoid loss ln 2, KTO's 0.5; the tokens it trained on, its
    last ``num_tokens``)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first = next((r for r in rows if "loss" in r), {})
    tokens = next((int(r["num_tokens"]) for r in reversed(rows) if "num_tokens" in r), 0)
    return {k: v for k, v in first.items() if k in ("step", "loss", "kl") or k.startswith(("rewards/", "logps/"))}, tokens


def comparison(planned, measured_gib: dict) -> dict:
    """Per metered phase: the plan's phase it is compared with (and its peak moment), planned and measured
    allocated GiB and the error (planned - measured) / measured."""
    from homerlhf.memory.preference import metered_phases

    out = {}
    for name, phase in metered_phases(planned).items():
        got = measured_gib.get(name)
        if got is not None:
            out[name] = {"plan_phase": phase.name, "moment": phase.moment, "predicted_gib": round(phase.allocated_gib, 4),
                         "measured_gib": round(got, 4),
                         "error": round((phase.allocated_gib - got) / got, 4) if got else float("nan")}
    return out


def reserved_gib(smoke: bool):
    """The most the allocator reserved since the held-out pass began, or held at the end (it keeps what
    it reserved unless emptied: the training's too); None on the CPU."""
    if smoke:
        return None
    import torch

    return round(max(torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved()) / 2**30, 4)


def preference_case(case, run) -> dict:
    """One ``dpo`` / ``kto`` case (``case.kind``): its config as ``homerlhf dpo`` loads and checks it, its
    pairs, the stage's run, and its figures beside the plan (``case``, ``run``: ``cases.Case``, ``run.Run``)."""
    from homerlhf.check.cli_case import with_preference_packages
    from homerlhf.check.runs import cap_memory
    from homerlhf.config import check_device, load_config
    from homerlhf.memory.preference import preference_plan
    from homerlhf.memory.shapes import resolve_shape
    from homerlhf.stages.preference import run_preference

    started, method = time.perf_counter(), case.kind
    with_preference_packages()  # absent until now, for every PPO case before (homerlhf.check.cli_case)
    overrides = run.overrides(case)
    model_dir = run.model_dir(case.model, build=False)
    cfg = load_config(case.preset, overrides=[f"model.name_or_path={model_dir}", *overrides])  # before any build
    check_device(cfg)
    run.model_dir(case.model)
    cap = float(cfg.card.gpu_gib)
    planned = preference_plan(cfg, resolve_shape(str(model_dir)), method, cap)
    train, held = write_pairs(run.tmp / case.name, model_dir, getattr(cfg, method).max_len)
    if not run.smoke:
        cap_memory(cap)
    run_dir = run.tmp / case.name / "run"
    with contextlib.redirect_stdout(io.StringIO()):  # its data reports and TRL's logged rows: in the entry
        summary = run_preference(method, cfg, run_dir, data=[train], base=str(model_dir), eval_data=held)
    if summary["peak_mem_kind"] != ("cpu_rss" if run.smoke else "cuda_max_allocated"):
        raise AssertionError(f"the stage metered {summary['peak_mem_kind']}")
    entry = {"case": case.name, "kind": method, "preset": case.preset, "model": case.model, "cap_gib": cap,
             "estimate_s": case.estimate_s, "estimate_h200_s": case.estimate_h200_s, "overrides": overrides}
    entry.update(figures(cfg, method, planned, summary, run_dir, run.smoke))
    entry["wall_s"] = round(time.perf_counter() - started, 1)
    return entry


def figures(cfg, method: str, planned, summary: dict, run_dir: Path, smoke: bool) -> dict:
    """What the report holds of a preference case's run: the plan and the measured peaks side by side,
    steps, seconds, TRL's first logged step, the held-out figures, the rows."""
    from homerlhf.check.measures import current_flags

    section, (first, tokens) = getattr(cfg, method), logged(run_dir)
    phases = {p.name: {"allocated_gib": round(p.allocated_gib, 4), "total_gib": round(p.total_gib, 4),
                       "moment": p.moment} for p in planned.phases}
    counts = ("n_train", "n_eval_pairs", "n_eval_rated", "n_good", "n_bad")
    return {"settings": planned.settings, "plan": {"status": planned.status, "phases": phases},
            "measured_gib": summary["peak_mem_gib"], "comparison": comparison(planned, summary["peak_mem_gib"]),
            "max_reserved_gib": reserved_gib(smoke),
            "optimizer_steps": {"steps": summary["steps"], "taken": summary["steps"], "skipped": 0},
            "batch_size": summary["batch_size"], "grad_accum": section.grad_accum, "max_len": section.max_len,
            "seconds": {"training": summary["seconds"], "held-out pass": summary["held_out_seconds"]},
            "tokens_per_s": {"training": round(tokens / summary["seconds"], 1) if summary["seconds"] else None},
            "first_step": first, "train_loss": summary["train_loss"], "held_out": summary["held_out"],
            "rows": {k: summary[k] for k in counts if k in summary},
            "data": [{k: d[k] for k in ("format", "n_rows", "n_usable", "n_truncated", "n_dropped")}
                     for d in summary["data"]],
            "precision_flags": current_flags()}


def start_loss(method: str) -> float:
    """The loss of a policy equal to its reference: DPO's sigmoid ``-log sigmoid(0)``, KTO's ``1 - sigmoid(0)``."""
    return math.log(2) if method == "dpo" else 0.5
