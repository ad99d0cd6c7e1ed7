"""`homerlhf plan` as a user meets it: offline, a table per phase, JSON, a chart, one-line errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


def run(*args):
    return subprocess.run([sys.executable, "-m", "homerlhf.cli", "plan", *args], capture_output=True, text=True, timeout=120)


def test_offline_plan_from_the_builtin_table_prints_a_table_per_phase():
    out = run("--preset", "4090", "--model", "Qwen/Qwen2.5-7B")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for phase in ("generation: peak at", "scoring: peak at", "update: peak at"):
        assert phase in text
    for component in ("base linear weights (NF4)", "KV cache", "LoRA actor", "optimizer states actor", "CUDA context"):
        assert component in text
    assert "OK: fits RTX 4090 (24 GiB)" in text
    assert "Traceback" not in out.stderr


def test_json_is_valid_and_complete_and_the_chart_is_written(tmp_path):
    chart = tmp_path / "plan.png"
    out = run("--preset", "4090", "--model", "Qwen/Qwen2.5-7B", "--gpu-gib", "10", "--json", "--plot", str(chart))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["model"] == "Qwen/Qwen2.5-7B" and data["gpu_gib"] == 10
    assert [p["name"] for p in data["phases"]] == ["generation", "scoring", "update"]
    assert all(p["components"] and p["total_gib"] > 0 for p in data["phases"])
    assert data["fits"] is False and data["status"] == "over" and data["headroom_gib"] < 0
    assert data["suggestion"]["peak_gib"] <= 0.9 * 10 and data["suggestion"]["set_args"]  # with the 10% margin
    kv = next(c for c in data["phases"][0]["components"] if c["kind"] == "kv_cache")
    assert kv["dtype"] == "bf16" and data["settings"]["quant.upcast_non_quantized"] is False
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _in_process(capsys, *args):
    """The same entry point as the console script, without starting an interpreter."""
    from homerlhf.cli import main

    with pytest.raises(SystemExit) as info:
        main(["plan", *args])
        raise SystemExit(0)
    out = capsys.readouterr()
    return info.value.code, out.out, out.err


def test_a_plan_that_does_not_fit_prints_the_suggestion(capsys):
    code, out, err = _in_process(capsys, "--preset", "4090", "--gpu-gib", "10")
    assert code == 0, err
    assert "NO: does NOT fit" in out and "suggestion that fits" in out and "--set " in out
    # Qwen2.5-7B with the workers on llama.cpp and chunk 16 peaks at 10.79 GiB: on 11.5 GiB it stays
    # under the card, but with 6.2% free.
    named = [a for o in ("ref.backend=llamacpp", "reward.backend=llamacpp", "rollout.generation_chunk=null")
             for a in ("--set", o)]
    code, out, err = _in_process(capsys, "--preset", "4090", "--gpu-gib", "11.5", *named)
    assert "TIGHT: tight on GPU (11.5 GiB)" in out and "suggestion that restores the margin" in out


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--preset", "4090", "--model", "acme/unknown-13b"], "unknown model 'acme/unknown-13b'"),
        (["--preset", "4090", "--gpu-gib", "0"], "--gpu-gib must be > 0"),
        (["--preset", "4090", "--plot", "plan.txt"], "use a .png"),
    ],
)
def test_bad_input_is_one_line(capsys, args, fragment):
    code, out, err = _in_process(capsys, *args)
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert fragment in err and "Traceback" not in err


def test_the_4090_plan_of_qwen25_7b_takes_the_fastest_placement_that_fits(capsys):
    """The preset's placement and generation chunk are auto: the plan shows what a run takes, the
    placement with the fewest predicted seconds among those that fit (the rollout engine kept)."""
    import json

    code, out, err = _in_process(capsys, "--preset", "4090", "--model", "Qwen/Qwen2.5-7B", "--json")
    assert code == 0, err
    data = json.loads(out)
    time = data["time"]
    kept = [c for c in time["candidates"] if c["fits"] and c["placement"]["rollout.engine"] == "hf"]
    assert time["current"]["total_s"] == min(c["total_s"] for c in kept)
    assert time["current"]["placement"] == {"ref.backend": "adapter_off", "reward.backend": "adapter",
                                            "rollout.engine": "hf"}
    assert data["settings"]["ref.backend"] == "adapter_off" and data["settings"]["reward.backend"] == "adapter"
    # bf16 end to end: K/V at 2 bytes, 56 KiB a token; the card affords the whole batch of 64 at once.
    assert data["generation"]["setting"] == "auto" and data["generation"]["chunk"] == 64
    assert data["generation"]["kv_bytes_per_token"] == 57_344 and data["status"] == "fits"
    code, out, _ = _in_process(capsys, "--preset", "4090", "--model", "Qwen/Qwen2.5-7B")
    assert "generation chunk 64 (rollout.generation_chunk=auto: the largest that leaves 10% of the card free" in out
    assert "placement auto: ref adapter_off, reward adapter, rollout hf:" in out


@pytest.mark.parametrize("preset, card, scaled", [
    ("4090", "RTX 4090", "(165.2 vs 989.5 TFLOPS, 1.01 vs 4.8 TB/s)"),
    ("3060-12g", "RTX 3060 12GB", "(25.4 vs 989.5 TFLOPS, 0.36 vs 4.8 TB/s)"),
])
def test_a_consumer_card_plan_says_its_times_are_the_h200_figures_scaled_to_it(capsys, preset, card, scaled):
    """The plan of a card nobody measured: the H200's rates scaled by the card's published figures, said
    as such; minutes where seconds run long; the budget a placement missed, not 'the card'."""
    code, out, err = _in_process(capsys, "--preset", preset)
    assert code == 0, err
    text = " ".join(out.split())  # rich wraps long lines
    assert f"(GPU: H200 figures scaled to the {card} by its published specs {scaled}, not measured on one;" in text
    assert "measured on NVIDIA H200" not in text
    assert re.search(r"\d\.\d (s|min|h|days) per iteration", text)
    code, out, _ = _in_process(capsys, "--preset", preset, "--gpu-gib", "6")
    text = " ".join(out.split())
    assert "over the card" not in text and "over the 90% budget (5.4 of 6 GiB): " in text


def test_a_named_reward_adapter_is_planned_with_the_engine_auto_chooses_and_its_files_said(capsys):
    """cpu-tiny (rollout.engine auto) with reward.backend=adapter: planned as named, the engine chosen among
    both; the builtin demo-rm is a reward model of its own (llamacpp or hf), which the plan says a run's start
    refuses (tests/stages/test_autoplan_engine.py: a run with a reward adapter)."""
    code, out, err = _in_process(capsys, "--preset", "cpu-tiny", "--set", "reward.backend=adapter")
    assert code == 0, err
    text = " ".join(out.split())  # rich wraps the notes
    assert re.search(r"placement auto: ref llamacpp, reward adapter, rollout (hf|llamacpp):", text)
    assert "rollout engine auto -> " in text and "set ref.backend, reward.backend or rollout.engine" not in text
    assert ("reward.backend=adapter: the reward model builtin:demo-rm runs on llamacpp or hf only, so a run's start "
            "refuses it") in text
