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
#     bash scripts/device_wheels.sh        # .whl: datasets, dill, multiprocess (the dpo/kto cases' datasets)
# then, on the device (its `run` tool), with carry [".device-site", ".whl"], both in one call (one machine start):
#     bash scripts/gpu_session.sh check; bash scripts/gpu_session.sh speed          # timeout_s 560
# Arguments after the command (and --cpu-smoke) go to it. On the H200 (no preset names it) `homerlhf check`
# runs the 4090 preset's cases, capped at 24 GiB. Wheels in .whl/ ($HOMERLHF_WHEELS), when there are any, are
# installed first (pip, no index, no dependencies; a few seconds) into a folder of their own under /tmp, put
# first on PYTHONPATH; without them the dpo/kto cases fail (no datasets) and the others run as before. Not
# with --cpu-smoke: those wheels are the GPU machine's (Python 3.12), the smoke runs on this one's packages.
#
# Each runs under `timeout -k 15 LIMIT` (check 300 s, speed 200 s; SIGTERM to the script and its children, SIGKILL
# 15 s later: a `homerlhf train` child that catches SIGTERM cannot outlive it; the CPU smoke gets 1200 s) and
# writes $OUT/gpu_check.log (gpu_generation.log) and its JSON, kept after every case or model (a run cut short
# leaves what it finished). Random checkpoints go to .gpu-models in this checkout ($HOMERLHF_GPU_MODELS;
# gitignored; a disk, not /tmp), so speed, run after check on the same machine, loads what check built.
#
# Estimated H200 time (upper bounds). Builds from the H200 figures in DESIGN.md: a 7B built and saved in ~30 s,
# a 1.5B in ~6, loaded in ~5 and ~2. The PPO cases: their wall seconds on an H200 on 2026-12-04
# (docs/gpu-runs/2026-12-04-h200: 8 of 8 ok in 158 s of 286 estimated) x 1.5, rounded up, each case's first
# of a model with that model's build inside (homerlhf/check/cases.py: H200_S): ppo-7b 51.2 s -> 77 (95 before),
# grpo 6.4 -> 10 (14), its fp32 upcast 3.5 -> 6 (14), rloo 3.0 -> 5 (14), reward-adapter 7.4 -> 12 (22),
# ppo-fp16 9.8 -> 15 (24), resume 12.8 -> 20 (24), cli 43.8 -> 66 (30: two interpreters' start, ~17 s each).
# The preference cases from the H200's rates in docs/time.md (scoring 26,300 and update 5,620 tokens/s for
# the 7B; x 4.58 for the 1.5B by matmul parameters, 7.07 G / 1.54 G: 120,500 and 25,700 tokens/s), at the
# 4090 preset's dpo/kto settings (4 rows x 4 accumulated, 1,024 tokens), 2 optimizer steps:
#   dpo-1.5b 14: 2 x 16 pairs x 2 rows x 1,024 = 65,536 tokens trained, 2.6 s, and their reference forwards
#          0.5 s; the held-out pass over 8 pairs' 2 answers before and after, 32,768 tokens, 0.3 s; its load 2,
#          a checkpoint (the adapter and its AdamW states, ~0.2 GB) 1, TRL's trainer and the import of trl and
#          datasets ~5; 3 to spare
#   kto-1.5b 12: 2 x 16 answers x 1,024 = 32,768 tokens trained, 1.3 s; 3 forwards of them (the reference, the
#          KL rows under both) 0.8 s; the held-out pass also over the 16 answers as rated, 65,536 tokens, 0.5 s;
#          load 2, checkpoint 1, TRL's trainer ~3; 3 to spare
#   check  286 s: its start 10, builds 31 + 6 + 2 (the 0.5B critic), ppo-7b 77, the seven 1.5B PPO cases
#          10 + 6 + 5 + 12 + 15 + 20 + 66, dpo 14, kto 12 (with the PPO cases' estimates before 2026-12-04 and
#          the two preference cases it would be 316 s, over the 290 the check's limit allows)
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
wheels=${HOMERLHF_WHEELS:-$PWD/.whl}
case " $* " in *" --cpu-smoke "*) wheels="" ;; esac  # the GPU machine's wheels (Python 3.12); a smoke runs here
if [ -n "$wheels" ] && compgen -G "$wheels/*.whl" > /dev/null; then  # scripts/device_wheels.sh: what the image lacks
    site=$(mktemp -d /tmp/site.XXXXXX)
    trap 'rm -rf "$site"' EXIT
    if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            "$wheels"/*.whl; then
        export PYTHONPATH="$site:$PYTHONPATH"
    else
        echo "installing $wheels/*.whl failed: the cases that need them will fail" >&2
    fi
fi
export OUT="${OUT:-$PWD/gpu-session-out}"
export HOMERLHF_GPU_MODELS="${HOMERLHF_GPU_MODELS:-$PWD/.gpu-models}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"

{ nvidia-smi || true; "$PYTHON" - <<'EOF'
import importlib.metadata as md
for name in ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "trl", "pydantic", "typer", "rich",
             "httpx", "datasets", "gradio", "matplotlib", "llama-cpp-python", "gguf", "safetensors",
             "dill", "multiprocess", "pyarrow", "pandas", "fsspec", "xxhash", "huggingface-hub"):  # datasets' needs
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
