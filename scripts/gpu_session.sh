#!/usr/bin/env bash
# What a session lent a GPU runs, once: the GPU check, then the generation benchmark, results under $OUT.
#
# Prepare on the development machine, from the repository root:
#     ../shared/tools/device-site          # builds .device-site: bitsandbytes (CUDA 13), pydantic, gguf, trl
# then, on the device (its `run` tool), with carry [".device-site"] and timeout_s 600:
#     bash scripts/gpu_session.sh
#
# Budget (one command may run 600 s): scripts/gpu_check.py <= 330 s, benchmarks/gpu_generation.py
# <= 240 s. Random checkpoints are built once and shared by both ($HOMERLHF_GPU_MODELS). Each step's
# output is also written to $OUT/*.log; a step that runs out of time leaves its partial JSON.
# `bash scripts/gpu_session.sh --cpu-smoke` runs both scripts' CPU smoke modes (tests/scripts).
set -u
smoke=()
[ "${1:-}" = "--cpu-smoke" ] && smoke=(--cpu-smoke)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/.device-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OUT="${OUT:-$PWD/gpu-session-out}"
made_models=""
if [ -z "${HOMERLHF_GPU_MODELS:-}" ]; then
    HOMERLHF_GPU_MODELS=$(mktemp -d -t homerlhf-gpu-models-XXXXXX) && made_models=$HOMERLHF_GPU_MODELS
fi
export HOMERLHF_GPU_MODELS
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"

{ nvidia-smi || true; python - <<'EOF'
import importlib.metadata as md
for name in ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "trl", "pydantic", "typer", "rich",
             "httpx", "datasets", "gradio", "matplotlib", "llama-cpp-python", "gguf", "safetensors"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} absent")
EOF
} > "$OUT/environment.txt" 2>&1

timeout 330 python scripts/gpu_check.py "${smoke[@]}" --out "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log"
check=${PIPESTATUS[0]}
echo "gpu_check.py exit: $check"
timeout 240 python benchmarks/gpu_generation.py "${smoke[@]}" --out "$OUT/gpu_generation.json" 2>&1 | tee "$OUT/gpu_generation.log"
generation=${PIPESTATUS[0]}
echo "gpu_generation.py exit: $generation"
[ -n "$made_models" ] && rm -rf "$made_models"  # only the folder this script made
[ "$check" = 0 ] && [ "$generation" = 0 ]
