"""The placement recommendation: the fastest placement that fits the card, what it saves, per role."""

from __future__ import annotations

import pytest

from homerlhf.config import load_config
from homerlhf.memory.placement import recommend
from homerlhf.memory.render import shape_for
from homerlhf.memory.timing import DEFAULT_SOURCE, Placement, default_throughputs


def test_the_recommendation_is_the_fastest_and_says_by_how_much(small_cfg, rates):
    cfg = small_cfg()
    rec = recommend(cfg, shape_for(cfg), rates, cores=2, logical=2)
    assert rec.current.time.total_s == pytest.approx(18.0)
    # adapter and hf rewards tie at 10 s: the tie goes to adapter (listed first, no GPU either way).
    assert rec.best.time.placement == Placement("adapter_off", "adapter", "hf")
    assert rec.saving_s == pytest.approx(8.0)
    assert rec.set_args() == ["ref.backend=adapter_off", "reward.backend=adapter"]
    # Keeping ref on llamacpp, the best is (llamacpp, adapter, hf) at 18 s (hand-derived: chunk
    # gen 2, reward forward 1, scoring 2, the ref worker 2 s alongside: 10 s + update 8); keeping
    # the reward on llamacpp, (llamacpp, llamacpp, hf) at 18 s. Each role's move saves 8 s.
    roles = rec.per_role()
    assert roles["ref"] == ("adapter_off", pytest.approx(8.0))
    assert roles["reward"] == ("adapter", pytest.approx(8.0))
    assert roles["engine"] == ("hf", 0.0)
    assert "1.8x faster, 8.0 s saved" in rec.line()
    assert [c.time.total_s for c in rec.candidates] == sorted(c.time.total_s for c in rec.candidates)


def test_on_a_card_placements_over_the_budget_are_not_recommended():
    cfg = load_config("4090", None, [])
    shape = shape_for(cfg)
    rates = default_throughputs(shape, cfg, cores=8)
    assert rates.source == DEFAULT_SOURCE
    rec = recommend(cfg, shape, rates, cores=8)
    by_reward = {c.time.placement.reward: c for c in rec.candidates if c.time.placement.ref == "adapter_off"
                 and c.time.placement.engine == "hf"}
    # An in-process HF reward model of Qwen2.5-7B's shape in bf16: 7.6 B x 2 bytes = 14.2 GiB more.
    assert by_reward["hf"].peak_gib - by_reward["llamacpp"].peak_gib == pytest.approx(
        2 * shape.total_params / 2**30, rel=1e-9)
    assert not by_reward["hf"].fits and by_reward["adapter"].fits
    assert rec.best.fits and rec.best.time.placement.reward != "hf"
    assert rec.best.time.total_s <= min(c.time.total_s for c in rec.candidates if c.fits)


def test_a_remote_worker_keeps_its_backend(small_cfg, rates):
    cfg = small_cfg("ref.url=http://10.0.0.2:8001")
    rec = recommend(cfg, shape_for(cfg), rates, cores=2, logical=2)
    assert {c.time.placement.ref for c in rec.candidates} == {"llamacpp"}
