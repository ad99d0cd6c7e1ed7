"""Chunked log-probs equal the one-piece computation, values and gradients; entropy by hand."""

from __future__ import annotations

import math

import pytest
import torch

from homerlhf.models.logprobs import (
    chunked_logprobs,
    entropy_from_logits,
    output_logit_transform,
    position_ids_from_mask,
    response_hidden,
)


def close(actual, expected, atol=1e-6):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64])
def test_chunked_equals_naive_values_entropy_and_gradients(chunk_size, naive_logprobs):
    torch.manual_seed(0)
    B, T, H, V = 3, 7, 16, 50
    lm_head = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(B, T, H, requires_grad=True)
    targets = torch.randint(0, V, (B, T))

    logprobs, entropy = chunked_logprobs(lm_head, hidden, targets, chunk_size)
    (logprobs * torch.arange(T)).sum().backward()
    grad_chunked = hidden.grad.clone()
    hidden.grad = None

    logits = lm_head(hidden)
    naive = naive_logprobs(logits, targets)
    (naive * torch.arange(T)).sum().backward()
    p = torch.softmax(logits, -1)
    naive_entropy = -(p * torch.log_softmax(logits, -1)).sum(-1)

    torch.testing.assert_close(logprobs, naive, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, naive_entropy.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(grad_chunked, hidden.grad, atol=1e-5, rtol=0)
    assert not entropy.requires_grad  # a metric, never a loss term


def test_position_ids_skip_left_padding_and_response_hidden_alignment():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]
    hidden = torch.arange(5.0).view(1, 5, 1)  # positions 0..4; prompt P=3, response T=2
    # Response token 0 (position 3) is predicted by position 2, token 1 by position 3.
    assert response_hidden(hidden, 2).flatten().tolist() == [2.0, 3.0]


def test_bad_chunk_size():
    with pytest.raises(ValueError):
        chunked_logprobs(torch.nn.Identity(), torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), 0)


def test_entropy_from_logits_by_hand():
    logits = torch.tensor(
        [
            [[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -math.inf, -math.inf]],
            [[0.0, -math.inf, 0.0, -math.inf], [1000.0, 0.0, 0.0, 0.0]],
        ],
        dtype=torch.float64,
    )
    # uniform over 4: ln 4 = 1.3862943611
    # p = [1/4, 3/4]: 0.25*ln 4 + 0.75*ln(4/3) = 0.3465735903 + 0.2157615544 = 0.5623351447
    # uniform over 2 (two -inf): ln 2 = 0.6931471806
    # one logit 1000 above the rest: p ~ [1, 3e-435...] -> 0 (and no nan from exp overflow)
    h = entropy_from_logits(logits)
    assert h.shape == (2, 2)
    close(h, [[1.3862943611, 0.5623351447], [0.6931471806, 0.0]])


def test_entropy_from_logits_upcasts_16_bit():
    h = entropy_from_logits(torch.zeros(3, 8, dtype=torch.bfloat16))
    assert h.dtype == torch.float32
    close(h, [math.log(8.0)] * 3)


def test_temperature_and_softcap_by_hand():
    """logits z = (2, 0, -1), softcap c = 1, temperature T = 0.5:
    tanh(z / c) * c / T = (1.92806, 0, -1.52319); logsumexp = log(6.8759 + 1 + 0.2180) = 2.09114,
    so log p = (-0.16309, -2.09114, -3.61433). Without the cap: z / T = (4, 0, -2),
    log p = (-0.02058, -4.02058, -6.02058)."""
    from transformers import Gemma2Config

    lm_head = torch.nn.Identity()
    hidden = torch.tensor([[[2.0, 0.0, -1.0]] * 3])  # (1, 3, 3): one position per target
    targets = torch.tensor([[0, 1, 2]])
    cap = output_logit_transform(Gemma2Config(final_logit_softcapping=1.0))
    capped, _ = chunked_logprobs(lm_head, hidden, targets, 2, temperature=0.5, transform=cap)
    torch.testing.assert_close(capped, torch.tensor([[-0.16309, -2.09114, -3.61433]]), atol=1e-5, rtol=0)
    plain, _ = chunked_logprobs(lm_head, hidden, targets, 2, temperature=0.5)
    torch.testing.assert_close(plain, torch.tensor([[-0.02058, -4.02058, -6.02058]]), atol=1e-5, rtol=0)


def test_temperature_gradient_matches_the_one_piece_computation(naive_logprobs):
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(8, 20, bias=False)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    targets = torch.randint(0, 20, (2, 5))
    logprobs, entropy = chunked_logprobs(lm_head, hidden, targets, 2, temperature=0.7)
    logprobs.sum().backward()
    grad, hidden.grad = hidden.grad.clone(), None
    logits = lm_head(hidden) / 0.7
    naive = naive_logprobs(logits, targets)
    naive.sum().backward()
    torch.testing.assert_close(logprobs, naive, atol=1e-5, rtol=0)
    torch.testing.assert_close(grad, hidden.grad, atol=1e-5, rtol=0)
    p = torch.softmax(logits, -1)  # entropy of the distribution that is sampled: the tempered one
    torch.testing.assert_close(entropy, -(p * torch.log(p)).sum(-1).detach(), atol=1e-5, rtol=0)


def _tiny(arch: str):
    """A tiny full-precision LM whose ``forward`` post-processes its logits, with a strong setting."""
    from transformers import AutoModelForCausalLM, CohereConfig, GraniteConfig

    shape = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1)
    config = {"cohere": lambda: CohereConfig(**shape, logit_scale=4.0),
              "granite": lambda: GraniteConfig(**shape, logits_scaling=0.25)}[arch]()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("arch", ["cohere", "granite"])
def test_output_logit_transform_is_what_the_model_forward_does(arch, naive_logprobs):
    model = _tiny(arch)
    ids = torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        hidden = getattr(model, model.base_model_prefix)(input_ids=ids).last_hidden_state
        ours, _ = chunked_logprobs(model.get_output_embeddings(), hidden[:, :-1], ids[:, 1:], 4,
                                   transform=output_logit_transform(model.config))
        raw, _ = chunked_logprobs(model.get_output_embeddings(), hidden[:, :-1], ids[:, 1:], 4)
        hf = naive_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])
    torch.testing.assert_close(ours, hf, atol=1e-5, rtol=0)
    assert (raw - hf).abs().max() > 1e-2  # the transform matters at this setting


def test_no_transform_for_plain_models():
    from transformers import Gemma2Config, LlamaConfig, Qwen3Config

    assert output_logit_transform(LlamaConfig()) is None
    assert output_logit_transform(Qwen3Config()) is None
    assert output_logit_transform(Gemma2Config(final_logit_softcapping=None)) is None
