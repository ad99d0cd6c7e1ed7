"""The monitor's parsing, panel grouping, ETA and worker checks, without a browser."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from homerlhf.app import monitor


def test_read_jsonl_skips_torn_and_bad_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 1, "score_mean": 0.5}\n[1, 2]\nnot json\n\n{"iteration": 2, "score_mean": 0.7}\n{"iter')
    rows = monitor.read_jsonl(path)
    assert rows == [{"iteration": 1, "score_mean": 0.5}, {"iteration": 2, "score_mean": 0.7}]
    assert monitor.read_jsonl(path, last=1) == [{"iteration": 2, "score_mean": 0.7}]
    assert monitor.read_jsonl(tmp_path / "missing.jsonl") == []


def test_every_trainer_metric_of_interest_lands_in_its_panel():
    from homerlhf.ppo.metrics import METRIC_DESCRIPTIONS

    panels = dict(monitor.panel_keys(METRIC_DESCRIPTIONS))
    assert panels["Score and reward"] == ["score_mean", "reward_mean"]
    # kl_mean, and beside it the k3 estimates (never below 0) the trainer logs: the first rollout's, GRPO's loss term.
    assert panels["KL to the reference (nats)"] == ["kl_mean", "kl_ref_start", "kl_ref_loss"]
    assert panels["KL penalty coefficient"] == ["kl_coef"]  # its own panel: never on the KL's axes
    assert panels["Policy and value loss"] == ["policy_loss", "value_loss"]
    assert panels["Entropy (nats per token)"] == ["entropy"]
    assert panels["Groups (GRPO / RLOO)"] == ["group_zero_spread_fraction", "group_reward_std"]
    assert panels["Clipped fraction"] == ["policy_clipfrac", "value_clipfrac"]
    assert set(panels["Throughput (tokens/s)"]) == {"tokens_per_s_generation", "tokens_per_s_scoring",
                                                    "tokens_per_s_update"}
    # The measured peaks and, beside them, the planner's prediction for the same phases.
    assert set(panels["Memory (GiB): measured and planned"]) == {
        f"{kind}_mem_{phase}_gib" for kind in ("peak", "predicted") for phase in ("generation", "scoring", "update")}
    assert panels["Policy change per update"] == ["approx_kl"]
    assert panels["Rollout engine vs trainer"] == ["is_weight_mean", "is_weight_max", "is_capped_fraction",
                                                   "kl_behaviour_old", "policy_version_lag_mean",
                                                   "policy_version_lag_max"]
    # What the panels that matter come first; every line drawn has a name a person reads.
    assert [title for title, _ in monitor.PANELS][:5] == [
        "Score and reward", "Reward components", "KL to the reference (nats)", "Policy and value loss",
        "Entropy (nats per token)"]
    for _, keys in panels.items():
        assert all("_" not in monitor.label_of(k) for k in keys), keys
    caption = monitor.caption_markdown()
    assert "importance weight, max (`is_weight_max`)" in caption and "`predicted_mem_update_gib`" in caption


def test_one_point_reads_as_plain_numbers_on_an_integer_iteration_axis():
    rows = [{"iteration": 1, "score_mean": -2.0705, "reward_mean": -2.0705, "kl_mean": 1e-6, "kl_coef": 0.15}]
    fig = monitor.metrics_figure(rows)
    fig.canvas.draw()
    for ax in [a for a in fig.axes if a.axison and a.get_lines()]:
        low, high = ax.get_xlim()
        shown = [t.get_text() for t, x in zip(ax.get_xticklabels(), ax.get_xticks()) if low <= x <= high]
        assert shown == ["1"], ax.get_title()
        assert ax.yaxis.get_offset_text().get_text() == "" and ax.xaxis.get_offset_text().get_text() == ""
        # The legend sits under the panel, off the data.
        legend = ax.get_legend().get_window_extent()
        assert legend.y1 <= ax.get_window_extent().y0
    score = next(a for a in fig.axes if a.get_title() == "Score and reward")
    low, high = score.get_ylim()
    assert low < -2.0705 < high and high - low == pytest.approx(2 * 0.20705)
    # Two metrics that agree still draw as two lines, told apart by dashes and markers.
    styles = {(line.get_linestyle(), line.get_marker()) for line in score.get_lines()}
    assert len(styles) == 2


def test_the_rollout_engine_panel_only_when_it_says_more_than_the_trainer_sampled():
    titles = lambda fig: {ax.get_title() for ax in fig.axes if ax.axison}  # noqa: E731
    hf = [{"iteration": 1, "score_mean": 0.1, "is_weight_mean": 1.0, "is_weight_max": 1.0, "policy_version_lag_mean": 0}]
    assert "Rollout engine vs trainer" not in titles(monitor.metrics_figure(hf))
    engine = [{**hf[0], "is_weight_max": 1.7}]
    assert "Rollout engine vs trainer" in titles(monitor.metrics_figure(engine))


def test_the_figure_is_inline_svg_whose_text_stays_text():
    svg = monitor.figure_svg(monitor.metrics_figure([{"iteration": i, "score_mean": 0.1 * i} for i in (1, 2, 3)]))
    assert svg.startswith("<svg") and 'width="100%"' in svg.split(">", 1)[0]
    texts = re.findall(r"<text[^>]*>([^<]*)</text>", svg)
    assert "Score and reward" in texts and {"1", "2", "3"} <= set(texts)


def test_series_skips_missing_and_non_finite_values():
    rows = [{"iteration": 1, "kl_mean": 0.1}, {"iteration": 2}, {"iteration": 3, "kl_mean": None},
            {"iteration": 4, "kl_mean": float("nan")}, {"iteration": 5, "kl_mean": 0.4}]
    assert monitor.series(rows, "kl_mean") == ([1, 5], [0.1, 0.4])
    # No iteration logged: the row's position (1-based) stands in.
    assert monitor.series([{"x": 1.0}, {"x": 2.0}], "x") == ([1, 2], [1.0, 2.0])


def test_figure_draws_one_point_per_logged_iteration():
    rows = [{"iteration": i, "score_mean": i * 0.1, "kl_mean": 0.01 * i, "policy_loss": 1.0 / i} for i in (1, 2, 3)]
    fig = monitor.metrics_figure(rows)
    lines = {line.get_gid(): line for ax in fig.axes for line in ax.get_lines()}  # gid: the metric's name
    assert set(lines) == {"score_mean", "kl_mean", "policy_loss"}
    assert list(lines["score_mean"].get_xdata()) == [1, 2, 3]
    assert list(lines["policy_loss"].get_ydata()) == pytest.approx([1.0, 0.5, 1 / 3])
    assert monitor.metrics_figure([]).axes  # an empty run still draws the empty panels


def test_progress_eta_from_iteration_times():
    # 3 of 10 iterations, the last ones took 4, 6, 5 s: mean 5 s, 7 left -> ETA 35 s.
    rows = [{"iteration": i, "time_iteration_s": t} for i, t in ((1, 4.0), (2, 6.0), (3, 5.0))]
    prog = monitor.progress(rows, total=10, started_at=1000.0, now=1100.0)
    assert prog.iteration == 3
    assert prog.elapsed_s == pytest.approx(100.0)
    assert prog.eta_s == pytest.approx(35.0)
    assert prog.line() == "iteration 3/10 · 30% · elapsed 1m40s · ETA 0m35s"


def test_the_progress_line_carries_the_last_kl_flag():
    rows = [{"iteration": 1, "kl_flag": 0}, {"iteration": 2, "kl_flag": 1, "kl_flag_reason": "iteration 2: first"},
            {"iteration": 3, "kl_flag": 0}]
    assert monitor.progress(rows[:1], 5, now=0.0).line() == "iteration 1/5 · 20%"
    assert monitor.progress(rows, 5, now=0.0).line() == "iteration 3/5 · 60% · **KL flag** iteration 2: first"
    rows.append({"iteration": 4, "kl_flag": 1})  # a row without its reason (a tracker's export) still counts
    assert monitor.kl_warning(rows) == "(2 iterations flagged; the last) iteration 4"


def test_progress_eta_from_wall_clock_when_no_timing_is_logged():
    # 4 of 12 iterations in 80 s since start: 20 s each, 8 left -> 160 s.
    prog = monitor.progress([{"iteration": 4}], total=12, started_at=1000.0, now=1080.0)
    assert prog.eta_s == pytest.approx(160.0)
    assert monitor.progress([], total=12, started_at=1000.0, now=1010.0).line() == "iteration 0/12 · 0% · elapsed 0m10s"


def test_latest_samples_newest_first():
    rows = [{"iteration": 1, "prompt": "<|user|>p1<|end|><|assistant|>", "response": "r1", "score": 0.25},
            {"iteration": 2, "prompt": "p2", "response": "r2", "score": -1.0}]
    assert monitor.latest_samples(rows) == [[2, "p2", "r2", -1.0], [1, "p1", "r1", 0.25]]


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's naming
        ok = self.path == "/health"
        self.send_response(200 if ok else 404)
        self.end_headers()
        self.wfile.write(json.dumps({"status": "ok"}).encode())

    def log_message(self, *args):
        pass


def test_check_worker_up_and_down():
    server = HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        up, latency, detail = monitor.check_worker(url)
        assert up and latency is not None and latency >= 0 and detail == "HTTP 200"
    finally:
        server.shutdown()
        server.server_close()
    up, latency, detail = monitor.check_worker(url, timeout=1.0)
    assert not up and latency is None and "Connect" in detail


def test_each_reward_component_is_drawn_in_its_own_panel_without_its_none_fraction():
    rows = [{"iteration": i, "score_mean": 0.1 * i, "reward_mean": 0.1 * i, "reward_reverse": 0.2 * i,
             "reward_reverse_none": 0.0, "reward_reverse_positions": 0.5} for i in (1, 2)]
    panels = dict(monitor.panel_keys(monitor.numeric_keys(rows)))
    assert panels["Score and reward"] == ["score_mean", "reward_mean"]
    assert panels["Reward components"] == ["reward_reverse", "reward_reverse_positions"]
    fig = monitor.metrics_figure(rows)
    ax = next(a for a in fig.axes if a.get_title() == "Reward components")
    assert [line.get_ydata().tolist() for line in ax.get_lines()] == [[0.2, 0.4], [0.5, 0.5]]
    lone = monitor.metrics_figure([{"iteration": 1, "score_mean": 0.1}])
    assert "Reward components" not in {a.get_title() for a in lone.axes if a.axison}


def test_group_panel_only_for_runs_that_log_groups():
    ppo = [{"iteration": 1, "score_mean": 0.1}]
    grpo = [{"iteration": 1, "score_mean": 0.1, "group_zero_spread_fraction": 0.25, "group_reward_std": 0.3}]
    titles = lambda fig: {ax.get_title() for ax in fig.axes if ax.axison}  # noqa: E731
    assert "Groups (GRPO / RLOO)" not in titles(monitor.metrics_figure(ppo))
    assert "Groups (GRPO / RLOO)" in titles(monitor.metrics_figure(grpo))


def _texts(rows) -> list[str]:
    """The text of the monitor's SVG (titles, legends, notes), as a browser shows it."""
    import html

    svg = monitor.figure_svg(monitor.metrics_figure(rows))
    return [html.unescape(re.sub(r"\s+", " ", t)).strip() for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg)]


def test_a_cpu_runs_memory_panel_says_what_each_line_measures():
    """A CPU run's peak is the process's RSS, the plan counts tensors: the panel names both for what they are
    (the 12x gap of a tiny model is not the planner's error); a CUDA run's lines stay measured and planned."""
    memory = {"peak_mem_generation_gib": 0.61, "predicted_mem_generation_gib": 0.05}
    cpu = _texts([{"iteration": 1, **memory, "peak_mem_kind": "cpu_rss"}])
    assert "CPU memory (GiB): process RSS and the plan's tensors" in cpu
    assert {"generation: process RSS", "generation: plan, tensors only"} <= set(cpu)
    assert "RSS counts the whole process (Python, torch, data); the plan counts tensors only" in cpu
    assert not [t for t in cpu if "measured" in t or "planned" in t]
    cuda = _texts([{"iteration": 1, **memory, "peak_mem_kind": "cuda_max_allocated"}])
    assert {"Memory (GiB): measured and planned", "generation measured", "generation planned"} <= set(cuda)
    assert not [t for t in cuda if "RSS" in t]


def test_a_kl_below_zero_is_explained_where_it_is_drawn():
    below = _texts([{"iteration": 1, "kl_mean": 0.0, "kl_ref_start": 0.0004}, {"iteration": 2, "kl_mean": -0.018}])
    assert {"KL per response", "k3 per token, first rollout"} <= set(below)
    assert "k1 is unbiased: one batch's mean can be < 0; the KL itself is >= 0" in below
    above = _texts([{"iteration": 1, "kl_mean": 0.0}, {"iteration": 2, "kl_mean": 0.018}])
    assert not [t for t in above if t.startswith("k1 is unbiased")]
