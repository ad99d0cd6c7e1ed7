"""Does RL with the GPU presets' learning settings move a real checkpoint? (a benchmark, not a test)

    python benchmarks/real_learning.py [--model builtin:gemma3-270m | HF_DIR] [--algorithms ppo,grpo,dpo]
        [--lr-scales 1,10] [--seeds 0] [--iterations 12] [--prompts 16] [--group 4] [--new-tokens 40]
        [--eval-every 4] [--eval-samples 2] [--preset 4090] [--threads 2] [--out runs/real_learning]
        [--set KEY=VALUE ...]

The task: real questions, "What is the capital of Kenya?", with a reward a person can read: 1 when the
answer names the country's capital (the city's name anywhere in it, any case), else 0
(``reward.function: builtin:capitals``, :mod:`homerlhf.data.builtin_capitals`; 0.3 for an answer in the
question's form with another city). 48 countries train, 16 others are
held out; the held-out score is the same reward on ``--eval-samples`` sampled answers (temperature 1,
the policy RL optimises, the same per-sample seeds for every checkpoint) per held-out country.

Each run goes through the product's own command (``homerlhf train`` / ``homerlhf dpo`` in a process of
its own) on ``--preset`` (default the 4090's) with its learning block as it ships: ``actor.lr``,
``critic.lr``, LoRA, ``kl_coef`` and its adaptive target, ``early_stop_kl``, clip ranges, epochs,
whitening, and DPO's defaults (the preset has no ``dpo`` section). Only what a CPU needs changes:
``card.device=cpu``, fp32 compute, the reference as the base with the adapter off (the same weights
the llama.cpp reference would hold), the hf sampler, and CPU-sized shapes with the preset's ratios:
``--prompts`` responses an iteration in mini-batches of a quarter of them (the 4090's 64 in 16s),
GRPO in groups of ``--group`` (16 = 4 prompts x 4). ``--lr-scales`` multiplies ``actor.lr`` (the
critic keeps the preset's). ``--model`` any HF model directory (its tokenizer must carry a chat
template); the default is the Gemma-3-270M base checkpoint of the package index (``builtin:gemma3-270m``).

Per iteration it prints: the training reward (``score_mean``), the held-out score (at iteration 0
and every ``--eval-every``), the KL to the reference (nats per response), entropy, response length,
the critic's explained variance (PPO), and the KL-jump flag; then a side-by-side table: per run the
settings, held-out before -> after, the first evaluated iteration with a held-out gain, KL at the
end and seconds per iteration on this machine; a run whose command stopped with an error stays in the
tables, marked stopped, with its last line. Everything it measured goes to ``OUT/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from homerlhf.data.builtin_capitals import N_HELD_OUT, preference_records, prompt_records  # noqa: E402


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cpu_overrides(args, model: str, data: Path) -> list[str]:
    """What a CPU needs on top of the GPU preset, and the benchmark's task: the learning block is untouched."""
    mini = max(1, args.prompts // 4)
    return [
        "card.name=CPU", "card.device=cpu", "card.gpu_gib=0", "quant.compute_dtype=fp32",
        f"model.name_or_path={model}", f"data.prompts={data}",
        "reward.backend=function", "reward.function=builtin:capitals",
        "ref.backend=adapter_off", "rollout.engine=hf",
        f"rollout.batch_size={args.prompts}", f"rollout.chunk_size={args.prompts}",
        f"rollout.generation_chunk={args.prompts}", "rollout.max_prompt_len=64",
        f"rollout.max_new_tokens={args.new_tokens}",
        f"ppo.iterations={args.iterations}", f"ppo.mini_batch_size={mini}", f"ppo.micro_batch_size={mini}",
        "training.gradient_checkpointing=false", "training.checkpoint_every_n_layers=1",
        "training.activation_offload=false",
        f"checkpoint.every={args.eval_every}", "checkpoint.keep=1000",
        "logging.progress=false", "logging.samples_per_iteration=2", "logging.tensorboard=false",
        # The no-op guard's streak (guards.flat_reward_iterations) is sized for the presets' 64 responses an
        # iteration; of 8 answers of a base that names 3% of capitals, all 8 scoring 0 is the likely case
        # (0.97^8 = 0.78), so here it warns (in the run's log) and the run goes on.
        "guards.action=warn",
    ]


def homerlhf(args_list: list[str], log: Path, threads: int) -> tuple[float, str | None]:
    """``homerlhf ARGS`` in its own process (this checkout's package), output to ``log``: the seconds taken,
    and None, or why it stopped (its exit code and last line) when it failed: the run stays in the tables."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    started = time.perf_counter()
    with log.open("w") as fh:
        done = subprocess.run([sys.executable, "-c", "from homerlhf.cli import main; main()", *args_list],
                              stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=log.parent)
    seconds = time.perf_counter() - started
    if done.returncode:
        tail = [line for line in log.read_text().splitlines() if line.strip()][-1:] or [""]
        return seconds, f"exit {done.returncode}: {tail[0][:300]} ({log})"
    return seconds, None


class HeldOut:
    """The held-out score of the base (adapter off) and of each checkpoint's actor adapter, one model loaded."""

    def __init__(self, model: str, preset: str, args):
        from homerlhf.config import load_config
        from homerlhf.stages.held_out_score import HeldOutScore

        data = write_jsonl(Path(args.out) / "held_out.jsonl", prompt_records(held_out=True))
        # the actor alone samples: no critic loaded (algorithm grpo), and no critic.* setting of --set
        sets = [s for s in args.set if not s.startswith("critic.")]
        overrides = cpu_overrides(args, model, data) + ["algorithm=grpo", "group.size=2", *sets]
        self.scorer = HeldOutScore(load_config(preset, overrides=overrides), str(data), "builtin:capitals",
                                   samples=args.eval_samples)

    def score(self, checkpoint: Path | None, seed: int) -> dict:
        result = self.scorer.score(checkpoint, seed)
        return {"score": result["score"], "named": result["full"], "example": result["answers"][0]["response"][:160]}


def shipped_actor_lr(cfg, model: str) -> float:
    """The preset's ``actor.lr`` for ``model``: its number, or what ``auto`` takes for the model's size."""
    if cfg.actor.lr != "auto":
        return cfg.actor.lr
    from homerlhf.config.learning_rates import auto_actor_lr
    from homerlhf.memory.shapes import resolve_shape

    return auto_actor_lr(resolve_shape(model).total_params)


def run_rl(args, algorithm: str, scale: float, seed: int, model: str, train: Path, held: HeldOut, base: dict) -> dict:
    from homerlhf.config import load_config

    name = f"{algorithm}-lr{scale:g}x{args.label and '-' + args.label}-seed{seed}"
    run_dir = Path(args.out) / name
    preset_cfg = load_config(args.preset)
    lr = shipped_actor_lr(preset_cfg, model) * scale
    sets = cpu_overrides(args, model, train) + [f"algorithm={algorithm}", f"actor.lr={lr:g}", f"seed={seed}"]
    if algorithm != "ppo":
        sets.append(f"group.size={args.group}")
    sets += list(args.set)
    cmd = ["train", "--preset", args.preset, "--out", str(run_dir), "--overwrite"]
    cmd += [x for s in sets for x in ("--set", s)]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    seconds, failed = homerlhf(cmd, Path(args.out) / f"{name}.log", args.threads)  # a failed run keeps what it wrote
    log_file = run_dir / "metrics.jsonl"
    metrics = ([json.loads(line) for line in log_file.read_text().splitlines() if line.strip()]
               if log_file.is_file() else [])
    evals = {0: base}
    for ckpt in sorted((run_dir / "checkpoints").glob("iter_*")):
        evals[int(ckpt.name.split("_")[1])] = held.score(ckpt, seed)
    return {"name": name, "algorithm": algorithm, "lr_scale": scale, "actor_lr": lr, "seed": seed,
            "seconds": seconds, "metrics": metrics, "held_out": evals, "label": args.label, "failed": failed,
            "settings": learning_block(preset_cfg, algorithm, args)}


def run_dpo(args, scale: float, seed: int, model: str, train_rows: list[dict], held: HeldOut, base: dict) -> dict:
    from homerlhf.config import load_config

    name = f"dpo-lr{scale:g}x{args.label and '-' + args.label}-seed{seed}"
    run_dir = Path(args.out) / name
    pairs = write_jsonl(Path(args.out) / "dpo_pairs.jsonl", preference_records())
    preset_cfg = load_config(args.preset)
    lr = preset_cfg.dpo.lr * scale
    sets = ["card.name=CPU", "card.device=cpu", "card.gpu_gib=0", "quant.compute_dtype=fp32",
            f"dpo.lr={lr:g}", f"seed={seed}", "dpo.max_len=96", "data.eval_fraction=0.1",
            "training.gradient_checkpointing=false", "training.checkpoint_every_n_layers=1",
            "training.activation_offload=false", *args.set]
    cmd = ["dpo", "--preset", args.preset, "--model", model, "--data", str(pairs), "--out", str(run_dir), "--overwrite"]
    cmd += [x for s in sets for x in ("--set", s)]
    seconds, failed = homerlhf(cmd, Path(args.out) / f"{name}.log", args.threads)
    summary_file = run_dir / "preference_run.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    ckpts = sorted((run_dir / "checkpoints").glob("iter_*"))
    evals = {0: base}
    if ckpts:
        evals[summary.get("steps", len(ckpts))] = held.score(ckpts[-1], seed)
    return {"name": name, "algorithm": "dpo", "lr_scale": scale, "actor_lr": lr, "seed": seed, "seconds": seconds,
            "metrics": [], "held_out": evals, "summary": summary, "label": args.label, "failed": failed,
            "settings": f"dpo.lr {lr:g}, beta {preset_cfg.dpo.beta:g}, batch {preset_cfg.dpo.batch_size}x{preset_cfg.dpo.grad_accum}, "
                        f"{preset_cfg.dpo.epochs:g} epoch"}


def learning_block(cfg, algorithm: str, args) -> str:
    p = cfg.ppo
    kl = f"kl {p.kl_coef:g}" + (f" adaptive to {p.target_kl:g}" if p.adaptive_kl else "")
    group = f", group {args.group}" if algorithm != "ppo" else f", critic lr {cfg.critic.lr:g}"
    extra = "".join(f", {s}" for s in args.set if not s.startswith("quant."))  # what --set changed, but the base's dtype
    return (f"{kl}, early stop {p.early_stop_kl}, clip {p.clip_range:g}, {p.epochs} epoch, batch {args.prompts} in "
            f"{max(1, args.prompts // 4)}s{group}{extra}")


def print_run(result: dict) -> None:
    print(f"\n== {result['name']}: actor.lr {result['actor_lr']:g}; {result['settings']}; {result['seconds']:.0f} s", flush=True)
    if result["metrics"]:
        print(f"{'it':>3} {'reward':>7} {'held-out':>8} {'KL':>7} {'entropy':>7} {'length':>6} {'expl.var':>8} {'flag':>4}")
    for m in result["metrics"]:
        it = m["iteration"]
        held = result["held_out"].get(it)
        ev = m.get("explained_variance")
        print(f"{it:>3} {m['score_mean']:>7.3f} {'' if held is None else format(held['score'], '.3f'):>8} "
              f"{m['kl_mean']:>7.3f} {m['entropy']:>7.3f} {m['response_length_mean']:>6.1f} "
              f"{'' if ev is None else format(ev, '.3f'):>8} {int(m.get('kl_flag', 0)):>4}", flush=True)
    if result.get("failed"):
        print(f"   STOPPED: {result['failed']}", flush=True)
    for it, held in result["held_out"].items():
        named = f" ({held['named']:.3f} name the capital)" if "named" in held else ""
        print(f"   held-out at {it}: {held['score']:.3f}{named}   e.g. {held['example']!r}", flush=True)


def summary_rows(results: list[dict]) -> list[str]:
    lines = ["| run | actor lr | settings | held-out before -> after | first gain at | KL end | max KL jump | s / iteration |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        held = r["held_out"]
        its = sorted(held)
        before, after = held[its[0]]["score"], held[its[-1]]["score"]
        gain = next((it for it in its[1:] if held[it]["score"] > before), None)
        ms = r["metrics"]
        kl_end = f"{ms[-1]['kl_mean']:.3f}" if ms else "-"
        jump = f"{max((m.get('kl_jump') or 0.0) for m in ms):.3f}" if ms else "-"
        per_it = f"{sum(m['time_iteration_s'] for m in ms) / len(ms):.1f}" if ms else f"{r['seconds']:.0f} (whole run)"
        name = r["name"] + (f" (stopped at iteration {len(ms)})" if r.get("failed") else "")
        lines.append(f"| {name} | {r['actor_lr']:g} | {r['settings']} | {before:.3f} -> {after:.3f} "
                     f"({after - before:+.3f}) | {'-' if gain is None else gain} | {kl_end} | {jump} | {per_it} |")
    return lines


def spread_rows(results: list[dict]) -> list[str]:
    """Per algorithm, learning rate and label, over its seeds: the held-out gain's mean and sample
    standard deviation, the share of held-out answers naming the capital before and after, the final
    KL, and (PPO) the critic's explained variance over the first and the last 4 iterations."""
    import statistics

    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["algorithm"] + (f" ({r['label']})" if r.get("label") else ""), r["actor_lr"]),
                          []).append(r)
    lines = ["| algorithm | actor lr | seeds | held-out gain, mean +- sd (each seed) | naming the capital, before -> after "
             "(mean) | KL end, mean (max) | KL flags | critic explained variance, its 1-4 -> last 4 (mean) |",
             "|---|---|---|---|---|---|---|---|"]
    for (algorithm, lr), runs in groups.items():
        gains, named0, named1, kls, flags = [], [], [], [], 0
        stopped = sum(1 for r in runs if r.get("failed"))
        evs = [m.get("explained_variance") for r in runs for m in r["metrics"]]
        ev = "-"
        if any(v is not None for v in evs):
            early = [m["explained_variance"] for r in runs for m in r["metrics"][:4]]
            late = [m["explained_variance"] for r in runs for m in r["metrics"][-4:]]
            ev = f"{statistics.mean(early):.2f} -> {statistics.mean(late):.2f}"
        for r in runs:
            its = sorted(r["held_out"])
            first, last = r["held_out"][its[0]], r["held_out"][its[-1]]
            gains.append(last["score"] - first["score"])
            named0.append(first.get("named", 0.0))
            named1.append(last.get("named", 0.0))
            if r["metrics"]:
                kls.append(r["metrics"][-1]["kl_mean"])
                flags += sum(int(m.get("kl_flag", 0)) for m in r["metrics"])
        sd = statistics.stdev(gains) if len(gains) > 1 else 0.0
        kl = f"{statistics.mean(kls):.2f} ({max(kls):.2f})" if kls else "-"
        lines.append(f"| {algorithm} | {lr:g} | {len(runs)} | {statistics.mean(gains):+.3f} +- {sd:.3f} "
                     f"({', '.join(f'{g:+.3f}' for g in gains)}) | {statistics.mean(named0):.3f} -> "
                     f"{statistics.mean(named1):.3f} | {kl} | {flags}{f', {stopped} stopped' if stopped else ''} | {ev} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:gemma3-270m")
    ap.add_argument("--algorithms", default="ppo,grpo,dpo")
    ap.add_argument("--lr-scales", default="1", help="multiples of the preset's actor.lr (the sweep: 0.3,1,3,10,30)")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=16, help="responses per iteration")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--eval-samples", type=int, default=2)
    ap.add_argument("--preset", default="4090")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--out", default="runs/real_learning")
    ap.add_argument("--set", action="append", default=[], help="another override for every run")
    ap.add_argument("--label", default="", help="a name for what --set changed: in the run names and tables")
    ap.add_argument("--report", metavar="RESULTS_JSON", nargs="+",
                    help="print the tables of earlier runs' results.json files (together) and stop")
    args = ap.parse_args()
    if args.report:
        results = [r for path in args.report for r in json.loads(Path(path).read_text())]
        for r in results:  # JSON keys are strings
            r["held_out"] = {int(k): v for k, v in r["held_out"].items()}
        print("\n".join(summary_rows(results)) + "\n\n" + "\n".join(spread_rows(results)))
        return

    import torch

    torch.set_num_threads(args.threads)
    from homerlhf.models.registry import resolve_model
    import homerlhf.stages  # noqa: F401  (registers the builtin models)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_model(args.model)
    train_rows = prompt_records()
    train = write_jsonl(out / "train.jsonl", train_rows)
    print(f"model {args.model} ({model}); {len(train_rows)} training prompts, {N_HELD_OUT} held out; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs, "
          f"load {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    held = HeldOut(model, args.preset, args)
    results, bases = [], {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        bases[seed] = held.score(None, seed)
        print(f"held-out score of the base (seed {seed}): {bases[seed]['score']:.3f}, e.g. {bases[seed]['example']!r}",
              flush=True)
        for scale in [float(s) for s in args.lr_scales.split(",")]:
            for algorithm in args.algorithms.split(","):
                if algorithm == "dpo":
                    result = run_dpo(args, scale, seed, model, train_rows, held, bases[seed])
                else:
                    result = run_rl(args, algorithm, scale, seed, model, train, held, bases[seed])
                print_run(result)
                results.append(result)
                (out / "results.json").write_text(json.dumps(results, indent=1))
    print("\n" + "\n".join(summary_rows(results)))
    print("\n" + "\n".join(spread_rows(results)))


if __name__ == "__main__":
    main()
