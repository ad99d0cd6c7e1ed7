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


def test_a_folder_of_files_reads_the_split_its_names_give(tmp_path):
    """A folder as the hub lays one out: ``data/train-*.jsonl`` is the train split, ``test.jsonl`` another."""
    (tmp_path / "mine" / "data").mkdir(parents=True)
    write_jsonl(tmp_path / "mine" / "data" / "train-00000.jsonl", [{"prompt": "a?"}, {"prompt": "b?"}])
    write_jsonl(tmp_path / "mine" / "data" / "train-00001.jsonl", [{"prompt": "c?"}])
    write_jsonl(tmp_path / "mine" / "data" / "test.jsonl", [{"prompt": "held out?"}])
    records, report = load_prompts(str(tmp_path / "mine"))
    assert sorted(r["prompt"][0]["content"] for r in records) == ["a?", "b?", "c?"]
    assert (report.source, report.n_rows) == (str(tmp_path / "mine"), 3)
    cfg = load_config("cpu-tiny", overrides=["data.split=test"])
    assert [r["prompt"][0]["content"] for r in load_prompts(str(tmp_path / "mine"), cfg.data)[0]] == ["held out?"]


def test_a_folder_saved_by_datasets(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"question": "Why is the sky blue?"}, {"question": "What is rain?"}]).save_to_disk(
        str(tmp_path / "saved"))
    records, report = load_prompts(str(tmp_path / "saved"))
    assert [r["prompt"][0]["content"] for r in records] == ["Why is the sky blue?", "What is rain?"]
    assert report.format == "question"


def test_a_folder_without_data_files_or_of_two_kinds_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"^folder .*empty holds no .jsonl, .json, .csv or .parquet file"):
        load_prompts(str(tmp_path / "empty"))
    (tmp_path / "mixed").mkdir()
    write_jsonl(tmp_path / "mixed" / "a.jsonl", [{"prompt": "a?"}])
    (tmp_path / "mixed" / "b.csv").write_text("prompt\nb?\n")
    with pytest.raises(UserError, match=r"mixes file types \(csv, json\); keep one type per folder"):
        load_prompts(str(tmp_path / "mixed"))


def test_an_empty_file_is_one_line(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UserError, match=r"cannot read .*empty.jsonl: no JSON rows found"):
        load_prompts(str(tmp_path / "empty.jsonl"))


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
