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
