#!/usr/bin/env python3
"""The check a GPU session runs first: homerlhf's GPU code paths, each run and measured, in one command.

    python3 scripts/gpu_check.py                # every case below: about 4.5 minutes on one H200 (estimate)
    python3 scripts/gpu_check.py --largest      # instead: the largest table model the planner fits in 24 GiB
    python3 scripts/gpu_check.py --cpu-smoke    # every case's code path on the CPU with tiny models (CI)

(``bash scripts/gpu_session.sh check`` runs it under ``timeout -k 15 300``.) Models are random
weights of published shapes (the planner's builtin table), built on the GPU and saved with the tiny
tokenizer into ``.gpu-models`` of this checkout (or ``$HOMERLHF_GPU_MODELS``; a disk, and kept for
the next command): nothing is downloaded. The process is capped at each preset's card
(``set_per_process_memory_fraction``: 24 GiB for 4090, 15 GiB for t4-colab; a card that reports a
little less, as a 4090's 23.99 GiB, is capped at its whole memory). The reference is the policy's
base with its adapters off and the reward an in-process function (no llama.cpp anywhere).

The cases, the 7B first, then the others from the quickest to the slowest (a run cut short by its
timeout loses the fewest; what ran is in the JSON, written after every case). Each one's H200
estimate (``Case.estimate_s``, in the JSON beside its wall time) is an upper bound from the H200
figures in DESIGN.md and docs/time.md, priced as HF ``generate`` (84 ms a decode step of a 28-layer
model, NF4 + LoRA; the captured loop a GPU run samples with should be faster: unmeasured), scoring
at 16,000 and the update at 4,350 tokens/s for the 7B, ~6 s of scoring + update for 8 rows of the
1.5B (its runs' 3 + 9 s for 16 rows), a 7B built in 30 s and loaded in 5, a 1.5B in 6 and 2:

- ``ppo-7b`` (95 s; 30 s build): PPO, 4090 preset, Qwen2.5-7B, the preset's 512+256 tokens, chunk 16,
  micro 4, one chunk of 16 prompts, 2 iterations (peaks are read from the last: the first runs
  before the optimizer states exist): 5 + 2 x (256 x 84 ms + 2.3 + 5.6);
- ``rloo-1.5b`` (14 s; the first 1.5B case builds it: 6 s) and ``grpo-1.5b`` (14 s): RLOO and GRPO
  (groups of 4), 1 iteration each, Qwen2.5-1.5B, 8 prompts of 256 + 64 tokens: 2 + 64 x 84 ms + 6;
- ``grpo-1.5b-upcast`` (14 s): that GRPO run with ``quant.upcast_non_quantized=true`` (fp32
  embeddings, LM head, norms, hidden states and KV cache, as the H200 calibration ran), beside the
  bf16 end to end of ``grpo-1.5b``;
- ``reward-adapter-1.5b`` (20 s): ``reward.backend=adapter``, a reward LoRA + score head on the
  policy's base (its build ~5 s), 1 iteration;
- ``resume-1.5b`` (22 s): an iteration of 32 new tokens, a checkpoint written on the GPU, a new
  trainer resumed from it (weights, optimizer states, counters and RNG equal to the saved ones), the
  next iteration;
- ``ppo-fp16-1.5b`` (24 s): the fp16 compute path of t4-colab (its GradScaler), 2 iterations of two
  optimizer steps each (8 prompts, mini-batches of 4); it fails when the scaler skipped every step
  (the JSON counts the steps taken and skipped): 95 ms a decode step (the H200's fp16 1.5B run);
- ``cli-1.5b`` (30 s): ``homerlhf train`` in a subprocess on the builtin prompts (with llama_cpp,
  gradio, datasets, trl and matplotlib made absent: the GPU machine lacks some of them), one
  iteration, then ``train --resume`` for the next: two interpreters' start (~10 s each) + 2 x 5 s.

With this process's start (~10 s) and the builds (4 s a billion parameters): 10 + 37 + 233 = 280 s
(``estimate_h200_s`` in the JSON). In the CPU smoke the ``cli`` case's run decides its placement as
the GPU machine does (CUDA reported to the decision, the 4090 card): it must start no worker and
export nothing (llama_cpp is absent), and its placement line is in the JSON.

It prints one line per case (``ok`` with its figures, or ``FAIL`` and the error's last line), never
stops at a failed case, and writes JSON (``--out``; default ``$OUT/gpu_check.json``, else
``./gpu_check.json``): per case the exact settings, the planner's allocated GiB per phase beside the
measured peaks (``PhaseMeter``), the most memory reserved, every iteration's metrics row (seconds per
phase, tokens/s), the optimizer steps taken and skipped, and the device, torch, transformers, peft
and bitsandbytes versions; while a case runs, ``running`` names it. Without CUDA (and without
``--cpu-smoke``) it exits with one line saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's homerlhf, whatever else is installed
from gpu_check_cli import cli_case, without_absent_packages  # noqa: E402 - scripts/, beside this file
from gpu_runs import (ROOT, build_random_checkpoint, build_reward_adapter, cap_memory, checkpoint_dir,  # noqa: E402
                      differences, environment, measured_iterations, optimizer_steps, random_prompts, release_memory,
                      snapshot)

REWARD_FN = '''def reward(response_ids):
    """Share of even ids: spread over the samples of random weights (a GRPO group needs some)."""
    return sum(1 for t in response_ids if t % 2 == 0) / max(len(response_ids), 1)
'''
COMMON = ("ref.backend=adapter_off", "reward.backend=function", "reward.function={reward_fn}:reward",
          "logging.tensorboard=false", "logging.progress=false")
SEVEN_B = ("rollout.batch_size=16", "ppo.mini_batch_size=16")  # the 4090 preset's chunk, lengths and micro-batch
SMALL = ("rollout.batch_size=8", "rollout.chunk_size=8", "rollout.max_prompt_len=256", "rollout.max_new_tokens=64",
         "ppo.mini_batch_size=8")
# rollout.decoder=static: the loop a GPU run samples with (``auto`` there), eager on the CPU.
SMOKE = ("card.device=cpu", "quant.compute_dtype=fp32", "rollout.batch_size=4", "rollout.chunk_size=2",
         "rollout.max_prompt_len=16", "rollout.max_new_tokens=3", "ppo.mini_batch_size=4", "ppo.micro_batch_size=2",
         "rollout.decoder=static")
# The CPU smoke's model: the case's architecture (type, tied embeddings, biases) at a tiny size.
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16)
TIME_KEYS = ("time_generation_s", "time_scoring_s", "time_reference_reward_wait_s", "time_advantages_s",
             "time_update_s", "time_iteration_s")
START_S = 10  # this process's start on the GPU machine (imports), estimated
BUILD_S_PER_B = 4.0  # building and saving a random checkpoint, per billion parameters (a 7B in ~30 s on an H200)


@dataclass(frozen=True)
class Case:
    name: str
    preset: str
    model: str  # a name of the planner's table: its published shape (the CPU smoke builds a tiny one)
    overrides: tuple[str, ...]  # over the preset and COMMON; {placeholders} are the run's files
    iterations: int
    estimate_s: int  # on an H200, the model's build aside (BUILD_S_PER_B): the module docstring's arithmetic
    kind: str = "train"  # train | resume | cli
    keep: tuple[str, ...] = ()  # overrides that hold in the CPU smoke too (after SMOKE)


def cases() -> list[Case]:
    """Every case: the 7B first (the figure a session is for), then the rest from the quickest to the
    slowest. A new case goes anywhere in ``rest`` with its estimate."""
    small = "Qwen/Qwen2.5-1.5B"
    rest = [
        Case("grpo-1.5b", "4090", small, SMALL + ("algorithm=grpo", "ppo.group_size=4"), 1, 14),
        # The GRPO run with the fp32 upcast of the H200 calibration: both dtype settings measured side by side.
        Case("grpo-1.5b-upcast", "4090", small, SMALL + ("algorithm=grpo", "ppo.group_size=4",
                                                          "quant.upcast_non_quantized=true"), 1, 14),
        Case("rloo-1.5b", "4090", small, SMALL + ("algorithm=rloo", "ppo.group_size=4"), 1, 14),
        # Two optimizer steps an iteration (mini-batches of 4 of 8 rows; the smoke's of 2 of 4): the scaler steps.
        Case("ppo-fp16-1.5b", "t4-colab", small, SMALL + ("ppo.mini_batch_size=4",), 2, 24,
             keep=("quant.compute_dtype=fp16", "ppo.mini_batch_size=2")),
        Case("reward-adapter-1.5b", "4090", small, SMALL + ("reward.backend=adapter", "reward.model={reward_adapter}",
                                                           "reward.function=null"), 1, 20),
        Case("resume-1.5b", "4090", small, SMALL + ("rollout.max_new_tokens=32",), 1, 22, kind="resume"),
        Case("cli-1.5b", "4090", small, ("rollout.batch_size=4", "rollout.chunk_size=4", "rollout.max_new_tokens=32",
                                         "ppo.mini_batch_size=4", "ppo.micro_batch_size=2", "data.prompts=builtin:demo"),
             1, 30, kind="cli", keep=("rollout.max_prompt_len=64",)),
    ]
    return [Case("ppo-7b", "4090", "Qwen/Qwen2.5-7B", SEVEN_B, 2, 95)] + sorted(rest, key=lambda c: c.estimate_s)


def estimated_seconds(todo: list[Case]) -> int:
    """The H200 estimate of running ``todo``: this process's start, each model's build once, each case."""
    from homerlhf.memory.shapes import builtin_shape

    builds = sum(BUILD_S_PER_B * builtin_shape(m).total_params / 1e9 for m in {c.model for c in todo})
    return round(START_S + builds + sum(c.estimate_s for c in todo))


@dataclass
class Run:
    """This invocation: its mode, scratch dir, the models built so far and the files cases name."""

    smoke: bool
    tmp: Path
    models: dict[str, Path] = field(default_factory=dict)
    files: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.files = {"reward_fn": str(self.tmp / "rewards.py"), "reward_adapter": str(self.tmp / "reward-adapter")}

    @property
    def device(self) -> str:
        return "cpu" if self.smoke else "cuda"

    def iterations(self, case: Case) -> int:
        return 1 if self.smoke else case.iterations

    def overrides(self, case: Case) -> list[str]:
        listed = COMMON + case.overrides + (SMOKE if self.smoke else ()) + case.keep
        return [o.format(**self.files) for o in listed]

    def model_dir(self, name: str, build: bool = True) -> Path:
        """``name``'s random checkpoint (its architecture at a tiny size in the CPU smoke; on a GPU in
        ``gpu_runs.models_dir()``), built once (``build`` False: only where it is or will be)."""
        from dataclasses import replace

        from homerlhf.memory.shapes import builtin_shape

        shape = replace(builtin_shape(name), **TINY) if self.smoke else builtin_shape(name)
        path = checkpoint_dir(shape, self.tmp / name.replace("/", "--"), device=self.device)
        if build and name not in self.models:
            if not self.smoke:
                cap_memory(None)  # a card's cap from the case before must not stop the build
            self.models[name] = build_random_checkpoint(shape, path, device=self.device)
        return path


# -- what the cases read ----------------------------------------------------------------------------
def write_files(run: Run) -> None:
    """The reward function's file."""
    Path(run.files["reward_fn"]).write_text(REWARD_FN)


# -- running a case -----------------------------------------------------------------------------------
def new_trainer(cfg, model_dir: Path, run_dir):
    """The case's policy (NF4), reference and reward as the PPO stage builds them, and its trainer."""
    from homerlhf.models.policy import PolicyModel
    from homerlhf.ppo.trainer import PPOTrainer
    from homerlhf.stages.scorers import build_reference, build_reward

    policy = PolicyModel.from_config(cfg, str(model_dir))
    reference = build_reference(cfg, policy, str(model_dir), run_dir)
    reward = build_reward(cfg, policy.tokenizer, run_dir, policy)
    prompts = random_prompts(policy.tokenizer, cfg.rollout.batch_size, cfg.rollout.max_prompt_len)
    return PPOTrainer(cfg, policy, reference, reward, prompts, run_dir)


def close(trainer) -> None:
    trainer.reward.close()
    trainer.reference.close()
    trainer.meter.close()
    if trainer.writer is not None:
        trainer.writer.close()


def train_case(case: Case, cfg, model_dir: Path, run: Run) -> dict:
    trainer = new_trainer(cfg, model_dir, None)
    try:
        return measured_iterations(trainer, run.iterations(case))
    finally:
        close(trainer)


def resume_case(case: Case, cfg, model_dir: Path, run: Run) -> dict:
    """An iteration and a checkpoint; a new trainer resumed from it must hold the same state, then run on."""
    run_dir = run.tmp / case.name
    trainer = new_trainer(cfg, model_dir, run_dir)
    try:
        measured_iterations(trainer, run.iterations(case))
        ckpt, saved = trainer.checkpoint(), snapshot(trainer)
    finally:
        close(trainer)
    del trainer
    release_memory()
    trainer = new_trainer(cfg, model_dir, run_dir)
    try:
        trainer.resume(ckpt)
        differ = differences(saved, snapshot(trainer))
        if differ:
            raise AssertionError(f"the resumed state differs from the saved one in {len(differ)} entries: "
                                 f"{', '.join(differ[:4])}")
        result = measured_iterations(trainer, 1)
    finally:
        close(trainer)
    result.update(resumed_from=Path(ckpt).name, state_equal=True, state_entries=len(saved))
    return result


def run_case(case: Case, run: Run) -> dict:
    """One case: settings, the plan, the run and its figures (see the module docstring)."""
    from homerlhf.config import load_config
    from homerlhf.memory.planner import compare, plan
    from homerlhf.memory.shapes import resolve_shape

    started = time.perf_counter()
    overrides = run.overrides(case)
    model_dir = run.model_dir(case.model, build=False)
    cfg = load_config(case.preset, overrides=[f"model.name_or_path={model_dir}", *overrides])  # before any build
    run.model_dir(case.model)
    adapter = Path(run.files["reward_adapter"])
    if "{reward_adapter}" in " ".join(case.overrides) and not adapter.is_dir():
        build_reward_adapter(model_dir, adapter, run.device)
    cap = float(cfg.card.gpu_gib)
    planned = plan(cfg, resolve_shape(str(model_dir)), cap, with_suggestion=False)
    entry = {"case": case.name, "kind": case.kind, "preset": case.preset, "model": case.model, "cap_gib": cap,
             "estimate_s": case.estimate_s,
             "iterations": run.iterations(case), "overrides": overrides, "settings": planned.settings,
             "plan": {"status": planned.status, "phases": {p.name: {"allocated_gib": round(p.allocated_gib, 4),
                                                                    "total_gib": round(p.total_gib, 4)}
                                                           for p in planned.phases}}}
    if not run.smoke:
        cap_memory(cap)
        import torch

        torch.cuda.reset_peak_memory_stats()
    if case.kind == "cli":
        result = cli_case(case, [f"model.name_or_path={model_dir}", *overrides], cap, run)
    else:
        result = (resume_case if case.kind == "resume" else train_case)(case, cfg, model_dir, run)
    last = result["rows"][-1]
    entry["optimizer_steps"] = optimizer_steps(result["rows"])
    if cfg.quant.compute_dtype == "fp16" and not entry["optimizer_steps"]["taken"]:
        raise AssertionError(f"the fp16 loss scaler skipped all {entry['optimizer_steps']['steps']} optimizer "
                             f"steps (loss scale {entry['optimizer_steps']['loss_scale']}): no update was tested")
    entry.update(result, comparison=compare(planned, result["measured_gib"]),
                 seconds={k: last.get(k) for k in TIME_KEYS},
                 tokens_per_s={k: v for k, v in last.items() if k.startswith("tokens_per_s_")})
    entry["wall_s"] = round(time.perf_counter() - started, 1)
    return entry


# -- the report ----------------------------------------------------------------------------------------
def line(entry: dict) -> str:
    name = f"{entry['case']:<20} {entry['wall_s']:6.1f} s" + (f" (H200 est. {entry['estimate_s']} s)"
                                                             if "estimate_s" in entry else "")
    if "error" in entry:
        return f"FAIL {name}  {entry['error']}"
    unit = "GiB" if entry.get("max_reserved_gib") is not None or entry["kind"] == "cli" else "GiB (CPU RSS)"
    phases = ", ".join(f"{phase} {c['predicted_gib']:.2f}/{c['measured_gib']:.2f} ({c['error']:+.1%})"
                       for phase, c in entry["comparison"].items())
    s = entry["seconds"]
    parts = [f"{unit} planned/measured: {phases}"]
    if entry.get("max_reserved_gib") is not None:
        parts.append(f"reserved {entry['max_reserved_gib']:.2f}")
    parts.append(f"s/iteration {s['time_iteration_s']:.1f} (generation {s['time_generation_s']:.1f}, "
                 f"scoring {s['time_scoring_s']:.1f}, update {s['time_update_s']:.1f})")
    parts.append(f"{entry['tokens_per_s'].get('tokens_per_s_generation', 0):.0f} tokens/s generated"
                 + (f" ({entry['decoder']})" if entry.get("decoder") else ""))
    steps = entry["optimizer_steps"]
    parts.append(f"optimizer steps {steps['taken']} taken, {steps['skipped']} skipped"
                 + (f" (loss scale {steps['loss_scale']:g})" if steps.get("loss_scale") is not None else ""))
    if entry.get("placement"):
        parts.append(entry["placement"][0].removeprefix("[homerlhf] "))
    if entry["kind"] == "resume":
        parts.append(f"resumed from {entry['resumed_from']}: state equal ({entry['state_entries']} entries)")
    if entry["kind"] == "cli":
        parts.append(f"train + train --resume: {', '.join(entry['checkpoints'])}")
    return f"ok   {name}  " + "; ".join(parts)


def largest_case(run: Run) -> Case:
    """The table's largest model that the planner says fits 24 GiB at the 4090 preset's settings as
    ``ppo-7b`` runs them (one chunk of 16 prompts, 512+256 tokens, micro 4), or with the settings the
    plan suggests when they keep those lengths, for one iteration."""
    from homerlhf.config import load_config
    from homerlhf.memory.planner import plan
    from homerlhf.memory.shapes import builtin_shape, table_names

    fits, settings = [], [o.format(**run.files) for o in COMMON + SEVEN_B]  # the GPU's, in the CPU smoke too
    for name in table_names():
        planned = plan(load_config("4090", overrides=[f"model.name_or_path={name}", *settings]), builtin_shape(name),
                       24.0)
        extra = tuple(planned.suggestion.set_args) if planned.suggestion else ()
        if planned.fits or (extra and not any(a.startswith("rollout.max_") for a in extra)):
            fits.append((builtin_shape(name).total_params, name, () if planned.fits else extra))
    _, name, extra = max(fits)
    layers = builtin_shape(name).num_layers  # 3 ms a layer a decode step, 256 steps; the update by FLOPs
    return Case(f"largest-{name.split('/')[-1]}", "4090", name, SEVEN_B + extra, 1,
                round(10 + layers * 0.003 * 256 + 8 * builtin_shape(name).total_params / 7.6e9))


def guarded(case: Case, run: Run) -> dict:
    """:func:`run_case`, its failure a result (the error's last line, the traceback) rather than a stop."""
    from homerlhf.memory.oom import is_oom

    started = time.perf_counter()
    try:
        return run_case(case, run)
    except Exception as exc:  # noqa: BLE001 - one case's failure is a result; the next case still runs
        text = str(exc).strip().splitlines()
        return {"case": case.name, "kind": case.kind, "preset": case.preset, "model": case.model,
                "estimate_s": case.estimate_s, "overrides": run.overrides(case), "error": f"{'OOM' if is_oom(exc) else type(exc).__name__}: "
                f"{text[-1] if text else ''}", "traceback": traceback.format_exc(),
                "wall_s": round(time.perf_counter() - started, 1)}
    finally:
        release_memory()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--largest", action="store_true", help="Run instead the largest table model the planner fits "
                    "in 24 GiB at the 4090 preset's settings, one iteration.")
    ap.add_argument("--cpu-smoke", action="store_true", help="Every case's code path on the CPU: tiny models of each "
                    "case's architecture, 4 prompts of 16 tokens, 3 new tokens, fp32 (fp16 where the case is).")
    ap.add_argument("--only", default="", help="Comma-separated case names (default: every case).")
    ap.add_argument("--out", type=Path, default=None, help="JSON output (default: $OUT/gpu_check.json, else "
                    "./gpu_check.json).")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")  # nothing is downloaded
    without_absent_packages()
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("error: gpu_check.py needs a CUDA GPU and none is visible; run it on a machine with one "
              "(or pass --cpu-smoke to run its code paths on the CPU)", file=sys.stderr)
        return 2
    out = args.out or Path(os.environ.get("OUT") or ".") / "gpu_check.json"
    started = time.perf_counter()
    scratch = None if args.cpu_smoke else ROOT / ".gpu-scratch"  # run dirs and checkpoints: a disk, gitignored
    if scratch is not None:
        scratch.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="homerlhf-gpu-check-", dir=scratch) as tmp:
        run = Run(smoke=args.cpu_smoke, tmp=Path(tmp))
        write_files(run)
        todo = [largest_case(run)] if args.largest else cases()
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - {c.name for c in todo})
        if unknown:
            print(f"error: --only: no case {', '.join(unknown)} (cases: {', '.join(c.name for c in todo)})",
                  file=sys.stderr)
            return 2
        todo = [c for c in todo if not wanted or c.name in wanted]
        report = {**environment(run.smoke), "estimate_h200_s": estimated_seconds(todo), "cases": []}
        print(" ".join(f"{k} {v}" for k, v in report.items() if k != "cases"), flush=True)
        for case in todo:
            report["running"] = case.name
            out.write_text(json.dumps(report, indent=1))  # what ran survives a timeout or a crash
            report["cases"].append(guarded(case, run))
            report["wall_s"] = round(time.perf_counter() - started, 1)
            del report["running"]
            out.write_text(json.dumps(report, indent=1))
            print(line(report["cases"][-1]), flush=True)
    passed = sum("error" not in entry for entry in report["cases"])
    print(f"{passed}/{len(todo)} ok in {time.perf_counter() - started:.0f} s; wrote {out}")
    return 0 if passed == len(todo) else 1


if __name__ == "__main__":
    sys.exit(main())
