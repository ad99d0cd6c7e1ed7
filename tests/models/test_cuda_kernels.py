"""The kernels a policy chooses (TF32, SDPA backends): decided per policy, set on and off, restorable.

torch's flags are process-wide booleans, settable on a CPU-only build: these tests set them as a CUDA
policy would and read them back (what a GPU would then run is predicted, not run here).
"""

from __future__ import annotations

import pytest
import torch

from homerlhf.models import cuda_kernels
from homerlhf.models.cuda_kernels import KernelSettings, apply, current_flags, policy_kernels, restore

NO_CUDNN = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


@pytest.fixture(autouse=True)
def _flags_put_back():
    generic = getattr(torch.backends, "fp32_precision", None)
    saved = current_flags()
    yield
    if generic is not None:
        torch.backends.fp32_precision = generic
    restore(saved)


def tf32(on: bool) -> None:
    """Set TF32 for matmuls and cuDNN through the running torch's own API (as a user's code would)."""
    restore(cuda_kernels.tf32_wanted(on))


@pytest.mark.parametrize("compute, upcast, tf32", [
    (torch.bfloat16, False, True), (torch.float16, False, True),
    (torch.bfloat16, True, False), (torch.float16, True, False), (torch.float32, False, False)])
def test_tf32_only_under_16_bit_compute_without_the_upcast(compute, upcast, tf32):
    settings = policy_kernels(compute, upcast, "cuda", (8, 9))
    assert settings.tf32 is tf32
    assert ("TF32 on" if tf32 else "TF32 off") in settings.reason


@pytest.mark.parametrize("capability", [(9, 0), (10, 0), (12, 0)])
def test_hopper_and_later_run_no_cudnn_attention(capability):
    settings = policy_kernels(torch.bfloat16, False, "cuda", capability)
    assert settings.sdpa_backends == NO_CUDNN
    assert "no cuDNN SDPA" in settings.reason and "#196678" in settings.reason
    assert f"sm{capability[0]}{capability[1]}" in settings.reason


def test_cards_below_sm90_get_the_same_set_and_say_so():
    for capability in [(7, 5), (8, 6), (8, 9), None]:
        settings = policy_kernels(torch.float16, False, "cuda", capability)
        assert settings.sdpa_backends == NO_CUDNN
    assert "the same set as on sm90+" in policy_kernels(torch.bfloat16, False, "cuda", (8, 9)).reason
    assert "capability unknown" in policy_kernels(torch.bfloat16, False, "cuda", None).reason


def test_the_cpu_gets_no_tf32_and_leaves_attention_as_it_is():
    settings = policy_kernels(torch.float32, False, "cpu", None)
    assert settings == KernelSettings(False, (), settings.reason)
    assert "SDPA flags left as they are" in settings.reason
    assert settings.as_dict() == {"tf32": False, "sdpa_backends": [], "reason": settings.reason}


def test_apply_sets_every_flag_on_and_off_and_restore_puts_them_back():
    tf32(False)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(True)
    before = current_flags()
    previous = apply(policy_kernels(torch.bfloat16, False, "cuda", (9, 0)))
    assert previous == before
    assert current_flags() == {**cuda_kernels.tf32_wanted(True),
                               "sdpa.FLASH_ATTENTION": True, "sdpa.EFFICIENT_ATTENTION": True, "sdpa.MATH": True,
                               "sdpa.CUDNN_ATTENTION": False}
    apply(policy_kernels(torch.bfloat16, True, "cuda", (9, 0)))
    assert cuda_kernels.tf32_flags() == cuda_kernels.tf32_wanted(False) and not cuda_kernels.tf32_matmul_on()
    restore(previous)
    assert current_flags() == before


def test_the_cpu_settings_turn_tf32_off_and_touch_no_attention_flag():
    tf32(True)
    torch.backends.cuda.enable_flash_sdp(False)  # also steers the CPU's SDPA: not ours to change there
    torch.backends.cuda.enable_cudnn_sdp(True)
    apply(policy_kernels(torch.float32, False, "cpu", None))
    assert not cuda_kernels.tf32_matmul_on()
    assert torch.backends.cuda.flash_sdp_enabled() is False and torch.backends.cuda.cudnn_sdp_enabled() is True


def test_an_unknown_backend_name_is_refused():
    with pytest.raises(ValueError, match="unknown SDPA backend.*FLASH"):
        apply(KernelSettings(True, ("FLASH",), "typo"))


def test_an_upcast_policy_after_a_bf16_one_runs_without_tf32():
    """The policy's own setup (``kernels_for``, what ``PolicyModel.from_config`` calls with the base's
    device) for a CUDA device, as the GPU check runs its cases: a bf16 policy, then an upcast one, then
    fp16 on a T4-class card."""
    from homerlhf.config import load_config
    from homerlhf.models.policy import kernels_for

    def cfg(*extra):
        return load_config("cpu-tiny", overrides=["quant.load_in_4bit=true", *extra])

    cuda = torch.device("cuda", 0)
    bf16 = kernels_for(cfg("quant.compute_dtype=bf16", "quant.upcast_non_quantized=false"), cuda)
    assert bf16.tf32 and cuda_kernels.tf32_matmul_on()
    upcast = kernels_for(cfg("quant.compute_dtype=bf16", "quant.upcast_non_quantized=true"), cuda)
    assert not cuda_kernels.tf32_matmul_on() and not upcast.tf32
    assert cuda_kernels.tf32_flags() == cuda_kernels.tf32_wanted(False)
    assert torch.backends.cuda.cudnn_sdp_enabled() is False and torch.backends.cuda.flash_sdp_enabled() is True
    fp16 = kernels_for(cfg("quant.compute_dtype=fp16", "quant.upcast_non_quantized=false"), cuda)
    assert fp16.tf32 and cuda_kernels.tf32_matmul_on()


def test_a_policy_records_what_it_set(tiny_llama_dir):
    from homerlhf.config import load_config
    from homerlhf.models.policy import PolicyModel

    tf32(True)  # left by an earlier CUDA policy in this process
    policy = PolicyModel.from_config(load_config("cpu-tiny"), str(tiny_llama_dir))
    assert not cuda_kernels.tf32_matmul_on()
    assert policy.kernel_settings == cuda_kernels.policy_kernels(torch.float32, True, "cpu", None)


@pytest.mark.skipif(not cuda_kernels.NEW_TF32_API, reason="torch < 2.9 has no fp32_precision API")
def test_a_policy_builds_after_something_set_tf32_through_the_new_api(tiny_llama_dir):
    """transformers' ``enable_tf32`` (``TrainingArguments(tf32=True)``), or a notebook following PyTorch's
    docs, sets ``torch.backends.fp32_precision``; torch >= 2.9 then raises on any read of the legacy
    ``allow_tf32`` flags. Policies built after it read and set TF32 through the new API, and put it back."""
    from homerlhf.config import load_config
    from homerlhf.models.policy import PolicyModel, kernels_for

    # As in a fresh process: matmul precision "highest" (a library may have set "high", which a legacy
    # read then agrees with) and no backend holding a precision of its own (an earlier test in this process
    # may have set one, and the global setting then no longer reaches it), so the global one reaches them all.
    torch.set_float32_matmul_precision("highest")
    for backend in (torch.backends.cudnn, torch.backends.mkldnn,  # the backend levels, then their operations'
                    torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn,
                    torch.backends.mkldnn.matmul, torch.backends.mkldnn.conv, torch.backends.mkldnn.rnn):
        backend.fp32_precision = "none"
    torch.backends.fp32_precision = "tf32"
    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
        _ = torch.backends.cuda.matmul.allow_tf32  # what a legacy read meets now
    before = current_flags()
    policy = PolicyModel.from_config(load_config("cpu-tiny"), str(tiny_llama_dir))
    assert policy.kernel_settings.tf32 is False and not cuda_kernels.tf32_matmul_on()
    bf16 = load_config("cpu-tiny", overrides=["quant.load_in_4bit=true", "quant.compute_dtype=bf16",
                                              "quant.upcast_non_quantized=false"])
    assert kernels_for(bf16, torch.device("cuda", 0)).tf32  # a CUDA bf16 policy's setup, as on a card
    assert cuda_kernels.tf32_matmul_on() and torch.backends.cudnn.conv.fp32_precision == "tf32"
    restore(before)
    assert current_flags() == before


def test_the_measured_kernels_say_what_is_not_known():
    text = cuda_kernels.MEASURED_KERNELS
    assert "H200" in text and "2026-12-04" in text and "2026-11-30" in text and "not recorded" in text
