"""fp32 logits from a 16-bit LM head: the exact products summed in fp32, gradients through them, and
the one head every reader of logits goes through."""

from __future__ import annotations

import pytest
import torch

from homerlhf.models.lm_head import Fp32LogitsLinear, fp32_logits, install_fp32_logits


def _peaked(dtype):
    """Hidden states (2, 5, 64) and a head (300, 64) in ``dtype`` whose logits reach ~+-40, as a trained
    LM's do; float64 products of the same 16-bit values are the exact reference."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 64, generator=g).to(dtype)
    weight = (torch.randn(300, 64, generator=g) * 0.8).to(dtype)
    return hidden, weight, hidden.double() @ weight.double().t()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logits_are_the_exact_products_summed_in_fp32(dtype, monkeypatch):
    import homerlhf.models.lm_head as lm_head

    hidden, weight, exact = _peaked(dtype)
    assert exact.abs().max() > 20
    logits = fp32_logits(hidden, weight)
    assert logits.dtype == torch.float32 and logits.shape == (2, 5, 300)
    # fp32 rounding of a 64-term sum: ~1e-6 relative; the 16-bit head's own output is off by its ulp.
    assert (logits.double() - exact).abs().max() <= 2e-6 * exact.abs().max()
    rounded = torch.nn.functional.linear(hidden, weight).double()
    assert (rounded - exact).abs().max() > 1e-4 * exact.abs().max()  # bf16: ~3e-3, fp16: ~3e-4
    # Blocks of 7 rows of the head at a time (no fp32 copy of the whole head): the same sums.
    monkeypatch.setattr(lm_head, "BLOCK_ELEMENTS", 7 * 64)
    torch.testing.assert_close(fp32_logits(hidden, weight), logits, atol=1e-5, rtol=0)


def test_gradients_flow_to_the_hidden_states_and_a_trainable_head():
    hidden, weight, _ = _peaked(torch.bfloat16)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    upstream = torch.randn(2, 5, 300, generator=torch.Generator().manual_seed(1))
    (fp32_logits(hidden, weight) * upstream).sum().backward()
    want_hidden = upstream.double() @ weight.detach().double()
    want_weight = upstream.reshape(-1, 300).double().t() @ hidden.detach().reshape(-1, 64).double()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    # Backward runs in the head's dtype, as an autocast GEMM would: bf16 rounding of the upstream gradient.
    torch.testing.assert_close(hidden.grad.double(), want_hidden, atol=0.05 * want_hidden.abs().max().item(), rtol=0)
    torch.testing.assert_close(weight.grad.double(), want_weight, atol=0.05 * want_weight.abs().max().item(), rtol=0)


def test_an_fp32_head_is_a_plain_linear_and_other_heads_are_left_alone():
    hidden, weight, _ = _peaked(torch.float32)
    assert torch.equal(fp32_logits(hidden, weight), torch.nn.functional.linear(hidden, weight))

    class Model(torch.nn.Module):
        def __init__(self, head):
            super().__init__()
            self.head = head

        def get_output_embeddings(self):
            return self.head

    linear = torch.nn.Linear(64, 300, bias=False, dtype=torch.bfloat16)
    assert install_fp32_logits(Model(linear)) and type(linear) is Fp32LogitsLinear
    assert linear(hidden.bfloat16()).dtype == torch.float32
    assert list(linear.state_dict()) == ["weight"]  # same parameters, same names
    other = torch.nn.Embedding(300, 64)
    assert not install_fp32_logits(Model(other)) and type(other) is torch.nn.Embedding
