#!/usr/bin/env bash
# What a session lent a GPU runs: two commands, each under 5 minutes, each read (and rerun) on its own.
#
#     bash scripts/gpu_session.sh check     # `homerlhf check` (homerlhf/check), as a user runs it: one line a case, $OUT/gpu_check.json
#     bash scripts/gpu_session.sh speed     # benchmarks/gpu_generation.py: one line per model, $OUT/gpu_generation.json
#     bash scripts/gpu_session.sh check --cpu-smoke    # either one's code paths on the CPU (tests/scripts)
#
# Prepare on the development machine, from the repository root:
#     ../shared/tools/device-site          # builds .device-site: bitsandbytes (CUDA 13), pydantic, gguf, trl
# then, on the device (its `run` tool), with carry [".device-site"] and timeout_s 360 (check) or 330 (speed),
# one command a call.
# Arguments after the command (and --cpu-smoke) go to it (e.g. `check --only ppo-7b`). On the H200 (no
# preset names it) `homerlhf check` runs the 4090 preset's cases, capped at 24 GiB: the cases below.
#
# Each runs under `timeout -k 15 330` (check; speed: 300) (SIGTERM to the script and its children, SIGKILL 15 s later: a
# `homerlhf train` child that catches SIGTERM cannot outlive it; the CPU smoke gets 1200 s) and writes
# $OUT/gpu_check.log (gpu_generation.log) and its JSON, kept after every case or model (a run cut short leaves what it
# finished). Random checkpoints go to .gpu-models in this checkout ($HOMERLHF_GPU_MODELS; gitignored; a
# disk, not /tmp), so the second command on a machine still warm loads what the first built (`rm -rf
# .gpu-models` frees them); run dirs and checkpoints of the cases to .gpu-models/scratch, emptied after.
#
# Estimated H200 time (upper bounds, from the H200 figures in DESIGN.md and docs/time.md: a 7B built
# and saved in ~30 s, loaded in ~5 s, a 1.5B in ~6 and ~2; HF generate 84 ms a decode step of a 28-layer
# model; scoring 16,000 and update 4,350 tokens/s for the 7B; the captured loop priced as HF generate,
# since no GPU has run it yet):
#   check  314 s: its start 10, builds 31 + 6 + 2 (the 0.5B critic), ppo-7b 95 (5 + 2 x (256 x 84 ms + 2.3
#          + 5.6)), the nine 1.5B cases 14 + 14 + 14 + 16 + 16 + 20 + 22 + 24 + 30 (homerlhf/check/cases.py:
#          H200_S): ppo-critic (its own 0.5B base) and ppo-offload (every 2nd layer, inputs in host memory)
#          as grpo + 2 (a second model's load; the offload's copies, 8 x 320 x 14 x 1,536 x 2 B = 110 MB
#          each way, a few ms at 63 GB/s), grpo, its fp32
#          upcast and rloo 2 + 64 x 84 ms + 6 each (8 prompts of 256 + 64 tokens), the reward adapter +5
#          of build, resume 2 iterations of 32 new tokens + a checkpoint, the fp16 path 2 iterations at
#          95 ms a step, the cli case two interpreters' start (~10 s each) + 2 x 5 s; the per-case
#          plans, flags, workspace release, log-prob gap and the report's scrubbing add no device work
#   speed  219 s: its start 10; per model build + load + rates + agreement (8 rows x 32 steps, both
#          samplers): rates = 2 HF settings x (2 warm-up + 16 + 64 steps) + the loop x (64 warm-up + 16 +
#          64) = 308 steps x 84 ms = 26 s, + prefills and the loop's capture: 1.5B 6 + 2 + 34 + 8, 7B
#          30 + 5 + 37 + 8; the 7B's two PPO iterations of 32 prompts at chunk 32:
#          2 x (256 x 84 ms + 2 capture + 4.6 + 11.3) = 79
#   together 533 s (8.9 minutes); 496 s when speed follows check on a machine still warm (builds
#   reused); a rerun of the longer command (314 s) fits beside both: 847 s of the 900 s device budget.
set -u
cmd=${1:-}
case "$cmd" in
    check) run=(-m homerlhf.cli check --overwrite); name=gpu_check; label="homerlhf check" ;;  # the installed command's code
    speed) run=(benchmarks/gpu_generation.py); name=gpu_generation; label=gpu_generation.py ;;
    *) echo "usage: bash scripts/gpu_session.sh check|speed [--cpu-smoke] [the script's arguments]" >&2; exit 2 ;;
esac
shift
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD/.device-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OUT="${OUT:-$PWD/gpu-session-out}"
export HOMERLHF_GPU_MODELS="${HOMERLHF_GPU_MODELS:-$PWD/.gpu-models}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"

{ nvidia-smi || true; "$PYTHON" - <<'EOF'
import importlib.metadata as md
for name in ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "trl", "pydantic", "typer", "rich",
             "httpx", "datasets", "gradio", "matplotlib", "llama-cpp-python", "gguf", "safetensors"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} absent")
EOF
} > "$OUT/environment.txt" 2>&1

limit=300  # the device's budget; the CPU smoke checks code paths, not time, on machines ~100x slower
[ "$cmd" = check ] && limit=330  # its two cases of issue 43's levers (ppo-critic, ppo-offload): 314 s estimated
case " $* " in *" --cpu-smoke "*) limit=1200 ;; esac
started=$SECONDS
timeout -k 15 "$limit" "$PYTHON" "${run[@]}" "$@" --out "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
status=${PIPESTATUS[0]}
echo "$label exit: $status ($((SECONDS - started)) s)"
[ "$status" = 0 ]
