#!/usr/bin/env bash
# Run tests under the CPU settings this machine can imitate, before landing: PyTorch's default kernels
# and ATEN_CPU_CAPABILITY=avx2 (a CPU without AVX-512), each with 1 and 2 threads, each with a model
# cache of its own (so the tiny SFT and reward models are built under that setting too).
# What it cannot imitate: another vendor's MKL/oneDNN paths (an Intel with AMX stages a bf16 matmul
# in fp32; an AMD does not), so a test that depends on a kernel choice says so in its docstring.
#   usage: bash scripts/cpu_matrix.sh [pytest args...]   (default: the kernel-dependent tests)
set -uo pipefail
cd "$(dirname "$0")/.."
tests=("$@")
[ ${#tests[@]} -eq 0 ] && tests=(tests/memory/test_components.py tests/stages/test_reward.py tests/stages/test_demo.py)
status=0
for cap in default avx2; do
    for threads in 2 1; do
        cache=$(mktemp -d "${TMPDIR:-/tmp}/homerlhf-matrix-XXXXXX")
        env=(HOMERLHF_CACHE="$cache" OMP_NUM_THREADS="$threads")
        [ "$cap" = avx2 ] && env+=(ATEN_CPU_CAPABILITY=avx2)
        env "${env[@]}" python -m pytest -q -p no:cacheprovider "${tests[@]}" > "$cache/pytest.log" 2>&1
        rc=$?
        echo "kernels $cap, $threads thread(s): $(grep -E '^[0-9]+ (passed|failed)|^(FAILED|ERROR) ' "$cache/pytest.log" | tail -5 | tr '\n' ' ') (exit $rc; log $cache/pytest.log)"
        [ $rc -ne 0 ] && status=1
    done
done
exit $status
