#!/usr/bin/env bash
# What a session lent a GPU runs: two commands, each under 5 minutes, each read (and rerun) on its own.
#
#     bash scripts/gpu_session.sh check     # scripts/gpu_check.py: every case, one line each, $OUT/gpu_check.json
#     bash scripts/gpu_session.sh speed     # benchmarks/gpu_generation.py: one line per model, $OUT/gpu_generation.json
#     bash scripts/gpu_session.sh check --cpu-smoke    # either one's code paths on the CPU (tests/scripts)
#
# Prepare on the development machine, from the repository root:
#     ../shared/tools/device-site          # builds .device-site: bitsandbytes (CUDA 13), pydantic, gguf, trl
# then, on the device (its `run` tool), with carry [".device-site"] and timeout_s 330, one command a call.
# Arguments after the command (and --cpu-smoke) go to its script (e.g. `check --only ppo-7b`).
#
# Each runs under `timeout -k 15 300` (SIGTERM to the script and its children, SIGKILL 15 s later: a
# `homerlhf train` child that catches SIGTERM cannot outlive it; the CPU smoke gets 1200 s) and writes
# $OUT/<script>.log and its JSON, kept after every case or model (a run cut short leaves what it
# finished). Random checkpoints go to .gpu-models in this checkout ($HOMERLHF_GPU_MODELS; gitignored; a
# disk, not /tmp), so the second command on a machine still warm loads what the first built (`rm -rf
# .gpu-models` frees them); run dirs and checkpoints of the cases to .gpu-scratch, emptied after.
#
# Estimated H200 time (upper bounds, from the H200 figures in DESIGN.md and docs/time.md: a 7B built
# and saved in ~30 s, loaded in ~5 s, a 1.5B in ~6 and ~2; HF generate 84 ms a decode step of a 28-layer
# model; scoring 16,000 and update 4,350 tokens/s for the 7B; the captured loop priced as HF generate,
# since no GPU has run it yet):
#   check  280 s: its start 10, builds 31 + 6, ppo-7b 95 (5 + 2 x (256 x 84 ms + 2.3 + 5.6)), the seven
#          1.5B cases 14 + 14 + 14 + 20 + 22 + 24 + 30 (scripts/gpu_check.py's docstring has each sum)
#   speed  209 s: its start 10; per model build + load + 3 rates x (2 + 16 + 64 steps) + agreement
#          (8 rows x 32 steps, both samplers): 1.5B 6 + 2 + 29 + 8, 7B 30 + 5 + 32 + 8; the 7B's two
#          PPO iterations of 32 prompts at chunk 32: 2 x (256 x 84 ms + 2 capture + 4.6 + 11.3) = 79
#   together 489 s (8.2 minutes); 452 s when speed follows check on a machine still warm (builds reused).
set -u
cmd=${1:-}
case "$cmd" in
    check) script=scripts/gpu_check.py; name=gpu_check ;;
    speed) script=benchmarks/gpu_generation.py; name=gpu_generation ;;
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
case " $* " in *" --cpu-smoke "*) limit=1200 ;; esac
started=$SECONDS
timeout -k 15 "$limit" "$PYTHON" "$script" "$@" --out "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
status=${PIPESTATUS[0]}
echo "$(basename "$script") exit: $status ($((SECONDS - started)) s)"
[ "$status" = 0 ]
