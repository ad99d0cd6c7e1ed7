"""The monitor's parsing, panel grouping, figure layout, log filter, ETA and worker checks, without a browser."""

from __future__ import annotations

import json
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
    assert panels["Reward-hacking signals (audit)"] == [  # the flags are not drawn: the audit verdict says them
        "signal_length_corr", "signal_length_drift", "signal_repetition", "signal_distinct", "signal_prompt_echo",
        "signal_reward_share_max", "signal_entropy_ratio"]
    assert not any(k.startswith("signal_flag") for keys in panels.values() for k in keys)
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


def _layout(fig) -> dict:
    return fig.to_plotly_json()["layout"]


def _panel_of(fig, title: str) -> str:
    """The axis suffix ('' or 'N') of the panel titled ``title``."""
    annotations = [a for a in _layout(fig)["annotations"] if a["text"].replace("<br>", " ").replace("<b>", "")
                   .replace("</b>", "").replace("  ", " ") == title]
    assert annotations, title
    x = annotations[0]["x"]
    for key, axis in _layout(fig).items():
        if key.startswith("xaxis") and abs(sum(axis["domain"]) / 2 - x) < 1e-9:
            y_top = _layout(fig)["yaxis" + key[5:]]["domain"][1]
            if abs(y_top - annotations[0]["y"]) < 1e-9:
                return key[5:]
    raise AssertionError(title)


def test_one_point_reads_as_plain_numbers_on_an_integer_iteration_axis():
    rows = [{"iteration": 1, "score_mean": -2.0705, "reward_mean": -2.0705, "kl_mean": 1e-6, "kl_coef": 0.15}]
    fig = monitor.metrics_figure(rows)
    layout = _layout(fig)
    xaxes = {k: v for k, v in layout.items() if k.startswith("xaxis")}
    assert len(xaxes) == 3  # one panel per group with data: score and reward, KL, KL coefficient
    for key, axis in xaxes.items():
        # Whole iterations, one tick per iteration around the one point; plain numbers on both axes.
        assert (axis["range"], axis["tick0"], axis["dtick"], axis["tickformat"]) == ([0.5, 1.5], 1, 1, "d"), key
        assert layout["yaxis" + key[5:]]["exponentformat"] == "none"
    score = _panel_of(fig, "Score and reward")
    low, high = layout[f"yaxis{score}"]["range"]  # a flat line gets a readable range around it: +-10%
    assert (low, high) == pytest.approx((-2.0705 - 0.20705, -2.0705 + 0.20705))
    # Two metrics that agree still draw as two lines, told apart by dashes and markers.
    lines = [t for t in fig.data if t.xaxis == f"x{score}"]
    assert [t.meta for t in lines] == ["score_mean", "reward_mean"]
    assert len({(t.line.dash, t.marker.symbol) for t in lines}) == 2


def test_every_panel_has_its_legend_whole_under_it():
    """Each panel's legend sits under its plot, and its row is as tall as its longest legend: no legend reaches
    the panel below it (the CPU memory panel has six lines and a two-line note)."""
    from homerlhf.app import monitor_plot as mp

    memory = {f"{kind}_mem_{phase}_gib": 0.5 for kind in ("peak", "predicted") for phase in ("generation", "scoring", "update")}
    rows = [{"iteration": i, "score_mean": 0.1 * i, "kl_mean": -0.01, "entropy": 6.0, "policy_loss": 0.1,
             "tokens_per_s_generation": 100.0, "approx_kl": 0.01, **memory, "peak_mem_kind": "cpu_rss"} for i in (1, 2)]
    fig = monitor.metrics_figure(rows)
    layout = _layout(fig)
    plot_px = layout["height"] - mp.MARGIN["t"] - mp.MARGIN["b"]
    for key, legend in layout.items():
        if not key.startswith("legend"):
            continue
        suffix = key[6:]
        items = sum(1 for t in fig.data if t.legend == key) + legend["title"]["text"].count("<br>") + bool(legend["title"]["text"])
        bottom_px = legend["y"] * plot_px - items * mp.ITEM_PX
        assert legend["y"] < layout[f"yaxis{suffix}"]["domain"][0]  # under its own plot
        below = [a["domain"][1] for k, a in layout.items() if k.startswith("yaxis") and a["domain"][1] < legend["y"]]
        next_row_top_px = (max(below) * plot_px + mp.TITLE_PX) if below else 0  # the next row's title above its plot
        assert bottom_px >= next_row_top_px, key
    texts = mp.figure_texts(fig)
    assert "RSS counts the whole process (Python, torch, data); the plan counts tensors only" in texts


def test_the_rollout_engine_panel_only_when_it_says_more_than_the_trainer_sampled():
    from homerlhf.app.monitor_plot import figure_texts

    hf = [{"iteration": 1, "score_mean": 0.1, "is_weight_mean": 1.0, "is_weight_max": 1.0, "policy_version_lag_mean": 0}]
    assert "Rollout engine vs trainer" not in figure_texts(monitor.metrics_figure(hf))
    engine = [{**hf[0], "is_weight_max": 1.7}]
    assert "Rollout engine vs trainer" in figure_texts(monitor.metrics_figure(engine))


def test_the_figure_is_plotly_and_reaches_the_browser_as_json():
    """The page gets the figure as plotly JSON (Gradio serves plotly.js itself: it draws offline)."""
    fig = monitor.metrics_figure([{"iteration": i, "score_mean": 0.1 * i} for i in (1, 2, 3)])
    data = json.loads(fig.to_json())
    assert data["layout"]["title"]["text"] == "3 iteration(s) logged"
    assert [trace["x"] for trace in data["data"]] == [[1, 2, 3]]
    empty = monitor.metrics_figure([])
    assert not empty.data and "nothing logged yet" in [a["text"] for a in _layout(empty)["annotations"]]


def test_ticks_are_whole_iterations_at_a_readable_step():
    from homerlhf.app.monitor_plot import nice_step

    assert [nice_step(span) for span in (0, 9, 10, 11, 40, 100, 999, 5000)] == [1, 1, 1, 2, 5, 20, 200, 1000]


def test_the_log_tail_is_free_of_library_noise():
    """Python warnings (with their source line) and llama.cpp's own log lines go; a progress bar shows its last
    state; the trainer's own lines and errors stay."""
    log = "\n".join([
        "[homerlhf] placement auto: ref llamacpp",
        "/usr/lib/python3.11/site-packages/transformers/training_args.py:1541: FutureWarning: `gradient_checkpointing` "
        "is deprecated",
        '  warnings.warn(f"`{old}` is deprecated", FutureWarning)',
        "llama_context: n_ctx_seq (512) > n_ctx_train (256) -- possible training context overflow",
        "llama_model_loader: loaded meta data with 24 key-value pairs",
        "ggml_backend_cpu: using 1 thread",
        "\rLoading weights:   0%|  | 0/39\rLoading weights: 100%|##| 39/39",
        "\rexport ref.gguf:   0%|  | 0/39\r                      ",
        "iteration 1/2 score_mean=-4.9",
        "error: reward.model 'x' is not a directory",
    ])
    assert monitor.quiet_log(log).splitlines() == [
        "[homerlhf] placement auto: ref llamacpp", "Loading weights: 100%|##| 39/39", "iteration 1/2 score_mean=-4.9",
        "error: reward.model 'x' is not a directory"]


def test_series_skips_missing_and_non_finite_values():
    rows = [{"iteration": 1, "kl_mean": 0.1}, {"iteration": 2}, {"iteration": 3, "kl_mean": None},
            {"iteration": 4, "kl_mean": float("nan")}, {"iteration": 5, "kl_mean": 0.4}]
    assert monitor.series(rows, "kl_mean") == ([1, 5], [0.1, 0.4])
    # No iteration logged: the row's position (1-based) stands in.
    assert monitor.series([{"x": 1.0}, {"x": 2.0}], "x") == ([1, 2], [1.0, 2.0])


def test_figure_draws_one_point_per_logged_iteration():
    rows = [{"iteration": i, "score_mean": i * 0.1, "kl_mean": 0.01 * i, "policy_loss": 1.0 / i} for i in (1, 2, 3)]
    fig = monitor.metrics_figure(rows)
    lines = {trace.meta: trace for trace in fig.data}  # meta: the metric's metrics.jsonl name
    assert set(lines) == {"score_mean", "kl_mean", "policy_loss"}
    assert list(lines["score_mean"].x) == [1, 2, 3]
    assert list(lines["policy_loss"].y) == pytest.approx([1.0, 0.5, 1 / 3])
    assert [lines[k].name for k in ("score_mean", "kl_mean", "policy_loss")] == [
        "score (reward model)", "KL per response", "policy"]


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
    # The best answer of iteration 2 is one of its first too: shown once; the worst, kept only as such, shown.
    ranked = rows + [{**rows[1], "rank": "top"}, {"iteration": 2, "prompt": "p3", "response": "r3", "score": -2.0,
                                                  "rank": "bottom"}]
    assert monitor.latest_samples(ranked) == [[2, "p3", "r3", -2.0], [2, "p2", "r2", -1.0], [1, "p1", "r1", 0.25]]


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
    panel = _panel_of(fig, "Reward components")
    assert [list(t.y) for t in fig.data if t.xaxis == f"x{panel}"] == [[0.2, 0.4], [0.5, 0.5]]
    from homerlhf.app.monitor_plot import figure_texts

    assert "Reward components" not in figure_texts(monitor.metrics_figure([{"iteration": 1, "score_mean": 0.1}]))


def test_group_panel_only_for_runs_that_log_groups():
    ppo = [{"iteration": 1, "score_mean": 0.1}]
    grpo = [{"iteration": 1, "score_mean": 0.1, "group_zero_spread_fraction": 0.25, "group_reward_std": 0.3}]
    from homerlhf.app.monitor_plot import figure_texts

    assert "Groups (GRPO / RLOO)" not in figure_texts(monitor.metrics_figure(ppo))
    assert "Groups (GRPO / RLOO)" in figure_texts(monitor.metrics_figure(grpo))


def _texts(rows) -> list[str]:
    """The text of the monitor's figure (titles, legends, notes), as a browser shows it."""
    from homerlhf.app.monitor_plot import figure_texts

    return figure_texts(monitor.metrics_figure(rows))


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
