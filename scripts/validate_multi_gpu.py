#!/usr/bin/env python3
"""Data parallel and sharded QLoRA on a machine with several GPUs (never needed by the tests).

1. **DDP PPO:** tiny models built from code (nothing is downloaded), ``homerlhf train --gpus 1`` and
   ``--gpus N`` with the same global batch and seed on the GPUs, real llama.cpp workers on the CPU;
   prints the largest adapter / value-head difference after each iteration and rank 0's peak memory
   per phase. On our CPU (gloo, fp32) the difference is <= 1e-5 (tests/stages/test_data_parallel.py);
   on GPUs expect more (TF32 / bf16 matmuls, NCCL's summation order).
2. **FSDP + QLoRA:** ``accelerate launch`` of this script's ``--fsdp-rank`` mode on N GPUs (nccl): the
   tiny model (or ``--model DIR``) in NF4 with bf16 storage, LoRA, FSDP-wrapped per decoder layer;
   the sharded forward/backward against the unsharded one
   (:func:`homerlhf.models.sharding.smoke`), and what each GPU holds.

    python3 scripts/validate_multi_gpu.py --gpus 2 --out multi_gpu_validation.json

Needs at least 2 CUDA GPUs; on a machine with fewer it exits with one line saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=2, help="GPUs (processes) to use.")
    ap.add_argument("--iterations", type=int, default=2, help="PPO iterations of each DDP run.")
    ap.add_argument("--model", default=None, help="A local HF causal LM dir for the FSDP check (default: tiny).")
    ap.add_argument("--out", default="multi_gpu_validation.json", help="Where the figures go (JSON).")
    ap.add_argument("--fsdp-rank", nargs=3, metavar=("MODEL", "OUT", "DEVICE"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def fsdp_rank(model_dir: str, out: str, device_kind: str) -> None:
    """One launched process of the FSDP check; rank 0 writes the figures (``device_kind``: cpu or cuda)."""
    import torch
    import torch.distributed as dist
    from accelerate import PartialState

    from homerlhf.models.sharding import smoke

    state = PartialState(cpu=device_kind == "cpu")
    device = "cpu" if device_kind == "cpu" else f"cuda:{state.local_process_index}"
    figures = smoke(model_dir, device, torch.float32 if device_kind == "cpu" else torch.bfloat16)
    if device_kind == "cuda":
        figures["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    figures["world"] = state.num_processes
    gathered = [None] * state.num_processes
    dist.all_gather_object(gathered, figures)
    if state.process_index == 0:
        Path(out).write_text(json.dumps(gathered, indent=2))
    dist.barrier()


def _weights(run: Path, iteration: int) -> dict:
    from safetensors.torch import load_file

    ckpt = run / "checkpoints" / f"iter_{iteration:06d}"
    return {f"{rel}:{k}": v for rel in ("actor/adapter_model.safetensors", "critic/adapter_model.safetensors",
                                        "value_head.safetensors") for k, v in load_file(str(ckpt / rel)).items()}


def ddp_check(gpus: int, iterations: int, work: Path, policy: Path, rm: Path) -> dict:
    """``--gpus 1`` vs ``--gpus N`` runs of the same global batch: weight differences and peak memory."""
    batch = 4 * gpus
    sets = [f"model.name_or_path={policy}", f"reward.model={rm}", "card.device=cuda",
            f"rollout.batch_size={batch}", "rollout.chunk_size=2", "rollout.max_new_tokens=8",
            f"ppo.mini_batch_size={batch}", "ppo.micro_batch_size=2", "ppo.epochs=1", f"ppo.iterations={iterations}",
            "checkpoint.every=1", f"checkpoint.keep={iterations}", "logging.progress=false"]
    runs = {}
    for n in (1, gpus):
        out = work / f"gpus{n}"
        cmd = [sys.executable, "-m", "homerlhf.cli", "train", "--preset", "cpu-tiny", "--gpus", str(n), "--out", str(out)]
        subprocess.run(cmd + [x for s in sets for x in ("--set", s)], check=True)
        runs[n] = out
    diffs = []
    for it in range(1, iterations + 1):
        a, b = _weights(runs[1], it), _weights(runs[gpus], it)
        diffs.append(max((a[k] - b[k]).abs().max().item() for k in a))
    rows = [json.loads(line) for line in (runs[gpus] / "metrics.jsonl").read_text().splitlines()]
    peaks = {k: v for k, v in rows[-1].items() if k.startswith(("peak_mem_", "predicted_mem_"))}
    return {"max_weight_diff_per_iteration": diffs, "rank0_memory_last_iteration": peaks}


def fsdp_check(gpus: int, model_dir: str, work: Path) -> list:
    from homerlhf.stages.data_parallel import free_port

    out = work / "fsdp.json"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(gpus),
           "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
           "--dynamo_backend", "no", __file__, "--fsdp-rank", model_dir, str(out), "cuda"]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.fsdp_rank:
        fsdp_rank(*args.fsdp_rank)
        return 0
    import torch

    if torch.cuda.device_count() < max(2, args.gpus):
        print(f"needs {max(2, args.gpus)} CUDA GPUs; this machine has {torch.cuda.device_count()}", file=sys.stderr)
        return 1
    from homerlhf.tiny import build_causal_lm, build_sequence_classifier

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ.setdefault("HOMERLHF_CACHE", str(work / "cache"))
        policy = build_causal_lm(work / "policy", arch="llama", seed=0)
        rm = build_sequence_classifier(work / "rm", arch="llama", seed=3)
        result = {"gpus": args.gpus, "ddp": ddp_check(args.gpus, args.iterations, work, policy, rm),
                  "fsdp": fsdp_check(args.gpus, args.model or str(policy), work)}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
