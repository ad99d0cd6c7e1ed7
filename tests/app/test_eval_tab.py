"""The Evaluate tab's handlers without a browser: the checkpoint list follows the run, identical answers
make no pair, and the counts only suggest training on pairs that exist."""

from __future__ import annotations

import json

from homerlhf.app import eval_tab, preferences


def test_the_checkpoint_list_follows_the_run_and_keeps_an_older_pick(tmp_path):
    ckpts = tmp_path / "checkpoints"
    (ckpts / "iter_000001").mkdir(parents=True)
    update, known = eval_tab.follow_checkpoints(str(tmp_path), None, [])
    assert update["value"] == str(ckpts / "iter_000001") and known == [str(ckpts / "iter_000001")]
    assert eval_tab.follow_checkpoints(str(tmp_path), known[0], known)[0] == {"__type__": "update"}  # nothing new
    (ckpts / "iter_000002").mkdir()
    update, known = eval_tab.follow_checkpoints(str(tmp_path), str(ckpts / "iter_000001"), known)
    assert update["value"] == str(ckpts / "iter_000002")  # the newest was selected: follow it
    assert [path for _, path in update["choices"]] == known == [str(ckpts / "iter_000002"), str(ckpts / "iter_000001")]
    (ckpts / "iter_000003").mkdir()
    update, _ = eval_tab.follow_checkpoints(str(tmp_path), str(ckpts / "iter_000001"), known)  # an older pick
    assert update["value"] == str(ckpts / "iter_000001") and len(update["choices"]) == 3


def test_identical_answers_say_so_and_record_no_pair(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"iteration": 3, "kl_mean": 0.00123}) + "\n")
    pending = {"prompt": "Tell me about tea.", "left": "Tea.", "right": "Tea.", "left_score": -4.3422,
               "right_score": -4.3422, "checkpoint": "c", "run_dir": str(tmp_path), "sampling": {}}
    text = eval_tab.identical_markdown(str(tmp_path), 0)
    assert text.startswith("**The two answers are identical** (seed 0)")
    assert "KL to the reference so far: 0.0012 nats per response at iteration 3" in text
    left, tie, right, resample = eval_tab.button_states(pending)
    assert (left["interactive"], tie["interactive"], right["interactive"], resample["interactive"]) == (
        False, True, False, True)
    info, still_pending, *_ = eval_tab.judge("left")(pending)
    assert info.startswith("**Error:** the two answers are identical") and still_pending == {"__type__": "update"}
    assert preferences.count(tmp_path) == (0, 0)
    info, cleared, *buttons = eval_tab.judge("tie")(pending)
    # Judged once: Left, Tie and Right off; Resample (and the feedback row) stay for this exchange.
    assert "Recorded **tie**" in info and cleared["judged"] and [b["interactive"] for b in buttons] == [False, False, False, True]
    # No pair yet: no command that would train on a file that does not exist.
    assert "No preference pair yet" in info and "homerlhf reward" not in info
    assert preferences.count(tmp_path) == (0, 1)


def test_two_different_answers_make_a_pair_and_the_reply_names_the_training_command(tmp_path):
    # The browser's run leaves the policy where it started (identical answers): the pair path is here.
    pending = {"prompt": "Tell me about tea.", "left": "Tea is a drink.", "right": "Go away.", "left_score": 0.9,
               "right_score": -0.8, "checkpoint": "ckpt/iter_000001", "run_dir": str(tmp_path), "sampling": {"seed": 0}}
    left, tie, right, resample = eval_tab.button_states(pending)
    assert left["interactive"] and right["interactive"] and tie["interactive"] and resample["interactive"]
    info, cleared, *_ = eval_tab.judge("left")(pending)
    assert cleared["pairs"] == [["Tea is a drink.", "Go away."]] and preferences.count(tmp_path) == (1, 0)
    assert f"Train a reward model on them: `homerlhf reward --data {tmp_path / preferences.PAIRS_FILE}`" in info
    record = json.loads((tmp_path / preferences.PAIRS_FILE).read_text())
    assert (record["chosen"], record["rejected"], record["chosen_source"]) == ("Tea is a drink.", "Go away.", "actor")


def _checkpoint(run, iteration: int):
    """A sealed checkpoint of stand-in files (what the lists and the check read; no weights)."""
    from homerlhf.ppo.manifest import write_manifest

    ckpt = run / "checkpoints" / f"iter_{iteration:06d}"
    (ckpt / "actor").mkdir(parents=True)
    (ckpt / "actor" / "adapter_model.safetensors").write_bytes(b"stand-in weights " * 8)
    (ckpt / "config.yaml").write_text("seed: 0\n")
    (ckpt / "optimizers.pt").write_bytes(b"stand-in states")
    write_manifest(ckpt, iteration)
    return ckpt


def _flip_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_changed_checkpoint_is_marked_not_selected_and_refused_before_it_loads(tmp_path, monkeypatch):
    from homerlhf.app import chat
    from homerlhf.app.common import error_box, guarded

    first, second = _checkpoint(tmp_path, 1), _checkpoint(tmp_path, 2)
    _flip_byte(second / "actor" / "adapter_model.safetensors")
    _flip_byte(first / "optimizers.pt")  # not what the Evaluate tab loads: no mark
    choices = eval_tab.checkpoint_choices(str(tmp_path))
    assert choices == [("iter_000002 (not usable: actor/adapter_model.safetensors does not match its MANIFEST.json "
                        "sha256 (changed after it was written))", str(second)), ("iter_000001", str(first))]
    assert eval_tab.default_checkpoint(choices) == str(first)
    update, _ = eval_tab.follow_checkpoints(str(tmp_path), None, [])
    assert update["value"] == str(first)

    loads = []
    monkeypatch.setattr(chat, "get_models", lambda *a: loads.append(a))
    outputs = guarded(11, error_index=4)(eval_tab.on_send)(str(tmp_path), str(second), eval_tab.BASE, "Hi", [], [], 8, 1.0,
                                                             1.0, 0, 0)
    assert outputs[4] == error_box(f"checkpoint {second}: actor/adapter_model.safetensors does not match its "
                                   "MANIFEST.json sha256 (changed after it was written); pick iter_000001 instead")
    assert loads == []


def test_a_feedback_run_lists_the_checkpoint_it_started_from_after_its_own(tmp_path):
    import json

    from homerlhf.app import feedback_runs

    start = _checkpoint(tmp_path / "app-1", 1)
    run = tmp_path / "dpo-1"
    (run / feedback_runs.FOLDER).mkdir(parents=True)
    (run / feedback_runs.FOLDER / feedback_runs.INFO_FILE).write_text(json.dumps({"start_checkpoint": str(start)}))
    choices = eval_tab.checkpoint_choices(str(run))
    assert choices == [("iter_000001 of app-1 (where this run started)", str(start))]
    assert eval_tab.default_checkpoint(choices) == str(start)  # nothing of its own yet: the start answers
    own = _checkpoint(run, 4)
    update, known = eval_tab.follow_checkpoints(str(run), str(start), [str(start)])
    assert update["choices"] == [("iter_000004", str(own)), ("iter_000001 of app-1 (where this run started)", str(start))]
    assert update["value"] == str(own) and known == [str(own), str(start)]  # the new policy, the old beside it
    # The right side compares with where it started by default (either side can be the base or any checkpoint).
    assert eval_tab.default_right(str(run)) == str(start)
    assert eval_tab.right_choices(str(run)) == [(eval_tab.BASE_LABEL, eval_tab.BASE), *update["choices"]]
    left, right, _ = eval_tab.follow_both(str(run), str(own), str(start), known)
    assert (left, right) == ({"__type__": "update"},) * 2  # nothing new: nothing moves
    assert eval_tab.default_right(str(tmp_path / "app-1")) == eval_tab.BASE  # a PPO run: the reference


def test_another_run_followed_clears_the_exchange():
    left, right, left_score, right_score, info, pending, *buttons = eval_tab.cleared("note")
    assert (left["value"], right["value"], left_score, right_score, info, pending) == ([], [], "", "", "note", None)
    assert left["label"] == eval_tab.LEFT_LABEL and not any(b["interactive"] for b in buttons)


def test_kl_so_far_says_why_a_k1_mean_can_be_negative(tmp_path):
    """The monitor's note for a negative k1 mean, where Evaluate quotes the last KL (issue 44, item 4)."""
    import json

    from homerlhf.app.eval_tab import kl_so_far
    from homerlhf.app.monitor_notes import NEGATIVE_KL

    metrics = tmp_path / "metrics.jsonl"
    assert kl_so_far(str(tmp_path)) == ""
    metrics.write_text(json.dumps({"iteration": 1, "kl_mean": 0.0}) + "\n" + json.dumps({"iteration": 2, "kl_mean": -0.018}) + "\n")
    assert kl_so_far(str(tmp_path)) == f"KL to the reference so far: -0.0180 nats per response at iteration 2 ({NEGATIVE_KL})"
    metrics.write_text(json.dumps({"iteration": 3, "kl_mean": 0.25}) + "\n")
    assert kl_so_far(str(tmp_path)) == "KL to the reference so far: 0.2500 nats per response at iteration 3"


def test_a_send_names_both_sides_and_keeps_what_answered_on_the_right(tmp_path, monkeypatch):
    """Each window says who answered: the checkpoint picked on the left; on the right the base (adapter off) or the
    checkpoint compared, whose answers are marked so (not "reference") in what the feedback rows record."""
    from homerlhf.app import chat
    from homerlhf.models.side_by_side import Answer

    first, second = _checkpoint(tmp_path / "ppo", 1), _checkpoint(tmp_path / "dpo", 2)
    loaded = []

    class Models:
        def answer_both(self, text, sampling):
            return Answer("Tea is a drink.", [1], [2], 0.5), Answer("Go away.", [1], [3], -0.5)

    monkeypatch.setattr(chat, "get_models", lambda *a: loaded.append(a) or Models())
    out = eval_tab.on_send(str(tmp_path / "dpo"), str(second), str(first), "Tea?", [], [], 8, 1.0, 1.0, 0, 0)
    left, right, pending = out[0], out[1], out[5]
    assert (left["label"], right["label"]) == ("Left: iter_000002 of dpo", "Right: iter_000001 of ppo")
    assert loaded == [(str(tmp_path / "dpo"), str(second), str(first))]
    assert [a["source"] for a in pending["answers"]] == ["actor", "compared"] and pending["right_checkpoint"] == str(first)
    out = eval_tab.on_send(str(tmp_path / "dpo"), str(second), eval_tab.BASE, "Tea?", [], [], 8, 1.0, 1.0, 0, 0)
    assert out[1]["label"] == f"Right: {eval_tab.BASE_LABEL}" and out[5]["answers"][1]["source"] == "reference"
    assert loaded[-1] == (str(tmp_path / "dpo"), str(second), None)
