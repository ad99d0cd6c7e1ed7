"""Where rows come from: builtin names, missing or unreadable files, the row cap."""

from __future__ import annotations

import json

import pytest

from homerlhf.config import load_config
from homerlhf.data.load import load_preferences, load_prompts, load_sft
from homerlhf.data.read import read_rows
from homerlhf.errors import UserError


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_builtin_sources():
    prompts, report = load_prompts("builtin:demo")
    assert report.n_bad == 0 and len(prompts) == 120  # 20 topics x 8 templates, less the 40 held out
    pairs, _ = load_preferences("builtin:demo-pairs")
    held, _ = load_preferences("builtin:demo-pairs-heldout")
    held_prompts = {p["prompt"][0]["content"] for p in held}
    assert not {p["prompt"][0]["content"] for p in pairs} & held_prompts
    assert not {p["prompt"][0]["content"] for p in prompts} & held_prompts
    sft, _ = load_sft("builtin:demo-sft")
    assert len(sft) == 600 and sft[0]["completion"][0]["role"] == "assistant"
    with pytest.raises(UserError, match="unknown builtin dataset 'builtin:nope'"):
        load_prompts("builtin:nope")


def test_missing_file_and_bad_suffix(tmp_path):
    with pytest.raises(UserError, match="dataset file not found"):
        load_prompts(str(tmp_path / "nope.jsonl"))
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(UserError, match="use a .jsonl, .json, .csv or .parquet file"):
        load_prompts(str(tmp_path / "data.txt"))


def test_max_rows(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(10)])
    cfg = load_config("cpu-tiny", overrides=["data.max_rows=3"])
    records, report = load_prompts(src, cfg.data)
    assert len(records) == 3 and report.n_rows == 3


def test_a_hub_dataset_is_refused_at_once_when_the_hub_cannot_be_reached(monkeypatch, tmp_path):
    """Not in the datasets cache and no hub: one line in well under the 24 s of the download's retries."""
    import time

    import datasets

    from homerlhf import hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    monkeypatch.setattr(hub, "hub_unreachable", lambda: "no answer from https://huggingface.co: ConnectError")
    start = time.monotonic()
    with pytest.raises(UserError, match=r"cannot load dataset 'org/name': it is not in the datasets cache and the "
                                        r"hub cannot be reached \(no answer from https://huggingface.co"):
        read_rows("org/name", "train")
    assert time.monotonic() - start < 2.0
