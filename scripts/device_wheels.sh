#!/usr/bin/env bash
# The wheels our GPU machine's image lacks and `homerlhf check`'s dpo-1.5b and kto-1.5b cases need, into .whl/
# (gitignored) for scripts/gpu_session.sh to install there (carry [".device-site", ".whl"]):
#
#     bash scripts/device_wheels.sh        # here, from the repository root; a few MB, from PyPI
#
# datasets (the preference stage's) at the version installed here, and what it needs that the image lacks:
# dill and multiprocess at the versions installed here (within datasets' own bounds, as pip resolved them).
# The image has its other needs (Requires-Dist of datasets: filelock, numpy, pyarrow, pandas, tqdm, xxhash,
# fsspec, huggingface-hub, packaging, pyyaml; /work/.library/device/KINDS.md lists the image's packages), and
# TRL comes in .device-site. For the image's Python 3.12 on x86-64 Linux, whatever runs this script.
set -eu
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
version() { "$PYTHON" -c "import importlib.metadata as m; print(m.version('$1'))"; }
wanted=("datasets==$(version datasets)" "dill==$(version dill)" "multiprocess==$(version multiprocess)")
rm -rf .whl
mkdir .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${wanted[@]}"
for wheel in .whl/datasets-*.whl; do  # what datasets asks for, beside the names above: the image has the rest
    unzip -p "$wheel" '*/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' || true
done
ls -l .whl
