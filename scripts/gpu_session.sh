#!/usr/bin/env bash
# What a session lent a GPU runs: two commands, each read (and its failures rerun) on its own.
#
#     bash scripts/gpu_session.sh check     # `homerlhf check` (homerlhf/check), as a user runs it: one line a case, $OUT/gpu_check.json
#     bash scripts/gpu_session.sh speed     # benchmarks/gpu_generation.py: one line per model, $OUT/gpu_generation.json
#     bash scripts/gpu_session.sh check --only grpo-1.5b,cli-1.5b   # rerun the cases that failed
#     bash scripts/gpu_session.sh check --cpu-smoke    # either one's code paths on the CPU (tests/scripts)
#
# Prepare on the development machine, from the repository root:
#     ../shared/tools/device-site          # builds .device-site: bitsandbytes (CUDA 13), pydantic, gguf, trl
# then, on the device (its `run` tool), with carry [".device-site"], both in one call (one machine start):
#     bash scripts/gpu_session.sh check; bash scripts/gpu_session.sh speed          # timeout_s 560
# Arguments after the command (and --cpu-smoke) go to it. On the H200 (no preset names it) `homerlhf check`
# runs the 4090 preset's cases, capped at 24 GiB.
#
# Each runs under `timeout -k 15 LIMIT` (check 300 s, speed 200 s; SIGTERM to the script and its children, SIGKILL
# 15 s later: a `homerlhf train` child that catches SIGTERM cannot outlive it; the CPU smoke gets 1200 s) and
# writes $OUT/gpu_check.log (gpu_generation.log) and its JSON, kept after every case or model (a run cut short
# leaves what it finished). Random checkpoints go to .gpu-models in this checkout ($HOMERLHF_GPU_MODELS;
# gitignored; a disk, not /tmp), so speed, run after check on the same machine, loads what check built.
#
# Estimated H200 time (upper bounds, from the H200 figures in DESIGN.md and docs/time.md: a 7B built and saved
# in ~30 s, loaded in ~5 s, a 1.5B in ~6 and ~2; HF generate 84 ms a decode step of a 28-layer model; scoring
# 16,000 and update 4,350 tokens/s for the 7B; the captured loop priced as HF generate):
#   check  286 s: its start 10, builds 31 + 6 + 2 (the 0.5B critic), ppo-7b 95 (5 + 2 x (256 x 84 ms + 2.3 + 5.6)),
#          the seven 1.5B cases 14 + 14 + 14 + 22 + 24 + 24 + 30 (homerlhf/check/cases.py: H200_S): grpo, its
#          fp32 upcast and rloo 2 + 64 x 84 ms + 6 each (8 prompts of 256 + 64 tokens), reward-adapter +5 of
#          the adapter's build and +3 for its critic's own 0.5B base, ppo-fp16 2 iterations at 95 ms a step,
#          resume 2 iterations of 32 new tokens + a checkpoint, with every 2nd layer's inputs offloaded
#          (8 x 288 x 14 x 1,536 x 2 B = 100 MB each way, a few ms at 63 GB/s), cli two interpreters' start
#          (~10 s each) + 2 x 5 s
#   speed  183 s after check (its builds reused; 219 s on a fresh machine): its start 10; per model load + rates
#          + agreement (8 rows x 32 steps, both samplers): rates = 2 HF settings x (2 warm-up + 16 + 64 steps)
#          + the loop x (64 warm-up + 16 + 64) = 308 steps x 84 ms = 26 s, + prefills and the loop's capture:
#          1.5B 2 + 34 + 8, 7B 5 + 37 + 8; the 7B's two PPO iterations of 32 prompts at chunk 32:
#          2 x (256 x 84 ms + 2 capture + 4.6 + 11.3) = 79
#   device budget (900 s): a machine start 60-120 s; call 1 = start + check + speed = 120 + 286 + 183 = 589 s
#          (620 if both run to their limits, 500 s); give the machine back, then call 2 = start +
#          a rerun of check's failed cases (`check --only ...`, up to ~150 s) = 270 s: 859 s of 900.
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

limit=200  # speed: 183 s estimated after check (see above); the CPU smoke checks code paths, not time
[ "$cmd" = check ] && limit=300  # 286 s estimated, an upper bound
case " $* " in *" --cpu-smoke "*) limit=1200 ;; esac
started=$SECONDS
timeout -k 15 "$limit" "$PYTHON" "${run[@]}" "$@" --out "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
status=${PIPESTATUS[0]}
echo "$label exit: $status ($((SECONDS - started)) s)"
[ "$status" = 0 ]
