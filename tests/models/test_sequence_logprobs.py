"""Log-probs of given sequences without the full logits equal those of ``log_softmax(model(ids).logits)``."""

from __future__ import annotations

import pytest
import torch

from homerlhf.models.sequence_logprobs import answer_logprobs, token_logprobs

SEQUENCES = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]
STARTS = [3, 1, 4]  # each answer's first token; position start - 1 predicts it


def _full_logprobs(model, seq: list[int]) -> torch.Tensor:
    """The slow way, one unpadded sequence, fp64: log p(seq[t] | seq[:t]) for t >= 1 from the model's logits."""
    ids = torch.tensor([seq])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]


def _bound(model, seq: list[int]) -> float:
    """An error bound on one log-prob: the fp32 logits of our head matmul and the model's differ by the order of
    their sums, at most 2 H eps32 max_v sum_i |w_vi h_i| each (the decoder's hidden states are the same
    computation); a log-softmax moves by at most twice a logit's error; 10x margin."""
    decoder = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        hidden = decoder(input_ids=torch.tensor([seq])).last_hidden_state[0]
        products = (hidden.abs() @ head.abs().t()).max().item()
    return 10 * 2 * (2 * head.shape[1] * torch.finfo(torch.float32).eps * products)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: the final logit soft-cap applies
def test_a_padded_batch_in_chunks_equals_each_sequence_alone(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    from homerlhf.tiny import build_causal_lm

    model = AutoModelForCausalLM.from_pretrained(build_causal_lm(tmp_path, arch=arch, seed=2, hidden=32, layers=2),
                                                 dtype=torch.float32).eval()
    got = answer_logprobs(model, SEQUENCES, STARTS, pad_id=0, chunk_tokens=3)  # chunks cross the rows
    for seq, start, mine in zip(SEQUENCES, STARTS, got):
        expected = _full_logprobs(model, seq)[start - 1:]
        assert mine.dtype == torch.float32 and mine.shape == expected.shape
        torch.testing.assert_close(mine.double(), expected, atol=_bound(model, seq), rtol=0)
    whole = answer_logprobs(model, SEQUENCES[:1], [1], 0, chunk_tokens=64, dtype=torch.float64)[0]
    torch.testing.assert_close(whole, _full_logprobs(model, SEQUENCES[0]), atol=_bound(model, SEQUENCES[0]), rtol=0)


def test_a_peft_model_runs_its_active_adapter(tiny_llama_dir):
    """On a peft model the LoRA sits in the decoder: its active adapter is what runs, and with the adapters
    off, the base (the held-out pass scores the reference and the trained policy this way)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)).eval()
    seq = SEQUENCES[0]
    lora = answer_logprobs(model, [seq], [1], 0, 4)[0]
    with model.disable_adapter():
        plain = answer_logprobs(model, [seq], [1], 0, 4)[0]
        expected_plain = _full_logprobs(model, seq)
    bound = _bound(model.get_base_model(), seq)
    torch.testing.assert_close(plain.double(), expected_plain, atol=bound, rtol=0)
    assert (lora.double() - expected_plain).abs().max() > 100 * bound  # the adapter changed them: it ran
    torch.testing.assert_close(lora.double(), _full_logprobs(model, seq), atol=bound, rtol=0)


def test_token_logprobs_by_hand():
    """Two positions over a vocabulary of 3: logits (0, ln 2, ln 3) and (0, 0, 0), an identity head:
    log p = logit - ln(1 + 2 + 3) = ln 3 - ln 6 = -ln 2 for target 2, and -ln 3 for target 0."""
    head = torch.nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(3))
    hidden = torch.tensor([[0.0, torch.log(torch.tensor(2.0)), torch.log(torch.tensor(3.0))], [0.0, 0.0, 0.0]])
    got = token_logprobs(head, hidden, torch.tensor([2, 0]), chunk_tokens=1, dtype=torch.float64)
    torch.testing.assert_close(got, -torch.log(torch.tensor([2.0, 3.0], dtype=torch.float64)), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        token_logprobs(head, hidden, torch.tensor([2, 0]), chunk_tokens=0)
    with pytest.raises(ValueError, match="start"):
        answer_logprobs(torch.nn.Linear(1, 1), [[1, 2]], [0], 0, 4)
