"""Experience: padding-aware concatenation, trimming, seeded mini-batches, no graphs."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from homerlhf.ppo.experience import Experience

PAD = 0


def _exp(prompts, responses, offset=0.0):
    """Build an experience from ragged lists; float fields are position-coded so moves are visible."""
    P, T = max(map(len, prompts)), max(map(len, responses))
    B = len(prompts)
    p_ids = torch.tensor([[PAD] * (P - len(p)) + p for p in prompts])
    p_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    r_ids = torch.tensor([r + [PAD] * (T - len(r)) for r in responses])
    r_mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in responses])
    lp = (torch.arange(B * T, dtype=torch.float32).view(B, T) + offset) * r_mask
    return Experience(p_ids, p_mask, r_ids, r_mask, lp, lp.clone(), lp.clone(),
                      scores=torch.arange(B, dtype=torch.float32) + offset, truncated=torch.zeros(B, dtype=torch.bool))


def test_cat_pads_prompts_left_and_responses_right():
    a = _exp([[5, 6]], [[7]])
    b = _exp([[8], [9, 10, 11]], [[12, 13, 14], [15]], offset=100.0)
    both = Experience.cat([a, b], PAD)
    assert both.prompt_ids.tolist() == [[0, 5, 6], [0, 0, 8], [9, 10, 11]]
    assert both.prompt_mask.tolist() == [[0, 1, 1], [0, 0, 1], [1, 1, 1]]
    assert both.response_ids.tolist() == [[7, 0, 0], [12, 13, 14], [15, 0, 0]]
    assert both.response_mask.tolist() == [[1, 0, 0], [1, 1, 1], [1, 0, 0]]
    assert both.old_logprobs.tolist() == [[0, 0, 0], [100, 101, 102], [103, 0, 0]]
    assert both.scores.tolist() == [0, 100, 101]
    assert both.rewards is None


def test_trimmed_drops_all_padding_columns_only():
    exp = _exp([[5, 6], [8]], [[7], [12, 13]])
    wide = Experience.cat([exp, _exp([[1, 2, 3, 4]], [[1, 2, 3, 4]])], PAD).select(torch.tensor([0, 1]))
    assert wide.prompt_ids.shape[1] == 4 and wide.response_ids.shape[1] == 4
    trimmed = wide.trimmed()
    assert trimmed.prompt_ids.tolist() == [[5, 6], [0, 8]]
    assert trimmed.response_ids.tolist() == [[7, 0], [12, 13]]
    assert trimmed.old_logprobs.shape == (2, 2)


def test_minibatches_cover_every_row_once_and_are_seeded():
    exp = _exp([[i + 1] for i in range(10)], [[i + 1] * (1 + i % 3) for i in range(10)])

    def rows(seed):
        out = []
        for mb in exp.minibatches(4, torch.Generator().manual_seed(seed)):
            assert len(mb) <= 4
            out.extend(int(s) for s in mb.scores)
        return out

    assert sorted(rows(0)) == list(range(10))
    assert rows(0) == rows(0)
    assert rows(0) != rows(1)
    assert [len(m) for m in exp.split(4)] == [4, 4, 2]


def test_no_graphs_are_kept():
    w = torch.ones(1, requires_grad=True)
    exp = _exp([[1]], [[2, 3]])
    exp = Experience(**{**exp.__dict__, "values": exp.values * w})
    assert not exp.values.requires_grad and exp.values.grad_fn is None


# -- one device ------------------------------------------------------------------------------------
# On a GPU every run died at its first update: policy_version was made on the CPU beside CUDA
# fields, and select moved its index to prompt_ids' device. ``meta`` stands in for the second device.
def test_building_an_experience_on_two_devices_names_the_fields_and_their_devices():
    exp = _exp([[1], [2]], [[3], [4, 5]])
    with pytest.raises(ValueError) as info:
        Experience(**{**exp.__dict__, "policy_version": torch.zeros(2, dtype=torch.long, device="meta")})
    message = str(info.value)
    assert "policy_version on meta" in message and "prompt_ids, prompt_mask" in message and "on cpu" in message
    assert "\n" not in message


def test_a_field_set_on_another_device_is_refused_and_one_on_the_same_taken():
    exp = _exp([[1], [2]], [[3], [4, 5]])
    exp.policy_version = torch.tensor([2, 3])
    with pytest.raises(ValueError, match="policy_version on meta"):
        exp.policy_version = torch.zeros(2, dtype=torch.long, device="meta")


def test_select_takes_a_cpu_index_for_an_experience_elsewhere():
    exp = _exp([[1], [2], [3]], [[4], [5, 6], [7]]).to("meta")
    assert exp.device == torch.device("meta")
    picked = exp.select(torch.tensor([2, 0]))
    assert picked.device == torch.device("meta") and picked.prompt_ids.shape == (2, 1)
    assert {getattr(picked, f.name).device.type for f in fields(picked) if getattr(picked, f.name) is not None} == {"meta"}
