"""Dynamic micro-batching: an injected OOM halves the micro-batch and the step ends where an
un-split step would, with LoRA weights equal to 1e-5."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from homerlhf.errors import UserError
from homerlhf.memory.oom import (
    OutOfMemoryAtMicroBatch1,
    SimulatedOOM,
    inject_oom_at,
    is_oom,
    maybe_raise,
    run_with_backoff,
)


def _lora_model(seed: int = 0) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = nn.Sequential()
    base.add_module("up", nn.Linear(12, 24))
    base.add_module("act", nn.Tanh())
    base.add_module("down", nn.Linear(24, 1))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"], init_lora_weights=False))
    return model


def _make_step(model, optimizer, x, y, calls):
    """One phase over the whole mini-batch (x: (N, 12), y: (N, 1)) in micro-batches of ``size``."""

    def step(size: int) -> float:
        calls.append(size)
        optimizer.zero_grad(set_to_none=True)  # the contract: a retry starts from clean gradients
        total = 0.0
        for start in range(0, len(x), size):
            xb, yb = x[start : start + size], y[start : start + size]
            # Per-sample mean over the mini-batch: each micro-batch's loss weighted by its share.
            loss = ((model(xb) - yb) ** 2).mean() * len(xb) / len(x)
            loss.backward()
            total += loss.item()
            # The fault comes *after* a backward, so the failed try leaves partial gradients behind.
            maybe_raise(size)
        return total

    return step


def _train(inject: bool, start_mbs: int):
    model = _lora_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 12, generator=g), torch.randn(16, 1, generator=g)
    calls, retries = [], []
    step = _make_step(model, optimizer, x, y, calls)
    if inject:
        with inject_oom_at(micro_batch_size=8, times=1) as injector:
            loss = run_with_backoff(step, start_mbs, on_retry=lambda o, n, e: retries.append((o, n, type(e))))
        assert injector.raised == [start_mbs]
    else:
        loss = run_with_backoff(step, start_mbs)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer.step()
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    return loss, grads, lora, calls, retries


def test_injected_oom_halves_and_matches_unsplit_step():
    ref_loss, ref_grads, ref_lora, ref_calls, _ = _train(inject=False, start_mbs=16)
    loss, grads, lora, calls, retries = _train(inject=True, start_mbs=8)
    assert ref_calls == [16]
    assert calls == [8, 4]  # failed once at 8, finished with 4
    assert retries == [(8, 4, SimulatedOOM)]
    assert loss == pytest.approx(ref_loss, abs=1e-6)
    assert set(lora) == set(ref_lora) and len(lora) == 4
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=0)
    for name in ref_lora:
        torch.testing.assert_close(lora[name], ref_lora[name], atol=1e-5, rtol=0)
    # The step really changed the LoRA weights (the comparison is not between two no-ops).
    fresh = {n: p for n, p in _lora_model().named_parameters() if "lora_" in n}
    assert any((lora[n] - fresh[n]).abs().max() > 1e-4 for n in lora)


def test_two_faults_go_down_twice():
    calls = []
    with inject_oom_at(micro_batch_size=2, times=2):
        out = run_with_backoff(lambda n: (calls.append(n), maybe_raise(n), n)[-1], 8)
    assert calls == [8, 4, 2] and out == 2


def test_oom_at_one_is_a_clear_user_error():
    def step(n):
        raise SimulatedOOM("boom")

    with pytest.raises(OutOfMemoryAtMicroBatch1) as info:
        run_with_backoff(step, 2, phase="update")
    assert isinstance(info.value, UserError)
    msg = str(info.value)
    assert "micro_batch_size=1" in msg and "update" in msg and "gradient_checkpointing" in msg
    assert "\n" not in msg
    assert isinstance(info.value.__cause__, SimulatedOOM)


def test_other_errors_pass_through_without_retry():
    calls = []

    def step(n):
        calls.append(n)
        raise ValueError("not memory")

    with pytest.raises(ValueError):
        run_with_backoff(step, 8)
    assert calls == [8]


def test_is_oom_and_injector_scope():
    assert is_oom(SimulatedOOM("x"))
    assert is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(torch.cuda.OutOfMemoryError("x"))
    assert not is_oom(RuntimeError("shape mismatch"))
    # cuBLAS / cuDNN failing to allocate raise a plain RuntimeError naming the status (torch's checks).
    assert is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert is_oom(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert not is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx`"))
    maybe_raise(1024)  # no injector active: nothing happens
    with inject_oom_at(micro_batch_size=8) as inj:
        maybe_raise(4)  # below the threshold
        with pytest.raises(SimulatedOOM):
            maybe_raise(16)
        maybe_raise(16)  # times=1 is used up
    assert inj.raised == [16]
