"""Every dataset format the loader accepts, written to a real file (with malformed rows), read with
the ``datasets`` library and checked record by record, with the bad-row report (sources:
test_read.py; tokenisation: test_tokens.py)."""

from __future__ import annotations

import json

import pytest

from homerlhf.config import load_config
from homerlhf.data.formats import parse_hh
from homerlhf.data.load import LoadReport, load_preferences, load_prompts, load_sft
from homerlhf.errors import UserError


def user(text):
    return {"role": "user", "content": text}


def bot(text):
    return {"role": "assistant", "content": text}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows):
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def reasons(report: LoadReport) -> list[str]:
    return [b["reason"] for b in report.bad_examples]


# ----------------------------------------------------------------------------------- prompts


def test_prompt_column_with_bad_rows(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "Tell me about tea."},
        {"prompt": ""},
        {"prompt": None},
        {"prompt": "What is rain?"},
        {"other": "x"},
    ])
    records, report = load_prompts(src)
    assert records == [{"prompt": [user("Tell me about tea.")]}, {"prompt": [user("What is rain?")]}]
    assert (report.format, report.n_rows, report.n_usable, report.n_bad) == ("prompt", 5, 2, 3)
    assert reasons(report) == ["empty prompt", "missing prompt", "missing prompt"]
    assert [b["row"] for b in report.bad_examples] == [1, 2, 4]


def test_prompt_wrong_type_row_is_bad_not_fatal(tmp_path):
    # Arrow cannot hold an int and strings in one column; the row must become a bad row.
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok one"}, {"prompt": 7}, {"prompt": "ok two"}])
    (tmp_path / "p.jsonl").write_text((tmp_path / "p.jsonl").read_text() + "{not json\n")
    records, report = load_prompts(src)
    assert [r["prompt"][0]["content"] for r in records] == ["ok one", "ok two"]
    assert report.n_bad == 2
    assert reasons(report) == ["prompt should be text, got int", "not valid JSON"]


def test_mixed_prompt_formats_keep_every_row(tmp_path):
    """The format is detected per row: one file mixing prompt, instruction+input and messages rows."""
    src = write_jsonl(tmp_path / "mixed.jsonl", [
        {"prompt": "Tell me about tea."},
        {"instruction": "Summarise this.", "input": "Rain falls."},
        {"messages": [user("Hello there.")]},
        {"prompt": ""},
    ])
    records, report = load_prompts(src)
    assert [r["prompt"][-1]["role"] for r in records] == ["user"] * 3
    assert records[0] == {"prompt": [user("Tell me about tea.")]}
    assert "Summarise this." in records[1]["prompt"][-1]["content"] and "Rain falls." in records[1]["prompt"][-1]["content"]
    assert records[2] == {"prompt": [user("Hello there.")]}
    assert (report.n_rows, report.n_usable, report.n_bad) == (4, 3, 1)
    assert reasons(report) == ["empty prompt"]
    assert report.format.split(" + ") == ["prompt", "instruction/input", "messages (messages)"]


def test_question_column_csv(tmp_path):
    path = tmp_path / "q.csv"
    path.write_text('question,id\n"How do bees make honey?",1\n,2\n"Why is snow light?",3\n')
    records, report = load_prompts(str(path))
    assert [r["prompt"] for r in records] == [[user("How do bees make honey?")], [user("Why is snow light?")]]
    assert report.format == "question" and report.n_bad == 1
    assert reasons(report) == ["missing question"]


def test_instruction_and_input_json_list(tmp_path):
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps([
        {"instruction": "Summarise the text.", "input": "Cats sleep a lot.", "output": "Cats nap."},
        {"instruction": "Name a star.", "input": "", "output": "The sun."},
        {"instruction": "  ", "input": "x", "output": "y"},
    ]))
    records, report = load_prompts(str(path))
    assert [r["prompt"] for r in records] == [
        [user("Summarise the text.\n\nCats sleep a lot.")],
        [user("Name a star.")],
    ]
    assert report.format == "instruction/input" and reasons(report) == ["empty instruction"]


def test_messages_ending_in_user_turn_parquet(tmp_path):
    src = write_parquet(tmp_path / "m.parquet", [
        {"messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi!"}]},
        {"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]},
        {"messages": [{"role": "assistant", "content": "Only a reply."}]},
        {"messages": []},
    ])
    records, report = load_prompts(src)
    assert records == [
        {"prompt": [{"role": "system", "content": "Be kind."}, user("Hi!")]},
        {"prompt": [user("Q?")]},  # a full dialogue gives its prompt: the trailing reply is dropped
    ]
    assert report.format == "messages (messages)"
    assert reasons(report) == ["prompt has no user turn", "empty messages"]


def test_prompt_column_override(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [{"query": "a?", "prompt": "ignored"}, {"query": "b?", "prompt": "x"}])
    cfg = load_config("cpu-tiny", overrides=["data.prompt_column=query"])
    records, report = load_prompts(src, cfg.data)
    assert [r["prompt"][0]["content"] for r in records] == ["a?", "b?"]
    cfg = load_config("cpu-tiny", overrides=["data.prompt_column=nope"])
    with pytest.raises(UserError, match="data.prompt_column 'nope' is not a column"):
        load_prompts(src, cfg.data)


def test_prompts_from_a_preference_file_when_asked(tmp_path):
    src = write_jsonl(tmp_path / "hh.jsonl", [
        {"chosen": "\n\nHuman: Hi?\n\nAssistant: Hello!", "rejected": "\n\nHuman: Hi?\n\nAssistant: Go away."},
    ])
    records, _ = load_prompts(src, load_config("cpu-tiny", overrides=["data.prompts_from_pairs=true"]).data)
    assert records == [{"prompt": [user("Hi?")]}]


@pytest.mark.parametrize("rows", [
    [{"chosen": "\n\nHuman: Hi?\n\nAssistant: Hello!", "rejected": "\n\nHuman: Hi?\n\nAssistant: Go away."}],
    [{"prompt": "Hi?", "chosen": "Hello!", "rejected": "Go away."}],
], ids=["hh", "prompt-chosen-rejected"])
def test_a_preference_file_given_as_prompts_is_refused_in_one_line(tmp_path, rows):
    """Pairs where prompts were asked for are most likely the wrong file (the reward model's)."""
    src = write_jsonl(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(UserError, match=r"pairs.jsonl holds preference pairs \(chosen, rejected\), not prompts: give "
                                        r"it to `homerlhf reward`.*set data.prompts_from_pairs=true$"):
        load_prompts(src)
    # A prompt column named on purpose is taken as asked.
    named = load_config("cpu-tiny", overrides=["data.prompt_column=prompt"]).data
    if "prompt" in rows[0]:
        assert load_prompts(src, named)[0] == [{"prompt": [user("Hi?")]}]


# ------------------------------------------------------------------------------- preferences


def test_prompt_chosen_rejected_text(tmp_path):
    src = write_jsonl(tmp_path / "pcr.jsonl", [
        {"prompt": "Tell me about tea.", "chosen": "Tea is steeped leaves.", "rejected": "Go away."},
        {"prompt": "Same?", "chosen": "yes", "rejected": "yes"},
        {"prompt": "Missing", "chosen": "only chosen", "rejected": None},
        {"prompt": "Empty", "chosen": " ", "rejected": "no"},
    ])
    records, report = load_preferences(src)
    assert records == [{
        "prompt": [user("Tell me about tea.")],
        "chosen": [bot("Tea is steeped leaves.")],
        "rejected": [bot("Go away.")],
    }]
    assert report.format == "prompt/chosen/rejected"
    assert (report.n_rows, report.n_usable, report.n_bad) == (4, 1, 3)
    assert reasons(report) == ["chosen == rejected", "missing rejected", "empty chosen"]


def test_bad_rows_are_counted_per_reason_beyond_the_examples_shown(tmp_path):
    """Every skipped row counts under its reason, also past the few examples the report shows."""
    good = [{"prompt": f"Q{i}?", "chosen": "a fine answer", "rejected": "no"} for i in range(2)]
    same = [{"prompt": f"S{i}?", "chosen": "yes", "rejected": "yes"} for i in range(7)]
    blank = [{"prompt": f"B{i}?", "chosen": "ok", "rejected": " \n\t"} for i in range(3)]
    records, report = load_preferences(write_jsonl(tmp_path / "mixed.jsonl", good + same + blank))
    assert len(records) == 2 and report.n_bad == 10
    assert report.bad_reasons == {"chosen == rejected": 7, "empty rejected": 3}
    assert "bad rows by reason: chosen == rejected 7, empty rejected 3" in report.summary()


def test_anthropic_hh_text_multi_turn(tmp_path):
    shared = "\n\nHuman: What is rain?\n\nAssistant: Water falling.\n\nHuman: Why does it fall?"
    src = write_jsonl(tmp_path / "hh.jsonl", [
        {"chosen": shared + "\n\nAssistant: Drops grow heavy.", "rejected": shared + "\n\nAssistant: Dunno."},
        {"chosen": "no markers here", "rejected": "none here either"},
        {"chosen": shared + "\n\nAssistant: Same.", "rejected": shared + "\n\nAssistant: Same."},
    ])
    records, report = load_preferences(src)
    assert records == [{
        "prompt": [user("What is rain?"), bot("Water falling."), user("Why does it fall?")],
        "chosen": [bot("Drops grow heavy.")],
        "rejected": [bot("Dunno.")],
    }]
    assert report.format == "chosen/rejected dialogues"
    assert reasons(report) == [
        "chosen/rejected are plain text without a prompt; set data.prompt_column",
        "chosen == rejected",
    ]


def test_parse_hh():
    assert parse_hh("\n\nHuman: a b\n\nAssistant: c") == [user("a b"), bot("c")]
    assert parse_hh("Human: a\n\nAssistant:") == [user("a"), bot("")]
    assert parse_hh("plain text") == []


def test_ultrafeedback_binarized_message_lists(tmp_path):
    def conv(q, a):
        return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]

    src = write_parquet(tmp_path / "uf.parquet", [
        {"prompt": "Name a river.", "chosen": conv("Name a river.", "The Nile."), "rejected": conv("Name a river.", "Pizza."),
         "score_chosen": 9.0, "score_rejected": 2.0},
        {"prompt": "Bad roles", "chosen": [{"role": "wizard", "content": "x"}], "rejected": conv("q", "b"),
         "score_chosen": 1.0, "score_rejected": 0.0},
        {"prompt": "Diverges at the user turn", "chosen": conv("q1", "a"), "rejected": conv("q2", "b"),
         "score_chosen": 1.0, "score_rejected": 0.0},
    ])
    records, report = load_preferences(src)
    assert records == [{"prompt": [user("Name a river.")], "chosen": [bot("The Nile.")], "rejected": [bot("Pizza.")]}]
    assert report.format == "prompt/chosen/rejected" and report.n_bad == 2
    assert reasons(report) == [
        "chosen[0] has unknown role 'wizard'",
        "chosen and rejected share no prompt that ends in a user turn",
    ]


def test_sharegpt_conversations_with_chosen_rejected(tmp_path):
    src = write_jsonl(tmp_path / "sg.jsonl", [
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "2+2?"}],
         "chosen": {"from": "gpt", "value": "4"}, "rejected": {"from": "gpt", "value": "5"}},
        {"conversations": [{"from": "human", "value": "Hi"}],
         "chosen": {"from": "gpt", "value": ""}, "rejected": {"from": "gpt", "value": "x"}},
        {"conversations": "not a list",
         "chosen": {"from": "gpt", "value": "a"}, "rejected": {"from": "gpt", "value": "b"}},
    ])
    records, report = load_preferences(src)
    assert records == [{
        "prompt": [{"role": "system", "content": "Be brief."}, user("2+2?")],
        "chosen": [bot("4")],
        "rejected": [bot("5")],
    }]
    assert report.format.startswith("sharegpt preference")
    assert reasons(report) == ["empty chosen content", "conversations should be a list of messages, got str"]


def test_column_overrides_csv_with_json_cells(tmp_path):
    path = tmp_path / "custom.csv"
    path.write_text(
        "question_text,good,bad\n"
        '"Tell me about cats.","Cats purr.","Whatever."\n'
        '"Tell me about maps.","A map shows places.",\n'
        '"Tell me about snow.","[{""role"": ""assistant"", ""content"": ""Snow is cold.""}]","Meh."\n'
    )
    cfg = load_config("cpu-tiny", overrides=[
        "data.prompt_column=question_text", "data.chosen_column=good", "data.rejected_column=bad",
    ])
    records, report = load_preferences(str(path), cfg.data)
    assert records == [
        {"prompt": [user("Tell me about cats.")], "chosen": [bot("Cats purr.")], "rejected": [bot("Whatever.")]},
        # a message list kept as JSON text in a CSV cell is parsed
        {"prompt": [user("Tell me about snow.")], "chosen": [bot("Snow is cold.")], "rejected": [bot("Meh.")]},
    ]
    assert reasons(report) == ["missing bad"]


def test_no_chosen_rejected_columns_is_one_line_error(tmp_path):
    src = write_jsonl(tmp_path / "x.jsonl", [{"a": 1}])
    with pytest.raises(UserError, match="no chosen/rejected columns") as err:
        load_preferences(src)
    assert "\n" not in str(err.value) and "data.chosen_column" in str(err.value)


def test_no_usable_row_is_one_line_error(tmp_path):
    src = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "p", "chosen": "same", "rejected": "same"}] * 3)
    with pytest.raises(UserError, match=r"no usable rows .*3 bad; first: chosen == rejected") as err:
        load_preferences(src)
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------------- SFT


def test_sft_formats(tmp_path):
    pc = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Hi", "completion": "Hello"}, {"prompt": "Hi", "completion": 3}])
    records, report = load_sft(pc)
    assert records == [{"prompt": [user("Hi")], "completion": [bot("Hello")]}]
    assert reasons(report) == ["completion should be text, got int"]

    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": "Add", "input": "2 and 2", "output": "4"}]))
    records, _ = load_sft(str(alpaca))
    assert records == [{"prompt": [user("Add\n\n2 and 2")], "completion": [bot("4")]}]

    msgs = write_jsonl(tmp_path / "m.jsonl", [
        {"messages": [user("Q"), bot("A")]},
        {"messages": [user("only a question")]},
    ])
    records, report = load_sft(msgs)
    assert records == [{"prompt": [user("Q")], "completion": [bot("A")]}]
    assert reasons(report) == ["messages must end with an assistant turn after a user turn"]
