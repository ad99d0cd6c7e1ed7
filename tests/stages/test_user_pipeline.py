"""The pipeline as a new user runs it on their own files: `homerlhf sft` -> `homerlhf reward` -> `homerlhf
train` with the default preset, on a tiny model built from code on a real tokenizer (Llama 3's), each
stage given the user's data by `--data` / `data.prompts`; each stage's figures must come from its own
data, never from the builtin demo task's. The run scores in process (the reference the policy's base
with its adapter off, the reward model in transformers): the llama.cpp workers' start-up is tested in
tests/stages/test_archs_end_to_end.py, and it is the data paths that are under test here."""

from __future__ import annotations

import json

import pytest

TOPICS = ["tea", "cats", "maps", "rain", "bread", "trains", "bees", "clocks", "rivers", "salt", "owls", "glass",
          "paper", "moss", "kites", "wool", "stars", "honey", "sand", "ferns"]


def homerlhf(capsys, *args: str) -> str:
    """The CLI in this process, as `homerlhf ARGS`: its stdout (a failure is its one-line error)."""
    from homerlhf.cli import main

    try:
        main(list(args))
    except SystemExit as exc:  # main exits only on an error
        pytest.fail(f"homerlhf {args[0]} exited {exc.code}: {capsys.readouterr().err[-2000:]}")
    return capsys.readouterr().out


def sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


@pytest.mark.slow
def test_sft_reward_train_on_the_users_files_report_figures_of_that_data(real_vocab_model_dir, tmp_path, capsys,
                                                                          monkeypatch):
    from homerlhf.app import preferences

    monkeypatch.chdir(tmp_path)
    base = real_vocab_model_dir("llama3_1")
    sft_file = tmp_path / "sft.jsonl"
    sft_file.write_text("".join(json.dumps({"prompt": f"Tell me about {t}.", "completion": f"Gladly! {t} are fine."})
                                + "\n" for t in TOPICS))
    # The preference pairs as the app's Evaluate tab writes them (left/right better clicks)
    prefs = tmp_path / "app-run"
    for t in TOPICS:
        for good, bad in ((f"Gladly! {t} are fine.", "Go away."), (f"Of course. {t} are nice.", "Not my problem.")):
            preferences.record_preference(prefs, f"Tell me about {t}.", good, bad, "left")
    pairs_file = prefs / preferences.PAIRS_FILE
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": f"Say something about {t}."}) + "\n" for t in TOPICS[:8]))

    out = homerlhf(capsys, "sft", "--data", str(sft_file), "--model", str(base), "--out", "sft",
                   *sets("sft.max_steps=1", "sft.batch_size=4", "logging.progress=false"))
    sft_run = json.loads((tmp_path / "sft" / "sft_run.json").read_text())
    assert sft_run["data"]["source"] == str(sft_file) and sft_run["n_train"] == 20
    assert out.strip().endswith(f"sft done: 20 examples, 1 steps, loss {sft_run['train_loss']:.3f}, model in sft/model")

    out = homerlhf(capsys, "reward", "--data", str(pairs_file), "--model", "sft/model", "--out", "rm",
                   *sets("rm.max_steps=1", "rm.batch_size=8", "rm.export_gguf=false", "logging.progress=false"))
    rm_run = json.loads((tmp_path / "rm" / "reward_run.json").read_text())
    # 40 pairs on 20 prompts: the default 0.1 split by prompt holds out 2 prompts, 4 pairs: too few for a
    # figure, so every pair trains and none of the preset's 200 builtin pairs is read
    assert rm_run["data"]["source"] == str(pairs_file) and rm_run["data"]["n_usable"] == 40
    assert (rm_run["n_train"], rm_run["n_eval"], rm_run["eval_accuracy"]) == (40, 0, None)
    assert rm_run["eval_source"] is None and rm_run["eval_data"] is None
    note = rm_run["eval_note"]
    assert note.startswith("rm.eval_data builtin:demo-pairs-heldout is the builtin task's held-out set, not "
                           f"{pairs_file}'s")
    assert f"40 pairs of {pairs_file} at data.eval_fraction 0.1 give 4 held-out pair(s) (+-0.49 at 95%)" in note
    assert "430 pairs (390 more)" in note
    assert 0.0 <= rm_run["train_accuracy"] <= 1.0
    last = out.strip().splitlines()[-1]
    assert last.startswith("reward done: 40 pairs, no held-out figure (rm.eval_data builtin:demo-pairs-heldout")
    assert last.endswith(f"training accuracy {rm_run['train_accuracy']:.3f}, run dir rm")

    out = homerlhf(capsys, "train", "--data", "prompts.jsonl", "--model", "sft/model", "--reward", "rm", "--out", "run",
                   *sets("reward.backend=hf", "ref.backend=adapter_off", "ppo.iterations=1", "rollout.batch_size=8",
                         "rollout.chunk_size=8", "rollout.max_new_tokens=6", "rollout.truncation_penalty=null",
                         "ppo.mini_batch_size=8", "ppo.micro_batch_size=8", "ppo.epochs=1", "logging.progress=false"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1] and rows[0]["kl_flag"] == 0
    asked = {f"Say something about {t}." for t in TOPICS[:8]}
    assert samples and all(sum(p in s["prompt"] for p in asked) == 1 for s in samples)  # the user's prompts only
    assert out.strip().splitlines()[-1].startswith(f"PPO done: 1 iterations, score {rows[0]['score_mean']:.3f} -> ")
    # The run's data line names the file --data gave (as typed: relative to where the user ran it).
    data_lines = [line for line in out.splitlines() if line.startswith("data: ")]
    assert data_lines == ["data: prompts.jsonl: prompt (prompt), 8 rows, 8 usable, 0 bad, 0 truncated, "
                          "0 dropped as too long"], out
    from homerlhf.config import from_yaml_file

    saved = from_yaml_file(tmp_path / "run" / "config.yaml")
    assert (saved.data.prompts, saved.model.name_or_path, saved.reward.model) == ("prompts.jsonl", "sft/model", "rm")
