"""homerlhf/check/case_plan.py: each case of `homerlhf check` is compared with the plan of what its compared
iteration ran (a first iteration: no optimizer states, no gradients held, one cuBLAS handle before the
first backward; after a resume: states loaded, no gradients; the decoder resolved), not with the
steady state, and the plans differ by the hand-derived bytes of exactly those components."""

from __future__ import annotations

import pytest

from homerlhf.config import load_config
from homerlhf.memory.components import Assumptions
from homerlhf.memory.planner import plan
from homerlhf.memory.shapes import builtin_shape

SHAPE = builtin_shape("Qwen/Qwen2.5-1.5B")


@pytest.fixture
def case_plan():
    from homerlhf.check import case_plan

    return case_plan


def _flags(assumed):
    return {name: (a.after_first_step, a.held_gradients, a.cublas_handles, a.decoder) for name, a in assumed.items()}


def test_each_kind_of_iteration_gets_its_assumptions(case_plan):
    one = case_plan.iteration_assumptions
    # A case's one iteration (grpo, rloo, reward-adapter): nothing stepped, no backward thread yet.
    assert _flags(one([[True]], "static")) == {"generation": (False, False, 1, "static"),
                                               "scoring": (False, False, 1, "static"),
                                               "update": (False, None, 2, "static")}
    # The second of two (ppo-7b): states and the last step's gradients, both handles.
    assert _flags(one([[True], [True]], "hf"))["generation"] == (True, True, 2, "hf")
    # fp16, two steps an iteration, the first iteration's last step skipped: states, no gradients held.
    assert _flags(one([[True, False], [True, True]], "static"))["scoring"] == (True, False, 2, "static")
    # A first iteration of two steps: its second mini-batch's backward has the first step's states.
    assert _flags(one([[True, True]], "static"))["update"][0] is True
    assert _flags(one([[False, True]], "static"))["update"][0] is False  # the scaler skipped the first
    # Right after a resume (resume, cli): the checkpoint's states loaded, no gradients, one handle.
    assert _flags(one([[True]], "static", resumed_states=True))["generation"] == (True, False, 1, "static")


def test_the_compared_steps_of_a_resumed_process(case_plan):
    rows = [{"optimizer_steps": 1, "nonfinite_skipped_steps": 0}, {"optimizer_steps": 1, "nonfinite_skipped_steps": 0}]
    assert case_plan.compared_steps({"rows": rows}, "cli") == ([[True]], True)  # train --resume ran the last alone
    assert case_plan.compared_steps({"rows": rows[:1], "step_skipped": [False], "resumed_states": True},
                                    "resume") == ([[True]], True)
    # The trainer's own order wins over the counts: 2 steps, the first skipped.
    assert case_plan.step_flags([{"optimizer_steps": 2, "nonfinite_skipped_steps": 1}], [True, False]) == [[False, True]]


def test_a_first_iteration_plan_lacks_exactly_the_states_gradients_and_a_workspace(case_plan):
    """GRPO on Qwen2.5-1.5B, 4090 preset (AdamW, LoRA r 16 on all 7 linears of 28 layers): 18,464,768
    LoRA parameters (16 x 41,216 per layer x 28). Its first iteration's generation plan has no AdamW
    states (2 fp32 moments: 147,718,144 B), no held gradients (fp32: 73,859,072 B) and one workspace
    fewer (the backward thread's: 32 MiB = 33,554,432 B) than the steady state's: 255,131,648 B."""
    cfg = load_config("4090", overrides=["model.name_or_path=Qwen/Qwen2.5-1.5B", "algorithm=grpo", "group.size=4"])
    assumed = case_plan.iteration_assumptions([[True]], "static")
    entry, chosen = case_plan.case_plans(cfg, SHAPE, 24.0, assumed)
    steady = plan(cfg, SHAPE, 24.0, assumptions=Assumptions(decoder="static"), with_suggestion=False)
    for name in ("generation", "scoring"):
        assert steady.phase(name).allocated_bytes - chosen[name].allocated_bytes == 255_131_648
    # The update: states are made by its one step, after its backward; the gradients are its own.
    assert steady.phase("update").allocated_bytes - chosen["update"].allocated_bytes == 147_718_144
    assert entry["phases"]["generation"]["allocated_gib"] == round(chosen["generation"].allocated_gib, 4)
    assert set(entry["steady_state"]) == {"generation", "scoring", "update"}
    comparison = case_plan.comparison(chosen, {"generation": 1.0})
    assert comparison["generation"]["predicted_gib"] == round(chosen["generation"].allocated_gib, 4)
    described = case_plan.described(assumed["generation"], cfg)
    assert described["held_gradients"] is False and described["cublas_workspaces"] == 2  # main: default + side


def test_the_decoder_planned_is_the_one_that_sampled(case_plan):
    assert case_plan.planned_decoder("static loop, captured", "auto", "cuda") == "static"
    assert case_plan.planned_decoder("hf generate (static loop declined: x)", "auto", "cuda") == "hf"
    assert case_plan.planned_decoder(None, "auto", "cuda") == "static"  # the CLI's subprocess: the setting resolved
    assert case_plan.planned_decoder(None, "auto", "cpu") == "hf"
