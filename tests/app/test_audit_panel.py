"""The monitor's audit verdict of a run: clean, a flag with its iterations and a sample that shows it, or
why a run cannot be audited yet; redrawn only when the run's logs changed."""

from __future__ import annotations

import json

from homerlhf.app import audit_panel


def _write(run, drift: list[float], samples: list[dict]) -> None:
    rows = [{"iteration": i, "score_mean": 0.0, "signal_length_drift": d, "signal_repetition": 0.0}
            for i, d in enumerate(drift, 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))


def _sample(it: int, response: str, score: float) -> dict:
    return {"iteration": it, "prompt": "Hi", "response": response, "score": score, "truncated": False, "rank": "top"}


def test_a_run_whose_answers_grow_is_flagged_with_its_iterations_and_longest_answer(tmp_path):
    # Length over the first iterations' (audit.length_drift_max 1.5, patience 2, the defaults without a
    # config.yaml): past at 3, 4 and 5, so up from the second iteration in a row: 4 and 5.
    samples = [_sample(i, "word " * (2 * i), float(i)) for i in range(1, 6)] + [_sample(5, "short", 9.0)]
    _write(tmp_path, [1.0, 1.0, 2.0, 2.5, 2.6], samples)
    text = audit_panel.verdict_markdown(str(tmp_path))
    assert text.startswith("**Audit: 1 flag(s) raised** over 5 iteration(s): length_drift")
    assert "- **length_drift** at iteration(s) 4-5: `signal_length_drift` > 1.5 (audit.length_drift_max" in text
    assert "  - iteration 5, score 5: `` " + "word " * 9 + "word ``" in text  # the longest answer of a flagged iteration
    assert text.endswith(audit_panel.AFTER_THE_FACT)


def test_a_clean_run_and_one_that_cannot_be_audited_yet(tmp_path):
    _write(tmp_path, [1.0, 1.1, 1.2], [_sample(1, "fine", 0.5)])
    assert audit_panel.verdict_markdown(str(tmp_path)).startswith(
        "**Audit: clean**: no flag raised over 3 iteration(s) (signals: length_drift, repetition).")
    (tmp_path / "samples.jsonl").write_text("")
    assert audit_panel.verdict_markdown(str(tmp_path)).startswith("**Audit:** not available yet: ")
    assert "no samples" in audit_panel.verdict_markdown(str(tmp_path))
    assert audit_panel.verdict_markdown("") == ""


def test_the_verdict_is_read_again_only_when_the_logs_changed(tmp_path):
    _write(tmp_path, [1.0, 1.0], [_sample(1, "fine", 0.5)])
    verdict, stamp = audit_panel.poll(str(tmp_path), [])
    assert verdict.startswith("**Audit: clean**: no flag raised over 2 iteration(s)")
    assert audit_panel.poll(str(tmp_path), stamp) == ({"__type__": "update"}, stamp)
    _write(tmp_path, [1.0, 1.0, 2.0, 2.0], [_sample(4, "longer answer", 1.0)])
    assert audit_panel.poll(str(tmp_path), stamp)[0].startswith("**Audit: 1 flag(s) raised** over 4 iteration(s)")


def test_a_dpo_or_kto_run_is_not_audited_for_reward_hacking(tmp_path):
    from homerlhf.app import feedback_runs

    _write(tmp_path, [1.0, 2.0, 2.0], [])
    (tmp_path / feedback_runs.RESULT_FILE).write_text("{}")  # what a feedback run writes when it ends
    assert audit_panel.verdict_markdown(str(tmp_path)).startswith("**Audit:** for PPO, GRPO and RLOO runs: this is a DPO")
