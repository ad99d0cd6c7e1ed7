"""Which CUDA kernels a policy runs: TF32 for its fp32 matmuls or not, and which SDPA backends attention may use.

torch keeps both as process-wide flags, so a policy built in a process where another ran (the GPU check's
cases one after another, a notebook running an upcast stage after a bf16 one) would inherit whatever the
last one set. Each policy therefore sets all of them, on and off (:func:`apply`, called by
:meth:`homerlhf.models.policy.PolicyModel.from_config`, which records what it set as ``policy.kernel_settings``),
and a script that runs several can put the previous flags back (:func:`current_flags`, :func:`restore`).
:func:`policy_kernels` says which and why: TF32 only under 16-bit compute without the fp32 upcast; SDPA's
flash, memory-efficient and math backends on every CUDA card, never cuDNN's. Run on an NVIDIA H200
(``homerlhf check``: docs/gpu-runs/); no consumer card has run them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch

# The SDPA backends a CUDA policy allows, by their torch.nn.attention.SDPBackend names.
CUDA_SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
# Name -> (setter, getter) in torch.backends.cuda; every backend a policy does not allow is disabled.
_SDPA_FLAGS = {
    "FLASH_ATTENTION": ("enable_flash_sdp", "flash_sdp_enabled"),
    "EFFICIENT_ATTENTION": ("enable_mem_efficient_sdp", "mem_efficient_sdp_enabled"),
    "MATH": ("enable_math_sdp", "math_sdp_enabled"),
    "CUDNN_ATTENTION": ("enable_cudnn_sdp", "cudnn_sdp_enabled"),
}
_HALF = (torch.bfloat16, torch.float16)

# What the planner's GPU time rates (homerlhf.memory.timing, docs/time.md) were measured with.
MEASURED_KERNELS = (
    "NVIDIA H200 (sm90), torch 2.11 + CUDA 13. 2026-12-04: the kernels a policy sets (bf16 compute: TF32 on, "
    "SDPA on flash / memory-efficient / math, no cuDNN), HF generate and the captured static loop. "
    "2026-11-30: the fp32 upcast of the base (quant.upcast_non_quantized) under torch's default flags (TF32 off, "
    "SDPA backends not chosen, which one ran not recorded): the upcast's rates."
)


@dataclass(frozen=True)
class KernelSettings:
    """What :func:`apply` sets. ``sdpa_backends``: the SDPBackend names allowed (every other one is
    disabled); empty: the SDPA flags are left as they are (the CPU)."""

    tf32: bool
    sdpa_backends: tuple[str, ...]
    reason: str

    def as_dict(self) -> dict:
        """For JSON: ``{"tf32": bool, "sdpa_backends": [names], "reason": str}``."""
        out = asdict(self)
        out["sdpa_backends"] = list(self.sdpa_backends)
        return out


def device_capability(device: torch.device | str) -> Optional[tuple[int, int]]:
    """The CUDA compute capability of ``device`` (e.g. (9, 0) for an H200), None off CUDA or when no
    CUDA device can be asked."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def policy_kernels(compute: torch.dtype, upcast: bool, device_type: str,
                   capability: Optional[tuple[int, int]]) -> KernelSettings:
    """The kernels of a policy computing in ``compute`` (``upcast``: the fp32 upcast of the 4-bit
    base's other weights) on ``device_type`` with compute ``capability`` (None: unknown).

    - **TF32** (cuBLAS matmuls and cuDNN: ``fp32_precision`` "tf32" / "ieee" on torch >= 2.9, whose legacy
      ``allow_tf32`` flags raise once anything used the new API; ``allow_tf32`` before): on only on CUDA
      under 16-bit compute without the fp32 upcast. The fp32 matmuls left there (LoRA, value head) take
      16-bit values or fp32 weights whose results are rounded to the compute dtype, so TF32's 10-bit
      mantissa loses nothing that is kept; with the upcast the fp32 LM head makes the logits, and TF32
      would round them. cuDNN's flag follows the matmul flag, so "off" means no TF32 anywhere.
    - **SDPA backends** on CUDA: flash, memory-efficient and math; never cuDNN. torch >= 2.11 prefers
      cuDNN's attention on sm90 and later (PyTorch issue #196678), whose backward has a known non-finite
      dQ with masks at sequence lengths = 64 mod 128 (TRL #7181 met it with Qwen2.5): a Hopper run would
      lose micro-batches to the non-finite guard and measure other kernels than the consumer cards. Below
      sm90 the same three, so every CUDA card runs what an RTX 4090 runs. On the CPU the SDPA flags are
      left as they are: ``enable_flash_sdp`` also steers the CPU's SDPA (checked with torch 2.13's profiler)."""
    if device_type != "cuda":
        return KernelSettings(False, (), f"{device_type}: no TF32 there; SDPA flags left as they are "
                                         "(the CPU's kernels are not chosen here)")
    tf32 = compute in _HALF and not upcast
    why_tf32 = (f"TF32 on: {compute} compute, fp32 only in LoRA and the value head" if tf32 else
                "TF32 off: the fp32 upcast makes the logits in fp32" if upcast else f"TF32 off: {compute} compute")
    if capability is None:
        card = "capability unknown: no cuDNN SDPA, as on an RTX 4090"
    elif capability >= (9, 0):
        card = (f"sm{capability[0]}{capability[1]}: no cuDNN SDPA (torch >= 2.11 prefers it there; its backward's "
                "non-finite dQ, PyTorch #196678): flash / memory-efficient / math, as on an RTX 4090")
    else:
        card = f"sm{capability[0]}{capability[1]}: flash / memory-efficient / math, the same set as on sm90+"
    return KernelSettings(tf32, CUDA_SDPA_BACKENDS, f"{why_tf32}; {card}")


# torch >= 2.9: TF32 is ``fp32_precision`` ("tf32", "ieee", or "none": as the level above) per backend and
# operation; its legacy ``allow_tf32`` getters raise once the new API set a conflicting value.
NEW_TF32_API = hasattr(torch.backends.cuda.matmul, "fp32_precision")
# Name -> the object whose ``fp32_precision`` it is (the new API), each level TF32 can be chosen at.
_PRECISION_OWNERS = {"cuda.matmul": lambda: torch.backends.cuda.matmul, "cudnn": lambda: torch.backends.cudnn,
                     "cudnn.conv": lambda: torch.backends.cudnn.conv, "cudnn.rnn": lambda: torch.backends.cudnn.rnn}


def tf32_flags() -> dict[str, object]:
    """The TF32 settings as they stand, in the running torch's own API: ``{"<level>.fp32_precision": str}``
    (torch >= 2.9), else ``{"cuda.matmul.allow_tf32": bool, "cudnn.allow_tf32": bool}``."""
    if NEW_TF32_API:
        return {f"{name}.fp32_precision": owner().fp32_precision for name, owner in _PRECISION_OWNERS.items()}
    return {"cuda.matmul.allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn.allow_tf32": bool(torch.backends.cudnn.allow_tf32)}


def tf32_wanted(on: bool) -> dict[str, object]:
    """The :func:`tf32_flags` entries that turn TF32 ``on`` or off for matmuls and every cuDNN operation."""
    if NEW_TF32_API:
        return {f"{name}.fp32_precision": "tf32" if on else "ieee" for name in _PRECISION_OWNERS}
    return {"cuda.matmul.allow_tf32": on, "cudnn.allow_tf32": on}


def tf32_matmul_on() -> bool:
    """Whether cuBLAS may run fp32 matmuls in TF32 now (read through the running torch's API)."""
    if NEW_TF32_API:
        return torch.backends.cuda.matmul.fp32_precision == "tf32"
    return bool(torch.backends.cuda.matmul.allow_tf32)


def current_flags() -> dict[str, object]:
    """The process-wide flags :func:`apply` sets, by name: the TF32 ones (:func:`tf32_flags`) and one per
    SDPA backend (``sdpa.<name>``)."""
    flags = tf32_flags()
    for name, (_, getter) in _SDPA_FLAGS.items():
        flags[f"sdpa.{name}"] = bool(getattr(torch.backends.cuda, getter)())
    return flags


def restore(flags: dict[str, object]) -> None:
    """Set the flags of a :func:`current_flags` (or :func:`apply`) result back, those present."""
    for name, owner in _PRECISION_OWNERS.items():
        if f"{name}.fp32_precision" in flags:
            owner().fp32_precision = flags[f"{name}.fp32_precision"]
    if "cuda.matmul.allow_tf32" in flags:
        torch.backends.cuda.matmul.allow_tf32 = bool(flags["cuda.matmul.allow_tf32"])
    if "cudnn.allow_tf32" in flags:
        torch.backends.cudnn.allow_tf32 = bool(flags["cudnn.allow_tf32"])
    for name, (setter, _) in _SDPA_FLAGS.items():
        if f"sdpa.{name}" in flags:
            getattr(torch.backends.cuda, setter)(bool(flags[f"sdpa.{name}"]))


def apply(settings: KernelSettings) -> dict[str, object]:
    """Set the process-wide flags to ``settings`` (TF32 on or off; with SDPA backends, exactly those
    enabled); returns the flags as they were before (for :func:`restore`). Plain booleans: harmless
    on a CPU-only build."""
    unknown = set(settings.sdpa_backends) - set(_SDPA_FLAGS)
    if unknown:
        raise ValueError(f"unknown SDPA backend(s) {sorted(unknown)}; use {sorted(_SDPA_FLAGS)}")
    before = current_flags()
    wanted = tf32_wanted(settings.tf32)
    if settings.sdpa_backends:
        wanted.update({f"sdpa.{name}": name in settings.sdpa_backends for name in _SDPA_FLAGS})
    restore(wanted)
    return before


def set_for_policy(compute: torch.dtype, upcast: bool, device: torch.device | str,
                   capability: Optional[tuple[int, int]] = None) -> KernelSettings:
    """Choose (:func:`policy_kernels`) and :func:`apply` a policy's kernels for its ``device``;
    ``capability``: the card's, read from the device when None. Returns what was set."""
    device = torch.device(device)
    settings = policy_kernels(compute, upcast, device.type, capability or device_capability(device))
    apply(settings)
    return settings
