"""benchmarks/critic_size.py without running PPO: its table (the held-out cells, the time against the
``base`` critic's of the same seed, a failed run as a row) and its one-line refusals."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "critic_size.py"


@pytest.fixture(scope="module")
def bench():
    return runpy.run_path(str(SCRIPT))  # defines main without running it


def row(critic: str, seed: int, s_per_iteration: float) -> dict:
    return {"critic": critic, "seed": seed, "held_out": {"checker": [0.5, 0.875], "well formed": [0.99, 0.97]},
            "final_kl": 1.234, "window": 4, "value_loss": {"first": 0.25, "last": 0.0625},
            "explained_variance": {"first": -0.1, "last": 0.4}, "s_per_iteration": s_per_iteration,
            "update_s": 1.0, "scoring_s": 0.5}


def test_the_table_gives_each_run_its_figures_and_its_time_against_the_base_critic(bench):
    lines = bench["table"]([row("base", 0, 4.0), row("small", 0, 3.0), row("base", 1, 5.0), row("rm", 1, 6.0),
                            {"critic": "small", "seed": 1, "error": "UserError: boom"}])
    assert lines[0].startswith("| critic | seed | checker before -> after | well formed before -> after | KL last |")
    assert lines[1] == "|---|---|" + "---|" * 7  # 2 held-out figures + KL, value loss, EV, s/iteration, ratio
    assert lines[3] == ("| small | 0 | 0.500 -> 0.875 (+0.375) | 0.990 -> 0.970 (-0.020) | 1.23 | 0.2500 / 0.0625 "
                        "| -0.100 / 0.400 | 3.00 (1.00, 0.50) | 0.75 |")
    assert lines[2].endswith("| 1.00 |") and lines[5].endswith("| 1.20 |")  # 6.0 s over seed 1's base 5.0 s
    assert lines[6] == "| small | 1 | failed: UserError: boom |"


@pytest.mark.parametrize("argv, message", [
    (["--task", "verifiable", "--critics", "rm"], "--critics: unknown rm for --task verifiable; choose from base, small, random"),
    (["--seeds", "0,one"], "--seeds: integers separated by commas, got '0,one'"),
])
def test_bad_arguments_are_one_line_and_exit_2(bench, argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        bench["parse_args"](argv)
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)
