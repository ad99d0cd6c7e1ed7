"""The asynchronous mode's experience buffer: one pending batch, on disk as safetensors + json (no
pickle), read back exactly; copied into a checkpoint and restored from it; empty after a take."""

from __future__ import annotations

import json

import pytest
import torch

from homerlhf.ppo.buffer import META, TENSORS, ExperienceBuffer, PendingBatch, load_pending
from homerlhf.ppo.rollout import RolloutBatch


def _pending(with_ref=True) -> PendingBatch:
    g = torch.Generator().manual_seed(0)
    batch = RolloutBatch(
        prompt_ids=torch.tensor([[0, 5, 6], [7, 8, 9]]), prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
        response_ids=torch.tensor([[11, 2, 0], [12, 13, 14]]), response_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]),
        truncated=torch.tensor([False, True]), behaviour_logprobs=-torch.rand(2, 3, generator=g))
    return PendingBatch(iteration=3, indices=[4, 1], batch=batch, policy_version=torch.tensor([1, 1]),
                        raw_scores=torch.tensor([0.25, -1.5]),
                        ref_logprobs=-torch.rand(2, 3, generator=g) if with_ref else None,
                        components={"length": [2.0, None]})


def _assert_same(a: PendingBatch, b: PendingBatch) -> None:
    assert (a.iteration, a.indices, a.components) == (b.iteration, b.indices, b.components)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "truncated", "behaviour_logprobs"):
        x, y = getattr(a.batch, name), getattr(b.batch, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert torch.equal(a.policy_version, b.policy_version) and torch.equal(a.raw_scores, b.raw_scores)
    assert (a.ref_logprobs is None) == (b.ref_logprobs is None)
    if a.ref_logprobs is not None:
        assert torch.equal(a.ref_logprobs, b.ref_logprobs)


@pytest.mark.parametrize("with_ref", [True, False])
def test_on_disk_round_trip_is_exact_and_take_empties_it(tmp_path, with_ref):
    buffer = ExperienceBuffer(tmp_path / "buffer")
    assert buffer.take() is None
    pending = _pending(with_ref)
    buffer.put(pending)
    assert sorted(p.name for p in (tmp_path / "buffer").iterdir()) == [META, TENSORS]  # no pickle anywhere
    assert json.loads((tmp_path / "buffer" / META).read_text())["indices"] == [4, 1]
    _assert_same(pending, buffer.take())
    assert buffer.take() is None and not list((tmp_path / "buffer").iterdir())


def test_holds_one_batch_the_newest(tmp_path):
    buffer = ExperienceBuffer(tmp_path / "buffer")
    first, second = _pending(), _pending()
    second.iteration, second.indices = 4, [0, 2]
    buffer.put(first)
    buffer.put(second)
    _assert_same(second, buffer.take())
    assert buffer.take() is None


def test_checkpoint_copy_and_restore(tmp_path):
    buffer = ExperienceBuffer(tmp_path / "run" / "buffer")
    pending = _pending()
    buffer.put(pending)
    buffer.copy_to(tmp_path / "ckpt" / "buffer")
    buffer.clear()
    buffer.put(_pending(with_ref=False))  # what a killed run left behind: replaced by the checkpoint's
    buffer.restore_from(tmp_path / "ckpt" / "buffer")
    _assert_same(pending, buffer.take())
    buffer.restore_from(tmp_path / "nothing-here")  # a checkpoint without a batch ahead empties it
    assert buffer.take() is None


def test_in_memory_without_a_run_dir(tmp_path):
    buffer = ExperienceBuffer(None)
    pending = _pending()
    buffer.put(pending)
    buffer.copy_to(tmp_path / "ckpt")
    _assert_same(pending, load_pending(tmp_path / "ckpt"))
    assert buffer.take() is pending and buffer.take() is None


def test_a_half_written_batch_is_no_batch(tmp_path):
    buffer = ExperienceBuffer(tmp_path / "buffer")
    buffer.put(_pending())
    (tmp_path / "buffer" / META).unlink()  # a crash between the tensors and the json
    assert buffer.take() is None
