"""Data-parallel helpers: hand-derived sums and counts, shards, the global mini-batch permutation,
and the real all-reduce over two gloo processes."""

from __future__ import annotations

import socket

import pytest
import torch

from homerlhf.errors import UserError
from homerlhf.ppo.distributed import (
    SINGLE, Ranks, check_data_parallel, collective_device, flat_grads, global_batch_moments, global_masked_whiten, global_mean,
    masked_centered_square_sum, masked_sum_count, merge_rows, owned_minibatch_rows, set_flat_grads, shard_bounds,
)
from homerlhf.ppo.experience import Experience
from homerlhf.ppo.math import masked_whiten
from homerlhf.ppo.running import RunningMoments


def test_shard_bounds_are_contiguous_and_even():
    assert [shard_bounds(8, r, 2) for r in range(2)] == [(0, 4), (4, 8)]
    assert [shard_bounds(12, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    with pytest.raises(ValueError, match="do not split evenly"):
        shard_bounds(6, 0, 4)


def test_check_data_parallel_wants_whole_groups_per_rank():
    check_data_parallel(8, 4, 2)  # 2 groups of 4, one per rank
    check_data_parallel(6, 4, 1)  # one process: nothing to split
    with pytest.raises(UserError, match="use a multiple of 8"):
        check_data_parallel(12, 4, 2)  # 6 rows per rank: a group of 4 would straddle two ranks


def test_masked_sums_by_hand():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_sum_count(x, mask).tolist() == [6.0, 3.0]  # 1 + 2 + 3 over 3 positions
    # mean 2: (1-2)^2 + (2-2)^2 + (3-2)^2 = 2
    assert masked_centered_square_sum(x, mask, torch.tensor(2.0)).item() == 2.0


def _two_rank_reduce(calls: list[list[torch.Tensor]]):
    """A sum over two simulated ranks: rank 0 calls with its tensor; the other rank's tensor for the
    same call comes from ``calls`` (precomputed in order)."""
    it = iter(calls)
    return lambda t: t + next(it)


def test_global_whiten_of_two_shards_equals_whiten_of_the_whole():
    torch.manual_seed(0)
    x = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).long()
    whole = masked_whiten(x, mask)
    # Rank 1's contributions, in the order global_masked_whiten asks for them.
    x1, m1 = x[3:], mask[3:]
    total, count = (masked_sum_count(x[:3], mask[:3]) + masked_sum_count(x1, m1)).unbind()
    mean = total / count
    reduce = _two_rank_reduce([masked_sum_count(torch.where(m1.bool(), x1, 0.0), m1),
                               masked_centered_square_sum(x1, m1, mean)])
    part0 = global_masked_whiten(x[:3], mask[:3], reduce)
    torch.testing.assert_close(part0, whole[:3], rtol=0, atol=1e-6)


def test_global_whiten_by_hand():
    # values 1, 2, 3: mean 2, unbiased var (1 + 0 + 1) / 2 = 1 -> whitened -1, 0, 1
    out = global_masked_whiten(torch.tensor([[1.0, 2.0], [3.0, 9.0]]), torch.tensor([[1, 1], [1, 0]]))
    torch.testing.assert_close(out, torch.tensor([[-1.0, 0.0], [1.0, 0.0]]), rtol=0, atol=1e-6)


def test_global_batch_moments_merge_like_one_batch():
    # batch 1, 2, 3, 4 split 1, 2 | 3, 4: count 4, mean 2.5, m2 = 2.25 + 0.25 + 0.25 + 2.25 = 5
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    reduce = _two_rank_reduce([torch.tensor([7.0, 2.0], dtype=torch.float64),
                               ((b.double() - 2.5) ** 2).sum()])
    assert global_batch_moments(a, reduce) == (4, 2.5, 5.0)
    merged, whole = RunningMoments(), RunningMoments()
    merged.update(torch.tensor([10.0]))
    whole.update(torch.tensor([10.0]))
    merged.merge(4, 2.5, 5.0)
    whole.update(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert (merged.count, merged.mean) == (whole.count, whole.mean)
    assert merged.m2 == pytest.approx(whole.m2, rel=1e-15)
    assert global_mean(torch.tensor([1.0, 2.0]), _two_rank_reduce([torch.tensor([9.0, 1.0], dtype=torch.float64)])) \
        == 4.0  # (1 + 2 + 9) / 3


def _experience(n: int) -> Experience:
    z = torch.zeros(n, 2)
    return Experience(prompt_ids=torch.arange(n).unsqueeze(1), prompt_mask=torch.ones(n, 1, dtype=torch.long),
                      response_ids=torch.ones(n, 2, dtype=torch.long), response_mask=torch.ones(n, 2, dtype=torch.long),
                      old_logprobs=z, ref_logprobs=z, values=z, scores=torch.zeros(n), truncated=torch.zeros(n, dtype=torch.bool))


def test_owned_rows_partition_each_global_minibatch_in_its_order():
    n, size = 8, 3
    single = [mb.prompt_ids[:, 0].tolist() for mb in _experience(n).minibatches(size, torch.Generator().manual_seed(5))]
    per_rank = [list(owned_minibatch_rows(n, lo, hi, size, torch.Generator().manual_seed(5))) for lo, hi in ((0, 4), (4, 8))]
    for k, rows in enumerate(single):
        owned0, total0 = per_rank[0][k]
        owned1, total1 = per_rank[1][k]
        assert total0 == total1 == len(rows)
        assert (owned0).tolist() == [r for r in rows if r < 4]
        assert (owned1 + 4).tolist() == [r for r in rows if r >= 4]


def test_flat_grads_round_trip_with_a_missing_grad():
    a, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(3))
    a.grad = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    flat = flat_grads([a, b])
    assert flat.tolist() == [1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0]
    set_flat_grads([a, b], flat * 2)
    assert a.grad.tolist() == [[2.0, 4.0], [6.0, 8.0]] and b.grad.tolist() == [0.0, 0.0, 0.0]


def test_merge_rows_concatenates_in_rank_order():
    assert merge_rows([{"a": [1, None]}, None, {"a": [3], "b": [4]}]) == {"a": [1, None, 3], "b": [4]}


def test_one_process_is_the_identity():
    t = torch.tensor([1.0, 2.0])
    assert SINGLE.sum(t) is t and SINGLE.gather("x") == ["x"] and SINGLE.broadcast(3) == 3
    assert not SINGLE.any(False) and SINGLE.shard(4) == (0, 4)


class _Reduced(Exception):
    pass


def test_what_goes_to_the_all_reduce_is_on_the_tensors_own_device():
    """NCCL reduces CUDA tensors only: a count made on the CPU beside a sum on the GPU cannot even be
    stacked with it. ``meta`` stands in for the GPU; the reduce records what it is handed."""
    seen = []

    def reduce(t):
        seen.append(t.device)
        raise _Reduced

    meta = torch.device("meta")
    x, mask = torch.ones(2, 3, device=meta), torch.ones(2, 3, dtype=torch.long, device=meta)
    for call in (lambda: global_batch_moments(x, reduce), lambda: global_mean(x, reduce),
                 lambda: global_masked_whiten(x, mask, reduce)):
        with pytest.raises(_Reduced):
            call()
    assert seen == [meta] * 3
    assert masked_sum_count(x, mask).device == meta
    assert masked_centered_square_sum(x, mask, torch.zeros((), device=meta)).device == meta


def test_collectives_run_on_the_process_groups_device():
    assert collective_device("gloo") == torch.device("cpu")
    if torch.cuda.is_available():
        assert collective_device("nccl") == torch.device("cuda", torch.cuda.current_device())


# -- two real gloo processes ------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        ranks = Ranks(rank, 2, rank)
        torch.manual_seed(0)
        x, mask = torch.randn(6, 5), (torch.rand(6, 5) > 0.3).long()
        lo, hi = ranks.shard(6)
        whitened = global_masked_whiten(x[lo:hi], mask[lo:hi], ranks.sum)
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad = torch.tensor([1.0, 2.0]) * (rank + 1)  # rank 0: (1, 2), rank 1: (2, 4)
        ranks.all_reduce_grads([p])
        # Plain lists: a tensor would travel as a file descriptor the exiting child may close first.
        out.put((rank, whitened.tolist(), p.grad.tolist(), ranks.gather({"r": [rank]}), ranks.broadcast(f"from {rank}"),
                 ranks.any(rank == 1)))
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_whiten_and_all_reduce_like_one():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r[0], r[1:]) for r in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    torch.manual_seed(0)
    x, mask = torch.randn(6, 5), (torch.rand(6, 5) > 0.3).long()
    whole = masked_whiten(x, mask)
    torch.testing.assert_close(torch.tensor(results[0][0] + results[1][0]), whole, rtol=0, atol=1e-6)
    for rank in (0, 1):
        grad, gathered, broadcast, any_flag = results[rank][1:]
        assert grad == [3.0, 6.0]  # (1, 2) + (2, 4)
        assert gathered == [{"r": [0]}, {"r": [1]}] and broadcast == "from 0" and any_flag is True
