"""*Train on my feedback* without a browser: too little feedback says how much more, one run at a time
(a running one is named, for a feedback run and for PPO's Start), the command a feedback run runs, its
progress in optimizer steps, its monitor panels and what it did to the feedback."""

from __future__ import annotations

import json
import sys

import pytest

from homerlhf.app import feedback, feedback_runs, runs, train_tab
from homerlhf.app.feedback_result import result_markdown
from homerlhf.config import load_config
from homerlhf.errors import UserError


def _fb(pairs: int, ratings: int) -> feedback.Feedback:
    return feedback.Feedback([{"prompt": "p", "chosen": "a", "rejected": "b"}] * pairs,
                             [{"prompt": "p", "completion": "a", "label": True}] * ratings)


def test_too_little_feedback_says_how_much_more():
    cfg = load_config("cpu-tiny")  # dpo.min_rows = kto.min_rows = 4
    assert feedback_runs.too_small(_fb(1, 1), "auto", cfg) == (
        "Not enough feedback for this policy yet: DPO needs at least 4 preference pairs (dpo.min_rows): 1 collected, "
        "3 more: Left/Right better, or Best of these; KTO needs at least 4 rated answers, a pair counting as two "
        "(kto.min_rows): 3 collected, 1 more: Thumbs up/down, or pairs.")
    assert feedback_runs.too_small(_fb(1, 2), "auto", cfg) is None  # 2 + 2 rated answers: KTO
    assert feedback_runs.pick_method(_fb(1, 2), "auto", cfg) == "kto"
    assert feedback_runs.too_small(_fb(1, 2), "dpo", cfg).endswith("1 collected, 3 more: Left/Right better, or Best of these.")
    assert feedback_runs.pick_method(_fb(4, 0), "auto", cfg) == "dpo"
    assert feedback_runs.too_small(_fb(0, 3), "kto", cfg).endswith("3 collected, 1 more: Thumbs up/down, or pairs.")


def test_a_too_small_collection_starts_nothing(tmp_path):
    ckpt = tmp_path / "run" / "checkpoints" / "iter_000001"
    ckpt.mkdir(parents=True)
    with pytest.raises(UserError, match=r"DPO needs at least 4 preference pairs \(dpo.min_rows\): 0 collected, 4 more"):
        feedback_runs.start_feedback_run(str(ckpt), "dpo", "cpu-tiny", [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no run dir was made
    with pytest.raises(UserError, match="pick a checkpoint first"):
        feedback_runs.start_feedback_run("", "auto", "cpu-tiny", [])


def test_the_feedback_run_command_adds_the_small_data_defaults_unless_set(tmp_path):
    argv = feedback_runs.feedback_argv("dpo", "cpu-tiny", ["dpo.lr=1e-2", "dpo.grad_accum=2"], "C", tmp_path / "d.jsonl",
                                       tmp_path / "out")
    # No held-out rows: no split of the few rows either (all of them train).
    assert argv == ["dpo", "--preset", "cpu-tiny", "--set", "dpo.lr=1e-2", "--set", "dpo.grad_accum=2",
                    "--set", "dpo.warmup_ratio=0", "--set", "data.eval_fraction=0", "--model", "C",
                    "--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "out")]
    held = feedback_runs.feedback_argv("kto", "cpu-tiny", [], "C", tmp_path / "d.jsonl", tmp_path / "out", tmp_path / "h.jsonl")
    assert held[-4:] == ["--eval-data", str(tmp_path / "h.jsonl"), "--out", str(tmp_path / "out")]
    assert "data.eval_fraction=0" not in held


def test_a_second_start_while_a_run_runs_is_refused_naming_it(tmp_path):
    root = tmp_path / "runs"
    busy = root / "app-busy"
    runs.start_run(busy, ["-c", "import time; time.sleep(60)"], program=[sys.executable])
    try:
        assert runs.run_status(busy).running
        expected = rf"a run is already running: {busy} \(pid \d+\); stop it in the Train tab"
        with pytest.raises(UserError, match=expected):
            feedback_runs.refuse_if_running([root])
        with pytest.raises(UserError, match=expected):  # PPO's Start too, before anything starts
            train_tab.on_start("cpu-tiny", "builtin:tiny-llama", "ref.backend=adapter_off\nreward.backend=function\n"
                               "reward.function=builtin:reverse", "builtin:demo-sft", "", False, str(root))
        assert sorted(p.name for p in root.iterdir()) == ["app-busy"]
    finally:
        runs.stop_run(busy, force=True)
        runs.wait_for(busy, 10)
    assert feedback_runs.running_run([root]) is None


def test_progress_in_steps_the_panels_and_the_result_of_a_feedback_run(tmp_path):
    run = tmp_path / "dpo-1"
    (run / feedback_runs.FOLDER).mkdir(parents=True)
    start = tmp_path / "ppo" / "checkpoints" / "iter_000001"
    start.mkdir(parents=True)
    info = {"method": "dpo", "start_checkpoint": str(start), "epochs": 3.0, "max_steps": None}
    (run / feedback_runs.FOLDER / feedback_runs.INFO_FILE).write_text(json.dumps(info))
    rows = [{"step": s, "epoch": s / 2, "loss": 0.69 - 0.1 * s, "rewards/margins": 0.2 * s,
             "rewards/accuracies": 0.5 + 0.25 * s, "rewards/chosen": 0.1 * s, "rewards/rejected": -0.1 * s} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert feedback_runs.total_steps(run, rows) == 6  # 2 steps an epoch (epoch 0.5 at step 1), 3 epochs
    assert feedback_runs.start_checkpoint(run) == start
    status, progress, figure, *_ = train_tab.poll(str(run))
    assert progress.startswith("**Progress:** step 2/6 · 33%")
    from homerlhf.app.monitor_plot import figure_texts

    texts = figure_texts(figure)
    for title in ("Loss", "Reward margin (chosen - rejected)", "Reward accuracy (chosen above rejected)",
                  "2 step(s) logged"):
        assert title in texts, title
    assert figure.to_plotly_json()["layout"]["xaxis"]["title"]["text"] == "optimizer step"
    assert result_markdown(run) == ""  # not finished
    trained = {"eval_pairs": 4, "margin_before": -0.25, "margin_after": 3.5, "chosen_logp_change": 1.25,
               "rejected_logp_change": -2.5, "accuracy_before": 0.5, "accuracy_after": 1.0}
    summary = {"stage": "dpo", "steps": 6, "n_train": 4, "checkpoint": str(run / "checkpoints" / "iter_000006"),
               "held_out": {}, "trained_rows": trained}
    (run / feedback_runs.RESULT_FILE).write_text(json.dumps(summary))
    head = ("**DPO run finished**: 6 optimizer step(s) on 4 row(s). Evaluate compares its checkpoint `iter_000006` "
            "(left) with `iter_000001` of `ppo`, where it started (right): send one of your prompts to see the change.")
    # sigmoid(0.1 * (3.5 + 0.25)) = 1 / (1 + e^-0.375) = 0.5927: the preference DPO's implicit reward gives.
    assert result_markdown(run) == "\n\n".join([
        head, "On your feedback it trained on: margin log p(chosen) - log p(rejected) -0.250 -> +3.500 nats (chosen "
              "answers **+1.250**, rejected -2.500); preference for your chosen answers 50% -> 59.3%.",
        "No held-out figure: from 3 prompts with feedback on, a fifth of them is held out to show what the run does "
        "to prompts it never saw."])
    # Half a nat of margin at beta 0.1: sigmoid(0.05) = 0.5125, too little to matter, with the loss it logged.
    info.update(held_out=True, beta=0.1)
    (run / feedback_runs.FOLDER / feedback_runs.INFO_FILE).write_text(json.dumps(info))
    summary.update(trained_rows=dict(trained, margin_after=0.25), held_out=dict(trained, margin_after=0.0))
    (run / feedback_runs.RESULT_FILE).write_text(json.dumps(summary))
    lines = result_markdown(run).split("\n\n")
    assert lines[1].endswith("-0.250 -> +0.250 nats (chosen answers **+1.250**, rejected -2.500); preference for your "
                             "chosen answers 50% -> 51.2%.")
    assert lines[2].startswith("On your held-out feedback (prompts it never saw): margin log p(chosen) - log "
                               "p(rejected) -0.250 -> +0.000 nats")  # sigmoid(0.025) = 0.5062
    assert lines[2].endswith("50% -> 50.6%.")
    assert lines[3] == ("**Too little to matter:** 6 step(s) on 4 row(s) left the preference for your chosen answers "
                        "at 51.2% (50% is no change, loss 0.5900 -> 0.4900). Give more feedback (tens of pairs), or "
                        "train longer: raise `dpo.epochs` (now 3.0) or `dpo.lr` in the Plan tab's overrides, then "
                        "train again.")
