"""The sample history's rows: grouped by iteration (ranks of one answer joined, equal answers kept apart),
the best and worst by score, one prompt across iterations, the slider's place while a run grows, a line
still being written skipped."""

from __future__ import annotations

import json

from homerlhf.app import history_panel
from homerlhf.app import sample_history as sh


def _row(it, prompt, response, score, rank=None, truncated=False):
    row = {"iteration": it, "prompt": prompt, "response": response, "score": score, "truncated": truncated}
    return row if rank is None else {**row, "rank": rank}


ROWS = [
    _row(1, "<|user|>Hi<|end|>", "a", 0.5),  # no rank: a "first" row (a run written before ranks)
    _row(1, "Why?", "b", -1.0),
    _row(2, "Hi", "c", 2.0, "first"),
    _row(2, "Why?", "d", 0.0, "first", truncated=True),
    _row(2, "Why?", "d", 0.0, "first", truncated=True),  # a second answer alike (a group that collapsed)
    _row(2, "Hi", "c", 2.0, "top"),  # the first row's answer again, as the best
    _row(2, "Other", "e", -3.0, "bottom"),
]


def test_rows_group_by_iteration_joining_the_ranks_of_one_answer():
    history = sh.by_iteration(ROWS)
    assert list(history) == [1, 2]
    assert [(s["prompt"], s["ranks"]) for s in history[1]] == [("Hi", ["first"]), ("Why?", ["first"])]
    assert [(s["response"], s["ranks"]) for s in history[2]] == [
        ("c", ["first", "top"]), ("d", ["first"]), ("d", ["first"]), ("e", ["bottom"])]
    assert sh.iteration_rows(history[2])[1] == ["first", "Why?", "d", 0.0, "yes"]


def test_best_and_worst_k_by_score():
    samples = sh.by_iteration(ROWS)[2]
    top, bottom = sh.top_bottom(samples, 2)
    assert top == [[2.0, "Hi", "c"], [0.0, "Why?", "d [cut at max tokens]"]]
    assert bottom == [[-3.0, "Other", "e"], [0.0, "Why?", "d [cut at max tokens]"]]


def test_summary_line_counts_means_and_cut_answers():
    samples = sh.by_iteration(ROWS)[2]
    # scores 2, 0, 0, -3: mean -0.25
    assert sh.summary(2, samples) == ("**Iteration 2** · 4 sample(s) kept · mean score -0.25 (min -3, max 2) "
                                      "· 2 cut at max tokens")
    assert sh.summary(2, samples, wanted=3).endswith("(iteration 3 kept no samples: the nearest shown)")


def test_one_prompt_across_iterations_most_answered_first():
    history = sh.by_iteration(ROWS)
    assert sh.prompts(history) == ["Hi", "Why?", "Other"]  # Hi and Why? in 2 iterations, Hi seen first
    assert sh.across(history, "Hi") == [[1, "a", 0.5, ""], [2, "c", 2.0, ""]]


def test_the_nearest_iteration_with_samples():
    assert sh.nearest([2, 4, 8], 5) == 4 and sh.nearest([2, 4, 8], 6) == 8  # a tie: the later one
    assert sh.nearest([2, 4, 8], None) == 8 and sh.nearest([], 3) is None


def test_the_slider_follows_the_newest_iteration_unless_moved_back():
    history = {1: [], 2: [], 3: []}
    assert history_panel.slider_value(history, None, None) == 3  # nothing shown yet
    assert history_panel.slider_value(history, 2, 2) == 3  # stood at the newest seen: moves on
    assert history_panel.slider_value(history, 1, 2) == 1  # moved back by the user: stays
    assert history_panel.slider_value({}, 1, None) is None


def test_a_growing_file_reads_its_whole_lines_and_the_panel_redraws_only_on_change(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]) + '{"iteration": 2, "prom')  # torn last line
    out = history_panel.poll(str(tmp_path), None, 3, None, [])
    slider, summary, samples, top, bottom, prompt, across, stamp = out
    assert slider["value"] == 1 and not slider["interactive"] and summary.startswith("**Iteration 1** · 2 sample(s)")
    assert [r[2] for r in samples] == ["a", "b"] and [r[2] for r in top] == ["a", "b"]
    assert prompt["choices"] == ["Hi", "Why?"] and prompt["value"] == "Hi" and across == [[1, "a", 0.5, ""]]
    assert history_panel.poll(str(tmp_path), 1, 3, "Hi", stamp)[1] == {"__type__": "update"}  # unchanged file
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))  # the run went on
    out = history_panel.poll(str(tmp_path), 1, 3, "Why?", stamp)
    assert out[0]["value"] == 2 and out[0]["maximum"] == 2 and out[0]["interactive"] and out[1].startswith("**Iteration 2** · 4 sample(s)")
    assert out[5]["value"] == "Why?" and [r[1] for r in out[6]] == ["b", "d", "d"]


def test_the_file_is_read_on_from_where_the_last_read_stopped_and_again_after_a_resume_cut_it(tmp_path):
    path = tmp_path / "samples.jsonl"
    lines = [json.dumps(r) + "\n" for r in ROWS]
    path.write_text("".join(lines[:2]) + lines[2][:10])  # a line being written
    assert [r["response"] for r in history_panel.read_rows(str(tmp_path))] == ["a", "b"]
    path.write_text("".join(lines[:4]))
    assert [r["response"] for r in history_panel.read_rows(str(tmp_path))] == ["a", "b", "c", "d"]
    # A resume from iteration 1's checkpoint: cut back to its rows, then iteration 2 again, other answers.
    redone = [json.dumps(_row(2, "Hi", f"new {i}", 1.0)) + "\n" for i in range(3)]
    path.write_text("".join(lines[:2] + redone))
    assert [r["response"] for r in history_panel.read_rows(str(tmp_path))] == ["a", "b", "new 0", "new 1", "new 2"]
    path.unlink()
    assert history_panel.read_rows(str(tmp_path)) == []


def test_the_prompt_list_keeps_those_answered_most_and_the_pick_while_listed():
    history = {1: [{"prompt": f"p{i}"} for i in range(history_panel.MAX_PROMPTS + 5)], 2: [{"prompt": "p300"}],
               3: [{"prompt": "p300"}]}
    history[1].append({"prompt": "p300"})
    choices, picked = history_panel.prompt_choice(history, "p2")
    assert len(choices) == history_panel.MAX_PROMPTS and choices[0] == "p300" and picked == "p2"
    assert history_panel.prompt_choice(history, "p204") == (choices, "p300")  # no longer listed: the first


def test_a_poll_carrying_the_last_runs_prompt_is_taken_after_a_new_run_emptied_the_list(tmp_path):
    """A Start attaches a run with no samples: a poll empties the prompt list, while a poll already sent
    still carries the old run's pick. The dropdown takes it (no error toast), and its answers are none."""
    import gradio as gr

    with gr.Blocks():
        panel = history_panel.layout()
    panel.prompt.choices = []  # as the new run's poll left it
    assert panel.prompt.preprocess("Why?") == "Why?"
    out = history_panel.poll(str(tmp_path), None, 3, "Why?", [])
    assert out[5]["choices"] == [] and out[5]["value"] is None and out[6] == []
