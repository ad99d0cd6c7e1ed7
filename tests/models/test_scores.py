"""One pooling rule for reward scores: the last position where the attention mask is 1."""

from __future__ import annotations

import pytest
import torch

from homerlhf.models.scores import last_real_index, score_sequences, sequence_scores
from tolerances import fp32_bound


def test_last_real_index_either_padding_side():
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    assert last_real_index(right).tolist() == [2, 4, 0]
    assert last_real_index(left).tolist() == [4, 4, 4]


@pytest.fixture(scope="module")
def pad_is_eos_classifier(tmp_path_factory):
    """A tiny Llama reward model whose pad id is its eos id (1), as Llama-3's is."""
    from transformers import AutoModelForSequenceClassification

    from homerlhf.tiny import build_sequence_classifier

    path = build_sequence_classifier(tmp_path_factory.mktemp("rm-pad-eos"), arch="llama", seed=5)
    model = AutoModelForSequenceClassification.from_pretrained(path, pad_token_id=1).eval()
    assert model.config.pad_token_id == 1
    return model


def _alone(model, ids: list[int]) -> float:
    """The independent reading: one unpadded sequence, score head on its last hidden state."""
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state  # (1, T, H)
        return model.score(hidden[0, -1]).item()


def test_scores_read_the_last_real_token_when_pad_is_eos(pad_is_eos_classifier):
    model = pad_is_eos_classifier
    # Sequences ending with eos (= pad), one with an eos mid-sequence too (a Llama-3 prompt's turn end).
    seqs = [[5, 9, 33, 1], [5, 40, 1, 17, 1], [7, 8, 9, 10, 11, 12, 1]]
    want = torch.tensor([_alone(model, s) for s in seqs])
    for batch_size in (1, 3):
        torch.testing.assert_close(score_sequences(model, seqs, pad_id=1, batch_size=batch_size), want,
                                   atol=fp32_bound(want.abs().max()), rtol=0)
    # Left padding with the same ids: the same scores.
    width = max(map(len, seqs))
    ids = torch.tensor([[1] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    with torch.no_grad():
        torch.testing.assert_close(sequence_scores(model, ids, mask), want, atol=fp32_bound(want.abs().max()), rtol=0)
        # HF's own pooling (the last id that is not the pad id) reads another token here: what this
        # rule exists for. One sequence, no padding at all, and still not the last token's score.
        hf = model(input_ids=torch.tensor([seqs[0]])).logits[0, 0].item()
    assert abs(hf - want[0].item()) > 1e-3
    assert hf == pytest.approx(_alone(model, seqs[0][:-1]), abs=fp32_bound(hf))  # it read the token before eos


def test_peft_wrapped_classifier_scores_through_its_adapter_and_head(pad_is_eos_classifier):
    import copy

    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(pad_is_eos_classifier),
                           LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
            if "modules_to_save" in name and "score" in name:
                param.mul_(2.0)
    model.eval()
    seq = [5, 9, 33, 1]
    merged = copy.deepcopy(model).merge_and_unload()
    got = score_sequences(model, [seq], pad_id=1)
    want = torch.tensor([_alone(merged, seq)])  # the merged weight: another summation order
    torch.testing.assert_close(got, want, atol=fp32_bound(want.abs().max()), rtol=0)
    assert abs(got.item() - _alone(pad_is_eos_classifier, seq)) > 1e-3  # the adapter and head count


def test_length_groups_cover_every_row_once_with_only_the_columns_they_use():
    from homerlhf.models.scores import by_length_groups

    # Right padding, real lengths 3, 1, 5, 2, 4, 1 (width 5); groups of 2 rows by length.
    lengths = [3, 1, 5, 2, 4, 1]
    mask = torch.tensor([[1] * n + [0] * (5 - n) for n in lengths])
    groups = by_length_groups(mask, rows=2)
    assert [idx.tolist() for idx, _ in groups] == [[1, 5], [3, 0], [4, 2]]
    assert [(cols.start, cols.stop) for _, cols in groups] == [(0, 1), (0, 3), (0, 5)]
    # Left padding: the used columns sit at the right end.
    left = mask.flip(-1)
    assert [(cols.start, cols.stop) for _, cols in by_length_groups(left, rows=2)] == [(4, 5), (2, 5), (0, 5)]
    assert len(by_length_groups(mask, rows=16)) == 1  # fewer rows than a group: one pass


@pytest.mark.parametrize("side", ["right", "left"])
def test_grouped_scores_and_their_gradients_match_one_padded_pass(pad_is_eos_classifier, side):
    import copy

    from homerlhf.models.scores import grouped_sequence_scores

    torch.manual_seed(0)
    lengths = [9, 3, 14, 5, 11, 4, 7, 2]
    width = max(lengths)
    rows = [torch.randint(2, 60, (n,)).tolist() for n in lengths]
    pad = [[1] * (width - len(r)) for r in rows]
    ids = torch.tensor([r + p if side == "right" else p + r for r, p in zip(rows, pad)])
    mask = torch.tensor([[1] * len(r) + [0] * len(p) if side == "right" else [0] * len(p) + [1] * len(r)
                         for r, p in zip(rows, pad)])
    weights = torch.linspace(-1.0, 1.0, len(rows))  # a loss that weighs every row differently
    results = []
    for score in (sequence_scores, lambda m, i, a: grouped_sequence_scores(m, i, a, rows=2)):
        model = copy.deepcopy(pad_is_eos_classifier)
        scores = score(model, ids, mask)
        (scores * weights).sum().backward()
        results.append((scores.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    # Other batch shapes (tests/tolerances.py); a gradient sums over every real token of the rows too.
    torch.testing.assert_close(got, want, atol=fp32_bound(want.abs().max()), rtol=0)
    torch.testing.assert_close(got, torch.tensor([_alone(pad_is_eos_classifier, r) for r in rows]),
                               atol=fp32_bound(want.abs().max()), rtol=0)
    tokens = sum(lengths)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=fp32_bound(grad.abs().max(), 384 * tokens), rtol=0,
                                   msg=name)


def test_score_sequences_returns_scores_in_input_order_whatever_the_batching(pad_is_eos_classifier):
    model = pad_is_eos_classifier
    seqs = [[5, 9, 33, 40, 41, 1], [5, 1], [7, 8, 9, 10, 11, 12, 13, 1], [6, 7, 1], [9, 9, 9, 9, 1]]
    want = torch.tensor([_alone(model, s) for s in seqs])
    for batch_size in (1, 2, 5):
        torch.testing.assert_close(score_sequences(model, seqs, pad_id=1, batch_size=batch_size), want,
                                   atol=fp32_bound(want.abs().max()), rtol=0)
