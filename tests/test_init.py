"""homerlhf/__init__.py: importing bitsandbytes after homerlhf prints nothing of the CPU kernel it fetches."""

import logging
import os
import subprocess
import sys


def passes(logger: logging.Logger, msg: str, *args) -> bool:
    """Whether the logger's own filters let the record through (whatever level or disabled state an
    earlier test's logging configuration left it in)."""
    return bool(logger.filter(logger.makeRecord(logger.name, logging.WARNING, __file__, 0, msg, args, None)))


def test_the_unused_cpu_kernel_notices_are_dropped_and_other_warnings_pass():
    import homerlhf  # noqa: F401 - installs the filters

    hub = logging.getLogger("kernels._internals.hf_hub")
    ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
    assert not passes(hub, "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes' "
                           "because Hugging Face Hub is in offline mode.")
    assert not passes(ops, "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure "
                           "you already `pip install kernels` and the kernels >= 0.11.1", "not in the local cache")
    assert passes(hub, "Skipping publisher trust check for 'someone/else' because Hugging Face Hub is in offline mode.")
    assert passes(ops, "some other bitsandbytes warning")


def test_a_fresh_interpreter_imports_bitsandbytes_offline_without_a_word():
    """On a CPU with AVX512-BF16 (Intel Xeon, AMD Zen 4) bitsandbytes >= 0.50 tries the hub on import;
    elsewhere it does not, and the test holds trivially."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", "import homerlhf, bitsandbytes, peft"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "", proc.stderr
