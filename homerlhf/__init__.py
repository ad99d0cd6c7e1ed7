"""homerlhf: SFT, reward model and PPO on one consumer GPU.

A 4-bit base is shared by a LoRA actor and a LoRA critic on the GPU; the reference and reward
models run on the CPU in llama.cpp worker processes.
"""

import logging

__version__ = "0.1.0"


class _UnusedCpuKernelNotice(logging.Filter):
    """Drops the two warnings bitsandbytes (>= 0.50) prints on import on a CPU with AVX512-BF16, where
    it fetches a fused bf16 CPU kernel from the Hugging Face Hub (``kernels-community/quantization-
    bitsandbytes``) through ``kernels``: offline, or when the fetch fails, one line says the publisher
    check was skipped and one that the kernel did not load. homerlhf never runs that kernel (it keeps
    CPU 4-bit layers off bitsandbytes' repacked inference path: ``models.base_loading``), so the lines
    would only stand before a command's own one-line error. Other warnings of those loggers pass."""

    NOTICES = ("Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'",
               "Failed to load CPU gemm_4bit_forward from kernels-community")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.NOTICES)


for _name in ("kernels._internals.hf_hub", "bitsandbytes.backends.cpu.ops"):
    logging.getLogger(_name).addFilter(_UnusedCpuKernelNotice())
