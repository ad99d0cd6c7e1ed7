#!/usr/bin/env python3
"""Predicted vs measured GPU memory per PPO phase, on real architectures with random weights.

For each model in ``--models`` (names from the planner's builtin table; nothing is downloaded):
build the architecture from its published shape with random bf16 weights directly on the GPU,
save it with a tiny tokenizer, free it, then cap this process at ``--cap-gib`` with
``torch.cuda.set_per_process_memory_fraction`` and run ``--iterations`` real PPO iterations with
homerlhf's own trainer (``PolicyModel`` in NF4 with actor/critic LoRA, rollout, scoring with the
adapter-off reference and an in-process reward, clipped update). Peaks per phase are
``torch.cuda.max_memory_allocated`` (``PhaseMeter``) of the last iteration, beside the planner's
predicted allocated bytes. Writes JSON to ``--out`` and prints a table.

    python3 scripts/validate_memory_gpu.py --cap-gib 24 --out memory_validation.json

Needs a CUDA GPU; on a machine without one it exits with one line saying so.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's homerlhf, whatever else is installed
from homerlhf.check.runs import (build_random_checkpoint, cap_memory, environment,  # noqa: E402
                                 measured_iterations, random_prompts, release_memory)

DEFAULT_MODELS = "Qwen/Qwen2.5-0.5B,meta-llama/Llama-3.2-1B,Qwen/Qwen2.5-1.5B,Qwen/Qwen2.5-3B"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cap-gib", type=float, default=24.0, help="Per-process GPU memory cap (GiB) and plan budget.")
    ap.add_argument("--models", default=DEFAULT_MODELS, help="Comma-separated builtin-table names.")
    ap.add_argument("--preset", default="4090", help="Preset whose settings are the starting point.")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    help="Dotted override (repeatable), e.g. --set rollout.max_new_tokens=256.")
    ap.add_argument("--chunk-size", type=int, default=8, help="rollout.chunk_size (prompts generated at once).")
    ap.add_argument("--prompt-len", type=int, default=256, help="rollout.max_prompt_len (prompts are this long).")
    ap.add_argument("--new-tokens", type=int, default=128, help="rollout.max_new_tokens.")
    ap.add_argument("--micro-batch", type=int, default=4, help="ppo.micro_batch_size.")
    ap.add_argument("--iterations", type=int, default=2, help="PPO iterations; the last one is reported "
                    "(the first runs before optimizer states exist).")
    ap.add_argument("--out", type=Path, default=Path("memory_validation.json"), help="JSON output.")
    return ap.parse_args(argv)


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def run_one(name: str, args, tmp: Path) -> dict:
    import torch

    from homerlhf.config import load_config
    from homerlhf.memory.oom import is_oom
    from homerlhf.memory.planner import compare, plan
    from homerlhf.memory.shapes import resolve_shape
    from homerlhf.models.policy import PolicyModel
    from homerlhf.ppo.backends import AdapterOffReference, Backends, CallableReward
    from homerlhf.ppo.trainer import RLTrainer

    shape = resolve_shape(name)
    started = time.perf_counter()
    model_dir = build_random_checkpoint(shape, tmp / name.replace("/", "--"), seed=0)
    chunk, micro = args.chunk_size, args.micro_batch
    overrides = [
        f"model.name_or_path={model_dir}",
        f"rollout.chunk_size={chunk}", f"rollout.batch_size={2 * chunk}", f"rollout.generation_chunk={chunk}",
        f"rollout.max_prompt_len={args.prompt_len}", f"rollout.max_new_tokens={args.new_tokens}",
        f"ppo.mini_batch_size={chunk}", f"ppo.micro_batch_size={micro}", "ppo.epochs=1",
        "ref.backend=adapter_off", "reward.backend=hf", "reward.model=in-process",
        "logging.tensorboard=false", "logging.progress=false", *args.overrides,
    ]
    cfg = load_config(args.preset, overrides=overrides)
    predicted = plan(cfg, shape, args.cap_gib)
    row = {"model": name, "params": shape.total_params, "settings": predicted.settings,
           "predicted_total_gib": {p.name: round(p.total_gib, 4) for p in predicted.phases},
           "predicted_allocated_gib": {p.name: round(p.allocated_gib, 4) for p in predicted.phases}}
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    policy = trainer = None
    try:
        policy = PolicyModel.from_config(cfg, str(model_dir))
        prompts = random_prompts(policy.tokenizer, 2 * chunk, args.prompt_len)  # the worst case the plan is for
        reward = CallableReward(lambda p, r: float(len(r)) / args.new_tokens)
        trainer = RLTrainer(cfg, policy, Backends(AdapterOffReference(policy), reward), prompts)
        run = measured_iterations(trainer, args.iterations)
        measured, metrics = run["measured_gib"], run["rows"][-1]
        row.update(
            measured_gib={k: round(v, 4) for k, v in measured.items()},
            comparison=compare(predicted, measured),
            micro_batch_size_end=metrics["micro_batch_size"],
            oom_retries=metrics["oom_retries"],
            max_reserved_gib=run["max_reserved_gib"],
        )
    except Exception as exc:  # noqa: BLE001 - an OOM (or a failure of one model) is a result, not a crash
        first = str(exc).splitlines()[0] if str(exc) else ""
        row["error"] = f"{'OOM' if is_oom(exc) else type(exc).__name__}: {first}"
    finally:
        del trainer, policy
        release_memory()
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        fail("validate_memory_gpu.py needs a CUDA GPU and none is visible; run it on a machine with one")
    try:
        cap_memory(args.cap_gib)
    except ValueError as exc:
        fail(f"--cap-gib: {exc}")
    from homerlhf.memory.shapes import builtin_shape

    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if builtin_shape(n) is None]
    if unknown:
        fail(f"--models: {', '.join(unknown)} not in the builtin table (see homerlhf/memory/shapes.py)")
    report = {**environment(), "cap_gib": args.cap_gib, "preset": args.preset, "runs": []}
    with tempfile.TemporaryDirectory(prefix="homerlhf-memval-") as tmp:
        for name in names:
            row = run_one(name, args, Path(tmp))
            report["runs"].append(row)
            args.out.write_text(json.dumps(report, indent=2))  # partial results survive a later crash
            print(_line(row), flush=True)
    print(f"wrote {args.out}")


def _line(row: dict) -> str:
    if "error" in row:
        return f"{row['model']}: {row['error']} (predicted {row['predicted_allocated_gib']})"
    parts = [f"{phase} {c['predicted_gib']:.2f}/{c['measured_gib']:.2f} GiB ({c['error']:+.0%})"
             for phase, c in row["comparison"].items()]
    return f"{row['model']}: predicted/measured " + ", ".join(parts) + f" [{row['seconds']} s]"


if __name__ == "__main__":
    main()
