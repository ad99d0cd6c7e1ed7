"""The Data tab's helpers on the real loader: counts, bad rows with reasons, readable errors."""

from __future__ import annotations

import json

import pytest

from homerlhf.app import data_tab
from homerlhf.errors import UserError


def test_upload_with_bad_rows_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("HOMERLHF_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "prefs.jsonl"
    good = [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(3)]
    lines = [json.dumps(r) for r in good] + [json.dumps({"prompt": "q", "chosen": "same", "rejected": "same"}),
                                             "{not json"]
    path.write_text("\n".join(lines) + "\n")
    source = data_tab.resolve_source("upload", None, "", str(path))
    assert source != str(path) and json.loads(open(source).readline()) == good[0]  # kept out of Gradio's temp dir

    records, report = data_tab.load_for_ui(source, "preference")
    text = data_tab.report_markdown(report)
    assert "**Rows:** 5 · **usable:** 3 · **bad:** 2" in text
    reasons = [row[1] for row in data_tab.bad_rows_table(report)]
    assert reasons == ["chosen == rejected", "not valid JSON"]
    table = data_tab.sample_table(records)
    assert table[0] == ["user: q0", "assistant: good 0", "assistant: bad 0"]
    lengths = data_tab.record_lengths(records)
    assert lengths["prompt"] == [2, 2, 2] and lengths["chosen"] == [6, 6, 6]
    assert data_tab.length_figure(lengths).axes[0].get_xlabel() == "length (characters)"


def test_bad_choices_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="upload a .jsonl"):
        data_tab.resolve_source("upload", None, "", None)
    with pytest.raises(UserError, match="type a hub dataset id"):
        data_tab.resolve_source("hub id", None, " ", None)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(UserError, match="jsonl"):
        data_tab.load_for_ui(str(text), "prompt")


def test_builtin_kind_follows_the_dataset():
    assert data_tab.default_kind("builtin:demo-pairs-heldout") == "preference"
    assert data_tab.default_kind("builtin:demo-sft") == "sft"
    assert data_tab.default_kind("builtin:demo") == "prompt"


def test_bad_rows_are_placed_by_the_files_line_counted_from_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HOMERLHF_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "prefs.jsonl"
    good = json.dumps({"prompt": "q", "chosen": "good", "rejected": "bad"})
    # line 1 good, line 2 blank (skipped by the reader), line 3 good, line 4 not JSON, line 5 chosen == rejected
    path.write_text("\n".join([good, "", good, "{not json", json.dumps({"prompt": "q", "chosen": "s", "rejected": "s"})]))
    _, report = data_tab.load_for_ui(str(path), "preference")
    assert [row[:2] for row in data_tab.bad_rows_table(report)] == [["line 4", "not valid JSON"],
                                                                   ["line 5", "chosen == rejected"]]
    csv_path = tmp_path / "prefs.csv"  # line 1 the header, line 3 blank
    csv_path.write_text("prompt,chosen,rejected\nq,good,bad\n\nq,same,same\n")
    _, report = data_tab.load_for_ui(str(csv_path), "preference")
    assert [row[:2] for row in data_tab.bad_rows_table(report)] == [["line 4", "chosen == rejected"]]
    places = data_tab.row_places("builtin:demo-pairs")  # no file: rows, counted from 1
    assert (places(0), places(41)) == ("row 1", "row 42")


def test_column_keys_are_the_tabs_own_fields(tmp_path, monkeypatch):
    path = tmp_path / "texts.jsonl"
    path.write_text(json.dumps({"text": "Say hi."}) + "\n" + json.dumps({"text": "Say bye."}) + "\n")
    with pytest.raises(UserError) as caught:
        data_tab.load_for_ui(str(path), "prompt")
    assert str(caught.value) == ("cannot find prompts among columns ['text']; fill 'Prompt column' (or 'Messages "
                                 "column') (under 'Column names')")
    records, _ = data_tab.load_for_ui(str(path), "prompt", columns=("text", "", "", ""))  # the field the error names
    assert [r["prompt"] for r in records] == [[{"role": "user", "content": "Say hi."}],
                                              [{"role": "user", "content": "Say bye."}]]
    # A data key the tab has no field for is said to go in the Plan tab's overrides (tokens.py's words).
    assert data_tab.app_words("raise the max length or use data.overlong=truncate; or data.max_rows") == (
        "raise the max length or use data.overlong=truncate (in the Plan tab's overrides); or 'Max rows'")
    # Use for training loads what is on screen and writes the column it loaded with, beside the source.
    monkeypatch.setenv("HOMERLHF_CACHE", str(tmp_path / "cache"))
    screen = ["upload", None, "", str(path), "prompts (PPO)", "train", 0, "text", "", "", ""]
    message, overrides, report, *_ = data_tab.use_screen(screen, "", "ppo.iterations=3")
    source = tmp_path / "cache" / "app" / "uploads" / "texts.jsonl"
    assert "**Rows:** 2 · **usable:** 2 · **bad:** 0" in report
    assert overrides.splitlines() == ["ppo.iterations=3", f"data.prompts={source}", "data.prompt_column=text"]
    assert message == f"Set `data.prompts={source}` `data.prompt_column=text` in the Plan tab's overrides."
