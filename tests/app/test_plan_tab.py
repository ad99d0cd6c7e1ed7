"""The Plan tab's helpers on the real planner: table, verdict, applying the suggestion, YAML."""

from __future__ import annotations

import re

import pytest

from homerlhf.app import plan_tab
from homerlhf.app.common import set_override
from homerlhf.config import from_yaml_file
from homerlhf.errors import UserError


def test_applying_the_suggestion_makes_the_plan_fit():
    overrides = "model.name_or_path=Qwen2.5-7B\nrollout.chunk_size=64\nrollout.max_new_tokens=1024"
    cfg = plan_tab.resolved_config("4090", "", overrides, None)
    plan = plan_tab.compute_plan(cfg, 12)
    assert plan.fits is False
    assert "does NOT fit" in plan_tab.verdict_markdown(plan) and "Suggestion" in plan_tab.verdict_markdown(plan)
    items = plan_tab.suggestion_overrides(plan)
    assert items and all("=" in i for i in items)
    for item in items:
        key, _, value = item.partition("=")
        overrides = set_override(overrides, key, value)
    fixed = plan_tab.compute_plan(plan_tab.resolved_config("4090", "", overrides, None), 12)
    assert fixed.fits is True
    assert plan_tab.verdict_markdown(fixed).startswith("**OK: fits")


def test_a_tight_plan_is_flagged_with_the_suggestion_that_restores_the_margin():
    named = "ref.backend=llamacpp\nreward.backend=llamacpp\nrollout.generation_chunk=null"
    cfg = plan_tab.resolved_config("4090", "", "model.name_or_path=Qwen2.5-7B\n" + named, None)
    plan = plan_tab.compute_plan(cfg, 11.5)  # peak 11.05 GiB: under the card, 3.9% free
    text = plan_tab.verdict_markdown(plan)
    assert plan.status == "tight" and text.startswith("**TIGHT: tight on GPU (11.5 GiB)")
    assert "**Suggestion** that restores the margin" in text and plan_tab.suggestion_overrides(plan)


def test_table_rows_add_up_to_the_phase_totals():
    cfg = plan_tab.resolved_config("4090", "Qwen2.5-1.5B", "", "builtin:demo-sft")
    plan = plan_tab.compute_plan(cfg, None)
    headers, rows = plan_tab.plan_table(plan)
    assert headers[0] == "component (GiB)" and len(headers) == 1 + len(plan.phases)
    total, body = rows[0], rows[1:]  # the total first, where it is seen without scrolling
    assert total[0] == "total"
    styled = plan_tab.table_value(headers, rows).to_html()
    assert styled.count("font-weight: bold") == 1  # the total row's style, and no other
    for col in range(1, len(headers)):
        assert sum(r[col] for r in body) == pytest.approx(total[col], abs=0.002 * len(body))
    # A tiny model is shown in MiB rather than a column of zeros.
    tiny = plan_tab.compute_plan(plan_tab.resolved_config("cpu-tiny", "", "", None), None)
    assert plan_tab.plan_table(tiny)[0][0] == "component (MiB)"


def test_model_override_only_when_it_differs_from_the_preset():
    assert plan_tab.run_overrides("builtin:demo-sft", "ppo.iterations=3", "builtin:demo-sft") == ["ppo.iterations=3"]
    assert plan_tab.run_overrides("Qwen2.5-0.5B", "ppo.iterations=3", "builtin:demo-sft") == [
        "model.name_or_path=Qwen2.5-0.5B", "ppo.iterations=3"]
    text = plan_tab.command_text("cpu-tiny", "Qwen2.5-0.5B", "ppo.iterations=3", "builtin:demo-sft", "runs/a")
    assert text.splitlines() == ["homerlhf train \\", "    --preset cpu-tiny \\",
                                 "    --set model.name_or_path=Qwen2.5-0.5B \\", "    --set ppo.iterations=3 \\",
                                 "    --out runs/a"]


def test_saved_yaml_loads_back_as_the_same_config(tmp_path):
    cfg = plan_tab.resolved_config("cpu-tiny", "", "ppo.iterations=3\nrollout.batch_size=16", None)
    path = plan_tab.save_yaml(cfg, str(tmp_path / "sub" / "run.yaml"))
    assert from_yaml_file(path) == cfg
    with pytest.raises(UserError, match=".yaml"):
        plan_tab.save_yaml(cfg, str(tmp_path / "run.txt"))
    with pytest.raises(UserError, match="ppo.iterations"):
        plan_tab.resolved_config("cpu-tiny", "", "ppo.iterations=zero", None)


def test_choosing_grpo_plans_without_the_critic():
    overrides = plan_tab.on_algorithm("grpo", "ppo.iterations=3")
    assert overrides.splitlines() == ["ppo.iterations=3", "algorithm=grpo", "group.size=4"]
    assert plan_tab.on_algorithm("rloo", "group.size=8").splitlines() == ["group.size=8", "algorithm=rloo"]
    ppo = plan_tab.compute_plan(plan_tab.resolved_config("4090", "", "", None), None)
    grpo = plan_tab.compute_plan(plan_tab.resolved_config("4090", "", overrides, None), None)
    headers, rows = plan_tab.plan_table(grpo)
    names = [r[0] for r in rows]
    assert "LoRA critic" not in names and "value head" not in names
    assert not any(n.startswith("optimizer states critic") for n in names)
    assert grpo.peak.total_bytes < ppo.peak.total_bytes


def test_the_plan_shows_seconds_per_phase_and_the_placement_recommendation():
    cfg = plan_tab.resolved_config("4090", "", "", None)
    plan = plan_tab.compute_plan(cfg, None)
    text = plan_tab.time_markdown(plan)
    # The preset's placement is auto: the plan shows the one a run would take, the fastest that fits.
    assert text.startswith("**Time per iteration** (ref adapter_off, reward adapter, rollout hf)")
    for phase in ("| generation |", "| reference log-probs |", "| reward scoring |", "| old log-probs / values |",
                  "| update |"):
        assert phase in text
    assert "critical path" in text and "per iteration" in text
    # Every placement compared, one row each; the recommended one is the fastest that fits.
    assert text.count("| yes |") + text.count("| no |") == len(plan.timing.candidates) == 12
    best = plan.timing.best
    assert best.fits and all(best.time.total_s <= c.time.total_s for c in plan.timing.candidates if c.fits)
    assert "--set" in text or "is the fastest that fits" in text
    # An hour-long placement says why: the phase that takes most of it, on llama.cpp on the CPU.
    rows = {tuple(cell.strip() for cell in line.split("|")[1:4]): line.split("|")[5].strip()
            for line in text.splitlines() if line.startswith("| adapter_off |") or line.startswith("| llamacpp |")}
    for c in plan.timing.candidates:
        p = c.time.placement
        name = max(c.time.phases, key=c.time.phases.get)
        on_cpu = {"generation": p.engine, "reference": p.ref, "reward": p.reward}.get(name) == "llamacpp"
        assert rows[(p.ref, p.reward, p.engine)].endswith("(llama.cpp, CPU)" if on_cpu else "(trainer)")
    slow = [c for c in plan.timing.candidates if c.time.total_s > 10 * best.time.total_s]
    assert slow and all("llamacpp" in (c.time.placement.ref, c.time.placement.reward, c.time.placement.engine)
                        for c in slow)
    assert "put a model on llama.cpp on the CPU (*most of it* says which phase)" in text


def test_a_preset_change_resets_the_model_and_takes_out_the_old_cards_suggestion():
    typed, shown, applied = {}, "3060-12g", {"preset": "3060-12g", "items": ["rollout.chunk_size=4"]}
    overrides = "rollout.chunk_size=4\nppo.iterations=3"
    card, model, default, overrides, message, typed, shown = plan_tab.on_preset(
        "cpu-tiny", "Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-1.5B-Instruct", shown, overrides, typed, applied)
    assert (model, default, shown) == ("builtin:demo-sft", "builtin:demo-sft", "cpu-tiny")
    assert overrides == "ppo.iterations=3"
    assert message == ("Preset **cpu-tiny**: model `builtin:demo-sft` (the preset's). Took out the 3060-12g "
                       "suggestion: `rollout.chunk_size=4`. Kept your overrides: `ppo.iterations=3`.")
    # Back on the 3060, the model typed for it returns; a model left at the default is not remembered.
    _, model, _, _, message, typed, _ = plan_tab.on_preset("3060-12g", model, default, shown, overrides, typed, applied)
    assert model == "Qwen/Qwen2.5-7B" and "(the one you typed for it)" in message
    assert typed == {"3060-12g": "Qwen/Qwen2.5-7B"}


def test_a_check_report_calibrates_the_tabs_plan(tmp_path):
    """The Calibration box: `homerlhf plan --calibration`'s figures (tests/memory/test_check_report.py derives
    them); a bad path is the CLI's one line, raised for the tab's message box."""
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "fixtures" / "check_reports" / "rtx4090_example.json"
    cfg = plan_tab.resolved_config("4090", "Qwen/Qwen2.5-7B", "ref.backend=adapter_off\nreward.backend=llamacpp", None)
    plain, cal = plan_tab.compute_plan(cfg, None), plan_tab.compute_plan(cfg, None, f"  {example}  ")
    chunk = cal.generation["chunk"]
    assert cal.timing.current.time.phases["generation"] == pytest.approx(64 * 256 / (500 * chunk / 16), rel=1e-6)
    assert cal.phase("generation").allocated_gib == pytest.approx(plain.phase("generation").allocated_gib * 1.10, rel=1e-6)
    assert "case ppo-7b on NVIDIA GeForce RTX 4090" in plan_tab.time_markdown(cal)
    assert any(n.startswith("calibration: time from") for n in cal.notes)
    assert plan_tab.compute_plan(cfg, None, "   ").timing.current.time.source == plain.timing.current.time.source
    with pytest.raises(UserError, match=r"^--calibration .*missing\.json: no such file"):
        plan_tab.compute_plan(cfg, None, str(tmp_path / "missing.json"))


def test_a_plan_that_fits_nowhere_says_so_and_apply_says_why():
    """Qwen2.5-14B on the 3060: the verdict says it does not fit, the time section no longer calls the current
    placement "the fastest that fits", and Apply gives the reason that holds (not "the plan fits")."""
    from homerlhf.app.plan_apply import NO_FIT, on_apply

    plan = plan_tab.compute_plan(plan_tab.resolved_config("3060-12g", "Qwen/Qwen2.5-14B", "", None), None)
    assert plan.fits is False and plan.suggestion is None
    assert "does NOT fit RTX 3060 12GB (12 GiB)" in plan_tab.verdict_markdown(plan)
    text = plan_tab.time_markdown(plan)
    assert "fastest that fits" not in text
    assert "no placement fits the 90% budget (10.8 of 12 GiB): the current one (ref " in text
    choice = plan_tab.apply_choice(plan)
    assert choice == {"items": [], "why": f"no suggestion to apply: {NO_FIT}"}
    with pytest.raises(UserError, match="^no suggestion to apply: no setting in the search fits with 10% of the card"):
        on_apply(choice, "", "3060-12g")
    with pytest.raises(UserError, match=r"^no suggestion to apply: run Plan first"):
        on_apply({}, "", "3060-12g")  # before a plan, or after one that failed


def test_apply_takes_the_placement_the_time_section_recommends():
    """A plan that fits with a faster placement: Apply adds exactly the overrides the "recommended: add ..."
    line names, and the plan of the result has nothing left to recommend."""
    from homerlhf.app.plan_apply import NOTHING_TO_APPLY, on_apply

    named = "ref.backend=llamacpp\nreward.backend=llamacpp\nrollout.generation_chunk=null"
    plan = plan_tab.compute_plan(plan_tab.resolved_config("4090", "Qwen/Qwen2.5-7B", named, None), None)
    shown = re.search(r"recommended: add (.*?) to the overrides", plan_tab.time_markdown(plan))
    assert plan.fits is True and shown, plan_tab.time_markdown(plan)
    named_there = re.findall(r"`([^`]+)`", shown.group(1))
    choice = plan_tab.apply_choice(plan)
    assert choice["items"] == named_there and choice["what"] == "the recommended placement"
    message, overrides, applied = on_apply(choice, named, "4090")
    assert message.startswith("Applied: `") and message.endswith("(the recommended placement)")
    assert set(named_there) <= set(overrides.splitlines()) and applied == {"preset": "4090", "items": named_there}
    again = plan_tab.compute_plan(plan_tab.resolved_config("4090", "Qwen/Qwen2.5-7B", overrides, None), None)
    assert "is the fastest that fits" in plan_tab.time_markdown(again)
    assert plan_tab.apply_choice(again) == {"items": [], "why": NOTHING_TO_APPLY}
    with pytest.raises(UserError, match=f"^{NOTHING_TO_APPLY}$"):
        on_apply(plan_tab.apply_choice(again), overrides, "4090")
