"""``rollout.engine: auto`` in the time model and the recommendation: the faster engine of the two
that can run, both with their seconds per phase, and the asynchronous mode's overlap, against
hand-derived timelines (the small shape and hand-made rates of tests/memory/conftest.py)."""

from __future__ import annotations

import pytest

from homerlhf.errors import UserError
from homerlhf.memory.placement import NO_LLAMA_CPP, choice_lines, recommend, resolve_placement
from homerlhf.memory.render import shape_for
from homerlhf.memory.timing import Placement, Throughputs, iteration_time

# Both workers on llama.cpp (the preset's): trainer 1 thread, each worker 1, the engine both logical cores.
HF_PHASES = ("generation 4.0 s, reference log-probs 4.0 s (overlapped), reward scoring 8.0 s (overlapped), "
             "old log-probs / values 4.0 s, update 8.0 s")


def _fast_engine(rates: Throughputs, tokens_per_s: float) -> Throughputs:
    return Throughputs(**{**rates.__dict__, "llama_gen": {2: tokens_per_s}})


def test_auto_takes_the_faster_engine_and_prints_both_with_their_phases(small_cfg, rates):
    cfg = small_cfg("rollout.engine=auto")
    # llama.cpp at 16 tok/s: each chunk's 8 new tokens in 0.5 s. Chunk 1: gen 0-0.5, ref 0.5-2.5, reward
    # 0.5-4.5, scoring 0.5-2.5; chunk 2: gen 2.5-3.0, ref 3.0-5.0, reward 4.5-8.5, scoring 3.0-5.0. The
    # trainer waits for the reward worker until 8.5; update 8: 16.5 s against hf's 18 s
    # (tests/memory/test_timing.py: gen 2 s a chunk at 4 tok/s).
    rec = recommend(cfg, shape_for(cfg), _fast_engine(rates, 16.0), cores=2, logical=2, unavailable={})
    assert rec.current.time.placement == Placement("llamacpp", "llamacpp", "llamacpp")
    assert rec.current.time.total_s == pytest.approx(16.5) and rec.current.time.wait_s == pytest.approx(3.5)
    assert resolve_placement(cfg, rec).rollout.engine == "llamacpp"
    lines = choice_lines(rec, cfg)
    assert lines[0] == ("placement auto: ref llamacpp, reward llamacpp, rollout llamacpp: 16.5 s per iteration "
                        "(hand-made)")
    assert lines[1] == "  alternatives that fit: ref llamacpp, reward llamacpp, rollout hf 18.0 s"
    assert lines[2:] == [
        "  rollout engine auto -> llamacpp: 16.5 s per iteration (generation 1.0 s, reference log-probs 4.0 s "
        "(overlapped), reward scoring 8.0 s (overlapped), old log-probs / values 4.0 s, update 8.0 s)",
        f"  the alternative, hf: 18.0 s per iteration ({HF_PHASES})"]
    # At 2 tok/s (4 s a chunk) llama.cpp is the slower: chunk 2's reward ends at 14, 22 s in all.
    slow = recommend(cfg, shape_for(cfg), _fast_engine(rates, 2.0), cores=2, logical=2, unavailable={})
    assert slow.current.time.placement.engine == "hf" and slow.current.time.total_s == pytest.approx(18.0)
    assert choice_lines(slow, cfg)[-1].startswith("  the alternative, llamacpp: 22.0 s per iteration (generation 8.0 s")


def test_an_engine_that_cannot_run_is_no_candidate_and_the_line_says_why(small_cfg, rates):
    cfg = small_cfg("rollout.engine=auto")
    rec = recommend(cfg, shape_for(cfg), _fast_engine(rates, 16.0), cores=2, logical=2,
                    unavailable={"llamacpp": NO_LLAMA_CPP})
    assert {c.time.placement.engine for c in rec.candidates} == {"hf"}
    assert rec.current.time.placement == Placement("llamacpp", "llamacpp", "hf")
    assert choice_lines(rec, cfg)[1:] == [
        f"  rollout engine auto -> hf: 18.0 s per iteration ({HF_PHASES})",
        "  llamacpp: not a candidate: llama-cpp-python is not installed (`pip install llama-cpp-python` for the "
        "llamacpp engine)"]
    # An engine the config names is planned as named, installed or not (the run's start says what fails).
    named = small_cfg("rollout.engine=llamacpp")
    kept = recommend(named, shape_for(named), rates, cores=2, logical=2, unavailable={"llamacpp": NO_LLAMA_CPP})
    assert kept.current.time.placement.engine == "llamacpp" and choice_lines(kept, named)[0].startswith(
        "placement as configured: ref llamacpp, reward llamacpp, rollout llamacpp")


def test_async_overlaps_the_next_batch_with_the_update(small_cfg, rates):
    cfg = small_cfg("rollout.engine=auto", "rollout.async=true")
    fast = _fast_engine(rates, 16.0)
    it = iteration_time(cfg, fast, Placement("llamacpp", "llamacpp", "llamacpp"), cores=2, logical=2)
    # In the background: gen 0-0.5, ref 0.5-2.5, reward 0.5-4.5; gen 0.5-1.0, ref 2.5-4.5, reward
    # 4.5-8.5: the next batch is ready at 8.5. Meanwhile the trainer scores this one (2 + 2 s) and
    # updates (8 s): 12 s, no wait. Synchronously the same placement takes 16.5 s (above).
    assert it.phases == pytest.approx({"generation": 1.0, "reference": 4.0, "reward": 8.0, "policy_scoring": 4.0,
                                       "update": 8.0})
    assert it.total_s == pytest.approx(12.0) and it.wait_s == 0.0 and it.critical == "trainer"
    assert it.where["generation"] == "ahead" and it.where["reward"] == "worker"
    # The trainer waits when the background is the longer: at 1 tok/s the engine alone takes 16 s.
    slow = iteration_time(cfg, rates, Placement("llamacpp", "llamacpp", "llamacpp"), cores=2, logical=2)
    # Background: gen 0-8, ref 8-10, reward 8-12; gen 8-16, ref 16-18, reward 16-20: ready at 20;
    # the trainer's own 4 + 8 s, then it waits 8 s.
    assert slow.total_s == pytest.approx(20.0) and slow.wait_s == pytest.approx(8.0) and slow.critical == "workers"
    # hf cannot sample ahead: auto takes llama.cpp under rollout.async, and says why hf is no candidate.
    rec = recommend(cfg, shape_for(cfg), rates, cores=2, logical=2, unavailable={})
    assert {c.time.placement.engine for c in rec.candidates} == {"llamacpp"}
    assert rec.current.time.total_s == pytest.approx(20.0)
    assert choice_lines(rec, cfg)[-1] == ("  hf: not a candidate: rollout.async samples ahead with the llamacpp "
                                          "engine only")
    with pytest.raises(UserError, match=r"^rollout.async samples ahead with the llamacpp engine, and llama-cpp-python "
                                        r"is not installed .*; set rollout.async=false$"):
        recommend(cfg, shape_for(cfg), rates, cores=2, logical=2, unavailable={"llamacpp": NO_LLAMA_CPP})


def test_a_named_reward_backend_its_files_do_not_list_is_kept_and_auto_picks_the_engine(small_cfg, rates):
    """``reward.backend=adapter`` named for a reward model whose files list llamacpp and hf only (the
    builtin demo-rm's): ``auto`` chooses the engine among both, with that reward, as it does for
    rollout.engine=hf or =llamacpp named (a run's start checks the model's files against the backend)."""
    cfg = small_cfg("rollout.engine=auto", "reward.backend=adapter")
    for tokens_per_s, engine in ((16.0, "llamacpp"), (2.0, "hf")):
        rec = recommend(cfg, shape_for(cfg), _fast_engine(rates, tokens_per_s), cores=2, logical=2,
                        rewards=["llamacpp", "hf"], unavailable={})
        kept = [c for c in rec.candidates if c.time.placement.ref == "llamacpp" and c.time.placement.reward == "adapter"]
        assert sorted(c.time.placement.engine for c in kept) == ["hf", "llamacpp"]
        assert rec.current is kept[0] and rec.current.time.placement == Placement("llamacpp", "adapter", engine)
        assert resolve_placement(cfg, rec).rollout.engine == engine
        named = small_cfg(f"rollout.engine={engine}", "reward.backend=adapter")  # the same placement, named
        assert recommend(named, shape_for(named), _fast_engine(rates, tokens_per_s), cores=2, logical=2,
                         rewards=["llamacpp", "hf"], unavailable={}).current.time == rec.current.time


def test_when_no_placement_keeps_the_named_roles_the_message_asks_only_for_those(small_cfg):
    from homerlhf.memory.placement import choose

    with pytest.raises(UserError) as info:
        choose([], small_cfg("rollout.engine=auto", "reward.backend=adapter"))
    assert str(info.value) == ("no placement keeps ref.backend=llamacpp and reward.backend=adapter; set ref.backend "
                               "or reward.backend to auto")
