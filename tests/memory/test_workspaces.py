"""The plan's cuBLAS workspaces per (handle, stream), and the gradients held after a resume.

PyTorch keeps a 32 MiB workspace (compute capability 9-12) per (cuBLAS handle, stream): one handle per
thread that multiplies (the trainer's, autograd's backward thread), each on its default stream, and
the static decoder's warm-up and capture run the trainer's handle on a side stream: a third.
After a resume the optimizer states are loaded but new parameters hold no gradients."""

from __future__ import annotations

import pytest

from homerlhf.config import load_config
from homerlhf.memory.components import Assumptions
from homerlhf.memory.planner import plan
from homerlhf.memory.shapes import builtin_shape

MIB = 2**20
SHAPE = builtin_shape("Qwen/Qwen2.5-1.5B")


def _cfg(*extra):
    return load_config("4090", overrides=["model.name_or_path=Qwen/Qwen2.5-1.5B", "algorithm=grpo", "group.size=4",
                                          *extra])


def _component(phase, name):
    return next((c.bytes for c in phase.components if c.name == name), 0)


@pytest.mark.parametrize("decoder, assumed, handles, workspaces", [
    ("static", "any", 2, 3),  # trainer + backward thread on their default streams, + the side stream
    ("auto", "any", 2, 3),  # auto: the captured loop on CUDA (its warm-up made the side stream's even if declined)
    ("hf", "any", 2, 2),  # HF generate: no side stream
    ("auto", "hf", 2, 2),  # the decoder a run resolved to, as `homerlhf check` plans it
    ("auto", "static", 1, 2),  # a first iteration before any backward: the trainer's handle on two streams
])
def test_one_workspace_per_handle_and_stream(decoder, assumed, handles, workspaces):
    planned = plan(_cfg(f"rollout.decoder={decoder}"), SHAPE, with_suggestion=False,
                   assumptions=Assumptions(decoder=assumed, cublas_handles=handles))
    for phase in planned.phases:  # kept from the first matmul on: in every phase
        assert _component(phase, "cuBLAS workspaces") == workspaces * 32 * MIB  # 100,663,296 B for 3


def test_after_a_resume_the_states_are_there_and_no_gradients_are_held():
    """Qwen2.5-1.5B, LoRA r 16 on all 7 linears of 28 layers, fp32: per layer 16 x (in + out) summed over
    q (1536+1536), k, v (1536+256 each), o (1536+1536), gate, up (1536+8960 each), down (8960+1536) =
    16 x 41,216 = 659,456 params; x 28 x 4 B = 73,859,072 B of gradients (GRPO: no critic)."""
    cfg = _cfg()
    steady = plan(cfg, SHAPE, with_suggestion=False)
    resumed = plan(cfg, SHAPE, with_suggestion=False, assumptions=Assumptions(after_first_step=True, held_gradients=False))
    for name in ("generation", "scoring"):
        assert _component(steady.phase(name), "gradients held from the last step") == 73_859_072
        assert steady.phase(name).allocated_bytes - resumed.phase(name).allocated_bytes == 73_859_072
        assert any(c.kind == "optimizer" and c.bytes > 0 for c in resumed.phase(name).components)
    assert steady.phase("update").allocated_bytes == resumed.phase("update").allocated_bytes


def test_the_default_gpu_rates_say_which_kernels_they_were_measured_with():
    """The H200 figures behind a GPU card's default rates name their kernels (a policy's own for bf16: TF32
    on, no cuDNN attention; the upcast's under torch's defaults); a CPU card's figures name none."""
    from homerlhf.memory.timing import Throughputs, default_throughputs
    from homerlhf.models.cuda_kernels import MEASURED_KERNELS

    gpu = default_throughputs(SHAPE, _cfg(), cores=2)
    assert gpu.kernels == MEASURED_KERNELS and "TF32 on" in gpu.kernels and "TF32 off" in gpu.kernels
    assert "no cuDNN" in gpu.kernels and "static loop" in gpu.kernels
    assert Throughputs.from_dict(gpu.to_dict()).kernels == MEASURED_KERNELS  # kept in a bench cache's JSON
    cpu = default_throughputs(SHAPE, load_config("cpu-tiny", overrides=["model.name_or_path=Qwen/Qwen2.5-1.5B"]),
                              cores=2)
    assert cpu.kernels == ""
