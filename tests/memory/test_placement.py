"""The placement recommendation: the fastest placement that fits the card, what it saves, per role."""

from __future__ import annotations

import pytest

from homerlhf.config import load_config
from homerlhf.memory.placement import recommend
from homerlhf.memory.render import shape_for
from homerlhf.memory.gpu_rates import gpu_source
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


def test_on_a_card_placements_over_the_budget_are_not_recommended(preset_named):
    cfg = preset_named()  # a generation chunk of 16: each placement's memory adds to the same plan
    shape = shape_for(cfg)
    rates = default_throughputs(shape, cfg, cores=8)
    assert rates.source == f"GPU: {gpu_source('RTX 4090')}; CPU workers: {DEFAULT_SOURCE}"
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


def test_auto_picks_the_fastest_placement_that_fits_and_prints_it_with_the_alternatives(small_cfg, rates):
    from homerlhf.memory.placement import choice_lines, resolve_placement

    cfg = small_cfg("ref.backend=auto", "reward.backend=auto")
    rec = recommend(cfg, shape_for(cfg), rates, cores=2, logical=2)
    # Hand-derived above: adapter_off + adapter 10 s (everything on the trainer, both cores); the
    # engine stays hf (auto never switches it).
    assert rec.current.time.placement == Placement("adapter_off", "adapter", "hf")
    resolved = resolve_placement(cfg, rec)
    assert (resolved.ref.backend, resolved.reward.backend) == ("adapter_off", "adapter")
    lines = choice_lines(rec, cfg)
    assert lines[0] == "placement auto: ref adapter_off, reward adapter, rollout hf: 10.0 s per iteration (hand-made)"
    # Every other placement with the hf engine, fastest first, with its seconds: (adapter_off, hf) ties
    # at 10 s; (llamacpp, *) 18 s; (adapter_off, llamacpp) 20 s. Ties go to the reward's candidates in
    # order: llama.cpp (no GPU memory), adapter, hf.
    assert lines[1] == ("  alternatives that fit: ref adapter_off, reward hf, rollout hf 10.0 s; "
                        "ref llamacpp, reward llamacpp, rollout hf 18.0 s; ref llamacpp, reward adapter, rollout hf "
                        "18.0 s; ref llamacpp, reward hf, rollout hf 18.0 s; ref adapter_off, reward llamacpp, rollout hf "
                        "20.0 s")


def test_auto_keeps_llamacpp_where_the_cpu_keeps_up_and_named_roles_as_named(small_cfg, rates):
    # A reward that exists only as a llama.cpp export: the reference's best is then its worker (18 s:
    # it runs beside the trainer), not adapter_off (20 s: in the trainer's sequence).
    cfg = small_cfg("ref.backend=auto", "reward.backend=auto")
    rec = recommend(cfg, shape_for(cfg), rates, cores=2, logical=2, rewards=["llamacpp"])
    assert {c.time.placement.reward for c in rec.candidates} == {"llamacpp"}
    assert rec.current.time.placement == Placement("llamacpp", "llamacpp", "hf")
    # A named reference is kept (adapter_off would save 8 s); with it, every reward gives 18 s, and the
    # tie keeps the reward on its worker.
    named = small_cfg("ref.backend=llamacpp", "reward.backend=auto")
    assert recommend(named, shape_for(named), rates, cores=2, logical=2).current.time.placement == \
        Placement("llamacpp", "llamacpp", "hf")


def test_auto_keeps_the_workers_on_llamacpp_when_the_gpu_cannot_hold_the_reward(preset_named):
    from homerlhf.memory.placement import resolve_placement

    # (the fp32 upcast, whose plan these figures are)
    cfg = preset_named("4090", "ref.backend=auto", "reward.backend=auto", "quant.upcast_non_quantized=true")
    shape = shape_for(cfg)
    rates = default_throughputs(shape, cfg, cores=8)
    roomy = recommend(cfg, shape, rates, cores=8, gpu_gib=24)
    assert roomy.current.time.placement == Placement("adapter_off", "adapter", "hf")  # 7B on a 4090
    # 16 GiB: the plan with the reward adapter (14.51 GiB) leaves less than 10% free, with the reward
    # on its worker (14.35 GiB) it fits; an in-process hf reward (+14.2 GiB) never does.
    small = recommend(cfg, shape, rates, cores=8, gpu_gib=16.0)
    fits = {c.time.placement.reward: c.fits for c in small.candidates if c.time.placement.ref == "adapter_off"}
    assert fits == {"llamacpp": True, "adapter": False, "hf": False}
    assert resolve_placement(cfg, small).reward.backend == "llamacpp"


def test_when_no_placement_fits_the_line_says_so(small_cfg, rates):
    """Not "the current placement is the fastest that fits" under a verdict that says it does not fit."""
    cfg = small_cfg()
    rec = recommend(cfg, shape_for(cfg), rates, cores=2, logical=2, gpu_gib=0.001)  # peaks about 0.004 GiB
    assert not any(c.fits for c in rec.candidates) and rec.set_args() == []
    assert rec.line() == ("no placement fits the 90% budget (0.0 of 0.001 GiB): the current one (ref llamacpp, reward "
                          "llamacpp, rollout hf) would take 18.0 s per iteration once the memory plan fits (see its verdict)")
