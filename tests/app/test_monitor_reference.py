"""The reference run the monitor draws: the packaged measured demo run, what it keeps of a run's metrics, and
its lines beside a run of the demo's task only (dashed grey, with a note under the figure saying what it is)."""

from __future__ import annotations

import json
import math
from importlib.resources import files

from homerlhf.app import monitor, monitor_reference, train_tab
from homerlhf.app.monitor_plot import REFERENCE_COLOR, figure_texts
from homerlhf.config import load_config, redacted_dump, to_yaml
from homerlhf.stages.demo import demo_config


def test_the_packaged_reference_is_a_whole_demo_run_of_the_demos_task_now(tmp_path):
    reference = monitor_reference.load()
    assert reference == json.loads(files("homerlhf.app.reference").joinpath("demo_fast.json").read_text())
    head, rows = reference["header"], reference["rows"]
    assert head["command"] == "homerlhf demo --fast" and head["seed"] == 0 and "AMD EPYC" in head["cpu"]
    demo = demo_config(tmp_path)
    # Every iteration the demo runs, each with every kept metric: no gap drawn as a healthy run's.
    assert head["iterations"] == demo.ppo.iterations == len(rows)
    assert [row["iteration"] for row in rows] == list(range(1, demo.ppo.iterations + 1))
    assert all(set(row) == {"iteration", *monitor_reference.KEYS} for row in rows)
    # The task it applies to is the demo's as the demo builds it today (model, prompts, algorithm).
    assert monitor_reference.applies(redacted_dump(demo), reference)
    assert head["applies_to"] == {key: monitor_reference.value_at(redacted_dump(demo), key)
                                  for key in monitor_reference.APPLIES_TO}
    # Each metric it keeps is one the monitor draws.
    drawn = {key for _, keys in monitor.panel_keys(monitor_reference.KEYS) for key in keys}
    assert drawn == set(monitor_reference.KEYS)


def test_build_keeps_the_drawn_metrics_of_each_iteration_and_says_what_ran(tmp_path):
    config = redacted_dump(load_config("cpu-tiny", None, [f"output_dir={tmp_path}", "seed=3"]))
    rows = [{"iteration": 1, "score_mean": -0.5, "kl_mean": math.nan, "policy_loss": 0.2, "entropy": 0.14},
            {"score_mean": 9.0},  # no iteration: not a row of the run
            {"iteration": 2, "score_mean": 0.25, "kl_mean": 0.01, "signal_length_drift": 1.1, "kl_flag": True}]
    built = monitor_reference.build(rows, config, "homerlhf train", "some CPU", "2026-01-02")
    assert built["rows"] == [{"iteration": 1, "score_mean": -0.5, "entropy": 0.14},
                             {"iteration": 2, "score_mean": 0.25, "kl_mean": 0.01, "signal_length_drift": 1.1}]
    assert built["header"] == {
        "command": "homerlhf train", "seed": 3, "cpu": "some CPU", "date": "2026-01-02", "iterations": 2,
        "applies_to": {"model.name_or_path": config["model"]["name_or_path"], "data.prompts": config["data"]["prompts"],
                       "algorithm": config["algorithm"]}}
    assert json.loads(monitor_reference.dumps(built)) == built


def _run(path, config, rows) -> str:
    path.mkdir()
    (path / "config.yaml").write_text(to_yaml(config))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _reference_traces(figure) -> list:
    return [trace for trace in figure.data if trace.name.startswith(monitor_reference.NAME)]


def test_the_reference_is_drawn_beside_a_run_of_the_demos_task_and_no_other(tmp_path):
    rows = [{"iteration": i, "score_mean": 0.1 * i, "kl_mean": 0.01 * i, "policy_loss": 0.1, "entropy": 0.13,
             "signal_length_corr": 0.5, "signal_length_drift": 1.0} for i in (1, 2)]
    demo = _run(tmp_path / "demo", demo_config(tmp_path / "demo"), rows)
    figure = train_tab.poll(demo)[2]
    drawn = _reference_traces(figure)
    name = monitor_reference.NAME
    # Alone in its panel (score, KL, entropy) named for the reference; beside another, for the metric too.
    assert sorted((trace.meta, trace.name) for trace in drawn) == [
        ("entropy", name), ("kl_mean", name), ("score_mean", name),
        ("signal_length_corr", f"{name}: score-length correlation"),
        ("signal_length_drift", f"{name}: length / first iterations'")]
    reference = monitor_reference.load()["rows"]
    for trace in drawn:
        assert list(trace.x) == [row["iteration"] for row in reference]
        assert list(trace.y) == [row[trace.meta] for row in reference]
        assert trace.line.color == REFERENCE_COLOR and trace.line.dash in ("dash", "dot") and trace.mode == "lines"
    # One per panel of its keys, in that panel (the run's own line of the key shares its axes).
    own = {trace.meta: trace for trace in figure.data if not trace.name.startswith(name)}
    assert all(trace.xaxis == own[trace.meta].xaxis for trace in drawn)
    head = monitor_reference.load()["header"]
    note = (f"Dashed grey: a {name}, 'homerlhf demo --fast' (seed 0, {head['iterations']} iterations), "
            f"measured on {head['cpu']}, {head['date']}.")
    assert note in figure_texts(figure)
    # Other tasks, and a run whose config cannot be read: the run's lines alone, no note.
    others = {"plain cpu-tiny (PPO)": load_config("cpu-tiny", None, [f"output_dir={tmp_path}"]),
              "the demo on other prompts": demo_config(tmp_path / "x", overrides=("data.prompts=mine.jsonl",))}
    for i, (what, config) in enumerate(others.items()):
        figure = train_tab.poll(_run(tmp_path / f"other{i}", config, rows))[2]
        assert not _reference_traces(figure) and not [t for t in figure_texts(figure) if "Dashed grey" in t], what
    (tmp_path / "demo" / "config.yaml").write_text("model: [unclosed")
    assert not _reference_traces(train_tab.poll(demo)[2])
    assert monitor_reference.for_run(tmp_path / "nowhere") is None
