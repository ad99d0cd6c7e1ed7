"""Rollout: left-padded prompts, response masks up to EOS, truncation flag and penalty."""

from __future__ import annotations

import pytest
import torch

from homerlhf.config import load_config
from homerlhf.ppo.rollout import (
    RolloutBatch,
    apply_truncation_penalty,
    generate_rollout,
    pad_sequences,
    response_mask_and_truncated,
)

EOS = 1


def test_pad_sequences_left_by_default():
    ids, mask = pad_sequences([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_pad_sequences_right_and_empty_rows():
    ids, mask = pad_sequences([[8], [], [5, 6, 7]], pad_id=2, side="right")
    assert ids.tolist() == [[8, 2, 2], [2, 2, 2], [5, 6, 7]]
    assert mask.tolist() == [[1, 0, 0], [0, 0, 0], [1, 1, 1]]
    assert ids.dtype == mask.dtype == torch.long


def test_mask_runs_up_to_and_including_the_first_eos():
    response = torch.tensor([
        [9, 9, EOS, 0, 0],  # EOS at 2
        [EOS, 0, 0, 0, 0],  # EOS first
        [9, 9, 9, 9, 9],  # no EOS: truncated
        [9, EOS, 9, EOS, 0],  # only the first EOS counts
    ])
    mask, truncated = response_mask_and_truncated(response, EOS)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert truncated.tolist() == [False, False, True, False]


def test_truncation_penalty_replaces_only_truncated_scores():
    batch = RolloutBatch(torch.zeros(3, 1), torch.ones(3, 1), torch.zeros(3, 2), torch.ones(3, 2),
                         torch.tensor([False, True, False]))
    scores = torch.tensor([0.5, 0.7, -0.2])
    cfg = load_config("cpu-tiny", overrides=["rollout.truncation_penalty=-1.5"])
    assert apply_truncation_penalty(scores, batch, cfg.rollout).tolist() == pytest.approx([0.5, -1.5, -0.2])
    off = load_config("cpu-tiny")
    assert apply_truncation_penalty(scores, batch, off.rollout).tolist() == pytest.approx([0.5, 0.7, -0.2])


@pytest.fixture(scope="module")
def policy(tiny_llama_dir):
    from homerlhf.models.policy import PolicyModel

    cfg = load_config("cpu-tiny", overrides=["ref.backend=adapter_off", "reward.backend=hf"])
    return PolicyModel.from_config(cfg, str(tiny_llama_dir))


def test_generate_rollout_layout(policy):
    cfg = load_config("cpu-tiny", overrides=[
        "ref.backend=adapter_off", "reward.backend=hf", "rollout.max_new_tokens=6", "rollout.max_prompt_len=4"])
    prompts = [[4, 300, 301, 302, 20, 1, 6], [4, 6]]
    torch.manual_seed(0)
    batch = generate_rollout(policy, prompts, cfg.rollout)
    pad = policy.tokenizer.pad_token_id
    # Prompts left-truncated to max_prompt_len and left-padded.
    assert batch.prompt_lists() == [[302, 20, 1, 6], [4, 6]]
    assert batch.prompt_ids[1, :2].tolist() == [pad, pad]
    assert batch.response_ids.shape[1] <= 6
    for row in range(2):
        n = int(batch.response_mask[row].sum())
        tokens = batch.response_ids[row].tolist()
        assert batch.response_mask[row].tolist() == [1] * n + [0] * (len(tokens) - n)
        assert all(t == pad for t in tokens[n:])
        assert bool(batch.truncated[row]) == (EOS not in tokens[:n])
        if not batch.truncated[row]:
            assert tokens[n - 1] == EOS
        else:
            assert n == 6


def test_generate_rollout_stops_at_eos(policy):
    """Row 0's EOS logit is forced up by a hook on the LM head: it stops at once, row 1 runs on."""
    cfg = load_config("cpu-tiny", overrides=["ref.backend=adapter_off", "reward.backend=hf", "rollout.max_new_tokens=5"])

    def force_eos_row0(module, args, output):
        output = output.clone()
        output[0, :, EOS] += 1e4
        output[1, :, EOS] -= 1e4
        return output

    handle = policy.lm_head.register_forward_hook(force_eos_row0)
    try:
        batch = generate_rollout(policy, [[4, 300, 6], [4, 6]], cfg.rollout)
    finally:
        handle.remove()
    pad = policy.tokenizer.pad_token_id
    assert batch.response_ids[0].tolist() == [EOS] + [pad] * 4
    assert batch.response_mask.tolist() == [[1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert batch.truncated.tolist() == [False, True]
    assert batch.response_lists()[0] == [EOS]
