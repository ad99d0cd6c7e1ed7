"""`homerlhf demo --algorithm grpo|rloo|ppo`: RL with a verifiable reward, offline on CPU.

The builtin digit-reversal task (:mod:`homerlhf.data.builtin_reverse`): a tiny Llama after a short
SFT (``builtin:reverse-sft``, built once then cached) answers "Reverse: 4 7 1" in the two styles of
its SFT data, "1 7 4" and "Reversed: 1 7 4", and gets about a fifth right when sampled; the reward is the task's own checker (``reward.function: builtin:reverse``, 1
for the exact answer, else 0), no reward model. RL then trains on the training strings, and the
demo measures what it taught on held-out strings it never practised on: exact-match accuracy of
sampled answers (temperature 1, the policy RL optimises) before and after, on every held-out
string, ``EVAL_SAMPLES`` samples each with the same per-sample seeds for both models, and what that
accuracy is made of (:func:`style_split`: answers in the accepted style, right digits among them).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from homerlhf.config import RunConfig, load_config
from homerlhf.errors import UserError

ALGORITHMS = ("grpo", "rloo", "ppo")
# Measured on a quiet 2-core machine, --fast, seed 0 (docs/ppo_details.md, detail 19): held-out
# accuracy 0.204 -> 0.610 (GRPO), 0.606 (RLOO), 0.639 (PPO), about 1 min each; at lr 3e-3 GRPO
# reached 0.531 with the training batch swinging 0.2-0.7, and lr 1e-2 collapsed every algorithm.
RECIPE = [
    "model.name_or_path=builtin:reverse-sft",
    "data.prompts=builtin:reverse",
    "reward.backend=function",
    "reward.function=builtin:reverse",
    "ref.backend=adapter_off",  # the base under the adapter is the SFT model: no worker to start
    "rollout.max_prompt_len=24",
    "rollout.max_new_tokens=16",  # "Reversed: 1 2 3 4 5" and the stop token fit
    "rollout.truncation_penalty=null",  # a cut answer already scores 0
    "ppo.adaptive_kl=false",
    "rollout.batch_size=128",
    "rollout.chunk_size=128",
    "ppo.mini_batch_size=64",
    "ppo.micro_batch_size=64",
    "ppo.epochs=2",
    "ppo.kl_coef=0.02",
    "actor.lr=2e-3",
    "critic.lr=2e-3",
    "ppo.iterations=80",
    "checkpoint.every=80",
]
GROUP_SIZE = 8  # samples per prompt for grpo / rloo: 16 strings x 8 answers per iteration
FAST_OVERRIDES = ["ppo.iterations=40", "checkpoint.every=40"]
EVAL_SAMPLES = 4  # sampled answers per held-out string
MARGIN = 0.05  # held-out accuracy gain (absolute) the summary calls an improvement
N_SHOWN = 12  # held-out strings shown in before_after.md


def verifiable_demo_config(out: Path, algorithm: str, fast: bool = False, seed: int = 0,
                           overrides: tuple[str, ...] = ()) -> RunConfig:
    """The cpu-tiny preset with the verifiable task's recipe for ``algorithm`` (then ``overrides``)."""
    if algorithm not in ALGORITHMS:
        raise UserError(f"demo --algorithm {algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
    # grpo and rloo: the KL as k3 in the loss (measured over 80 iterations, RLOO with its default k1
    # penalty in the reward drifted to KL 5.6 and 0.386 held-out accuracy; with k3 in the loss, 0.703)
    group = [f"group.size={GROUP_SIZE}", "group.kl_in=loss"] if algorithm != "ppo" else []
    return load_config("cpu-tiny", overrides=[
        *RECIPE, f"algorithm={algorithm}", *group, f"output_dir={out}", f"seed={seed}",
        *(FAST_OVERRIDES if fast else []), *overrides])


def _log(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


@torch.no_grad()
def held_out_answers(policy, cfg: RunConfig, adapter: bool, seed: int) -> list[dict[str, Any]]:
    """Every held-out string with ``EVAL_SAMPLES`` sampled answers of the RL adapter (``adapter``)
    or of the SFT model underneath it: ``{"prompt", "answer", "responses", "right"}`` per string.
    Sample ``k`` of string ``i`` draws from its own seed, the same for both models."""
    from homerlhf.data import builtin_reverse
    from homerlhf.ppo.rollout import generate_rollout
    from homerlhf.stages.ppo import load_prompt_rows

    held = cfg.model_copy(update={"data": cfg.data.model_copy(update={"prompts": "builtin:reverse-heldout"})})
    prompts, rows = load_prompt_rows(held, policy.tokenizer)
    repeated = [p for p in prompts for _ in range(EVAL_SAMPLES)]
    seeds = [seed * 1_000_003 + i for i in range(len(repeated))]
    texts: list[str] = []
    for start in range(0, len(repeated), 256):
        chunk, chunk_seeds = repeated[start : start + 256], seeds[start : start + 256]
        if adapter:
            batch = generate_rollout(policy, chunk, cfg.rollout, seeds=chunk_seeds)
        else:
            with policy.model.disable_adapter():
                batch = generate_rollout(policy, chunk, cfg.rollout, seeds=chunk_seeds)
        texts += [policy.tokenizer.decode(r, skip_special_tokens=True) for r in batch.response_lists()]
    out = []
    for i, row in enumerate(rows):
        responses = texts[i * EVAL_SAMPLES : (i + 1) * EVAL_SAMPLES]
        right = [builtin_reverse.check(t, row["answer"]) for t in responses]
        out.append({"prompt": row["prompt"], "answer": row["answer"], "responses": responses, "right": right})
    return out


def accuracy(answers: list[dict[str, Any]]) -> float:
    """Fraction of right answers over every sample of every string."""
    return sum(sum(a["right"]) for a in answers) / sum(len(a["right"]) for a in answers)


def style_split(answers: list[dict[str, Any]]) -> dict[str, float]:
    """What the accuracy is made of: ``checked_style``, the fraction of samples in the style the
    checker accepts (not "Reversed: ..."), and ``right_in_style``, the fraction of those that are right."""
    from homerlhf.data.builtin_reverse import in_checked_style

    pairs = [(in_checked_style(t), r) for a in answers for t, r in zip(a["responses"], a["right"])]
    in_style = [r for ok, r in pairs if ok]
    return {"checked_style": len(in_style) / len(pairs), "right_in_style": sum(in_style) / max(len(in_style), 1)}


def evaluate(cfg: RunConfig, checkpoint: Path) -> dict[str, list[dict[str, Any]]]:
    """Held-out answers of the SFT model (adapter off) and of the RL policy from ``checkpoint``."""
    from homerlhf.models.policy import PolicyModel
    from homerlhf.models.registry import resolve_model
    from homerlhf.ppo.checkpoint import load_adapters

    policy = PolicyModel.from_config(cfg, resolve_model(cfg.model.name_or_path))
    load_adapters(policy, checkpoint)
    return {"before": held_out_answers(policy, cfg, adapter=False, seed=cfg.seed),
            "after": held_out_answers(policy, cfg, adapter=True, seed=cfg.seed)}


def write_before_after(answers: dict[str, list[dict[str, Any]]], algorithm: str, path: Path) -> Path:
    """The held-out accuracy before/after and the first ``N_SHOWN`` strings' first sampled answers."""
    def cell(text: str, right: bool) -> str:
        return (text.replace("|", "\\|").replace("\n", " ").strip() or "(empty)") + (" ✓" if right else "")

    before, after = accuracy(answers["before"]), accuracy(answers["after"])
    style = {side: style_split(answers[side]) for side in ("before", "after")}
    n_samples = len(answers["before"][0]["responses"])
    lines = [f"Held-out exact-match accuracy, {len(answers['before'])} strings x {n_samples} sampled answers: "
             f"{before:.3f} before (SFT), {after:.3f} after {algorithm.upper()} ({after - before:+.3f}).", "",
             "Answers in the style the checker accepts (not \"Reversed: ...\"): "
             f"{style['before']['checked_style']:.3f} before, {style['after']['checked_style']:.3f} after; "
             f"right among those: {style['before']['right_in_style']:.3f} before, "
             f"{style['after']['right_in_style']:.3f} after.", "",
             f"| prompt | answer | before (SFT) | after {algorithm.upper()} |", "|---|---|---|---|"]
    for b, a in zip(answers["before"][:N_SHOWN], answers["after"][:N_SHOWN]):
        lines.append(f"| {b['prompt']} | {b['answer']} | {cell(b['responses'][0], b['right'][0])} "
                     f"| {cell(a['responses'][0], a['right'][0])} |")
    path.write_text("\n".join(lines) + "\n")
    return path


def plot_accuracy(metrics: list[dict[str, Any]], held_out: dict[str, float], out_png: Path, title: str) -> Path:
    """Training-batch accuracy (the mean reward) and KL per iteration, the held-out figures as lines."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    its = [m["iteration"] for m in metrics]
    fig = Figure(figsize=(9, 3.2), layout="constrained")
    ax, ax_kl = fig.subplots(1, 2)
    ax.plot(its, [m["score_mean"] for m in metrics], marker=".", label="training batch (reward)")
    ax.axhline(held_out["before"], color="grey", linestyle="--", label=f"held-out before {held_out['before']:.2f}")
    ax.axhline(held_out["after"], color="green", linestyle="--", label=f"held-out after {held_out['after']:.2f}")
    ax.set(title=f"{title}: exact-match accuracy", xlabel="iteration", ylim=(0, 1))
    ax.legend(fontsize=8)
    ax_kl.plot(its, [m["kl_mean"] for m in metrics], marker=".", color="tab:red")
    ax_kl.set(title="KL to the SFT model (nats / response)", xlabel="iteration")
    fig.savefig(out_png, dpi=110)
    return out_png


def run_verifiable_demo(out: str | Path, algorithm: str, fast: bool = False, overwrite: bool = False,
                        seed: int = 0, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run the verifiable-task demo into ``out``; returns the metrics, held-out accuracy and paths."""
    from homerlhf.models.registry import resolve_model
    from homerlhf.ppo.metrics import read_metrics
    from homerlhf.stages.ppo import prepare_run_dir, run_ppo

    out = Path(out)
    prepare_run_dir(out, overwrite)
    cfg = verifiable_demo_config(out, algorithm, fast, seed, overrides)
    started = time.perf_counter()
    _log("1/3 tiny Llama + a short SFT on the digit-reversal task (built once, then cached)")
    resolve_model(cfg.model.name_or_path)
    per_iteration = (f"{cfg.rollout.batch_size // cfg.group.size} strings x {cfg.group.size} answers"
                     if algorithm != "ppo" else f"{cfg.rollout.batch_size} strings")
    _log(f"2/3 {algorithm.upper()}: {cfg.ppo.iterations} iterations of {per_iteration}; "
         "reward = the task's checker (exact match)")
    result = run_ppo(cfg, out_dir=out, overwrite=True)
    metrics = read_metrics(out)
    if not metrics:
        raise UserError(f"{algorithm} wrote no metrics to {out}/metrics.jsonl; see the messages above")
    _log("3/3 held-out accuracy before/after")
    answers = evaluate(cfg, result["checkpoint"])
    held_out = {"before": accuracy(answers["before"]), "after": accuracy(answers["after"])}
    style = {side: style_split(answers[side]) for side in ("before", "after")}
    curve = plot_accuracy(metrics, held_out, out / "accuracy_curve.png", algorithm.upper())
    samples = write_before_after(answers, algorithm, out / "before_after.md")
    (out / "before_after.jsonl").write_text("".join(
        json.dumps({"prompt": b["prompt"], "answer": b["answer"], "before": b["responses"], "after": a["responses"]}) + "\n"
        for b, a in zip(answers["before"], answers["after"])))
    gain = held_out["after"] - held_out["before"]
    verdict = (f"{'Improved' if gain >= MARGIN else 'Not improved'}: held-out accuracy "
               f"{held_out['before']:.3f} -> {held_out['after']:.3f} ({gain:+.3f}; the bar is +{MARGIN:.2f}), "
               f"final KL {metrics[-1]['kl_mean']:.2f} nats per response")
    summary = {"algorithm": algorithm, "seed": seed, "fast": fast, "held_out_accuracy": held_out,
               "held_out_style": style, "final_kl": metrics[-1]["kl_mean"], "seconds": round(time.perf_counter() - started, 1),
               "verdict": verdict}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{verdict}\nplot: {curve}   samples: {samples}   metrics: {out / 'metrics.jsonl'}   "
          f"took {summary['seconds']:.0f} s")
    return {"metrics": metrics, "accuracy": held_out, "style": style, "improved": gain >= MARGIN, "curve": curve,
            "samples": samples, "run_dir": out}
