"""``homerlhf check`` (homerlhf/check/main.py), the check a user (and our GPU session) runs on a GPU:
every case's code path runs on the CPU (``--cpu-smoke``: tiny models of each case's architecture, the
PPO cases and the CLI without llama_cpp, gradio, datasets and trl, as on the GPU machine; the DPO and KTO
cases with datasets and trl, after them), a failed case is a line and a result rather than a stop, and
without CUDA it prints what it would run and exits 0."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

PPO_CASES = ["ppo-7b", "grpo-1.5b", "grpo-1.5b-upcast", "rloo-1.5b", "reward-adapter-1.5b", "ppo-fp16-1.5b",
             "resume-1.5b", "cli-1.5b"]
PREFERENCE_CASES = ["dpo-1.5b", "kto-1.5b"]
CASES = PPO_CASES + PREFERENCE_CASES
PHASES = {"generation", "scoring", "update"}
# Seconds on an H200 (homerlhf/check/cases.py: H200_S, the arithmetic in scripts/gpu_session.sh) of the cases
# our H200 session runs (the 7B's 2 iterations)
H200 = {"ppo-7b": 77, "grpo-1.5b": 10, "grpo-1.5b-upcast": 6, "rloo-1.5b": 5, "reward-adapter-1.5b": 12,
        "ppo-fp16-1.5b": 15, "resume-1.5b": 20, "cli-1.5b": 66, "dpo-1.5b": 14, "kto-1.5b": 12}


def in_order(names: list[str]) -> bool:
    """The check's order: the 7B first, the other PPO cases, then the preference ones (the PPO cases run
    without datasets and trl, which the preference stage needs)."""
    return (names[0] == "ppo-7b" and sorted(names[1:-2]) == sorted(PPO_CASES[1:])
            and sorted(names[-2:]) == PREFERENCE_CASES)


def run(*args, cwd: Path):
    return subprocess.run([sys.executable, "-m", "homerlhf.cli", "check", *args], capture_output=True, text=True,
                          timeout=900, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), cwd=cwd)


def test_cpu_smoke_runs_every_case_and_writes_their_figures(gpu_session_smoke):
    done, out = gpu_session_smoke  # scripts/gpu_session.sh check --cpu-smoke: `homerlhf check --cpu-smoke` first
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [ln for ln in (out / "gpu_check.log").read_text().splitlines() if ln.startswith(("ok ", "FAIL "))]
    assert {ln.split()[0] for ln in lines} == {"ok"} and in_order([ln.split()[1] for ln in lines]), lines
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["mode"] == "cpu-smoke" and report["preset"] == "4090" and report["left_out"] == []
    assert {"torch", "transformers", "peft", "bitsandbytes", "accelerate", "trl", "datasets", "date"} <= set(report)
    assert "device" not in report  # no card's figures
    assert all("error" not in case for case in report["cases"]), [c.get("traceback") for c in report["cases"]]
    by_name = {case["case"]: case for case in report["cases"]}
    for name in PREFERENCE_CASES:
        preference_case_figures(by_name[name], by_name[name]["kind"])
    for case in report["cases"]:
        if case["kind"] in ("dpo", "kto"):
            continue
        # Every PPO case runs without what our GPU machine lacks, datasets and trl among them.
        assert {"llama_cpp", "gradio", "datasets", "trl"} <= set(case["absent"])
        assert set(case["plan"]["phases"]) == set(case["comparison"]) == set(case["measured_gib"]) == PHASES
        assert all(case["seconds"][k] > 0 for k in ("time_generation_s", "time_scoring_s", "time_update_s"))
        assert case["tokens_per_s"]["tokens_per_s_generation"] > 0
        assert case["settings"]["ref.backend"] == "adapter_off" and case["overrides"]
        if case["kind"] != "cli":  # the loop a GPU run samples with (rollout.decoder auto), here eager
            assert case["decoder"] == "static loop, eager"
            assert case["graphs_captured"] == case["captured_replays"] == 0  # no graph on the CPU
            # The sampler's own log-probs against the trainer's scoring of the same tokens: measured.
            gap = case["sampled_vs_scored"]
            fp32 = case["settings"]["quant.compute_dtype"] == "fp32"  # (fp16: the t4-colab case's own kernels)
            assert gap["tokens"] > 0 and 0 <= gap["mean_abs"] <= gap["max_abs"] <= (1e-4 if fp32 else 5e-2)
        # The plan each case is compared with: its iteration's (here every case's first in its process).
        assumed = case["plan_assumptions"]
        assert set(assumed) == PHASES and {a["decoder"] for a in assumed.values()} == {"static"}
        first = case["kind"] == "train"  # resume and cli: the iteration right after a resume
        assert assumed["generation"]["after_first_step"] is not first and assumed["generation"]["held_gradients"] is False
        assert assumed["generation"]["cublas_handles"] == 1 and assumed["update"]["cublas_handles"] == 2
        # The kernels each case ran with (the CPU: TF32 off, the SDPA flags left alone).
        assert case["kernel_settings"]["tf32"] is False and case["kernel_settings"]["sdpa_backends"] == []
        if case["kind"] != "cli":  # which layers recomputed in backward and were offloaded, read from the models
            models = case["activation_checkpointing"]
            assert set(models) == ({"policy", "critic"} if case["case"] == "reward-adapter-1.5b" else {"policy"})
            assert all(m["layers"] == 2 for m in models.values())  # the smoke's tiny models
            # The models run the checkpointing the case's plan assumed: `auto` resolved as `train` resolves it
            # on the card (the 4090's 24 GiB: 1 of the tiny model's 2 layers), never read as "every layer".
            every_n, offload = (case["settings"][f"training.{k}"] for k in ("checkpoint_every_n_layers", "activation_offload"))
            assert isinstance(every_n, int) and isinstance(offload, bool), case["settings"]
            for m in models.values():
                assert m["recomputed"] == list(range(0, m["layers"], every_n))
                assert m["offloaded"] == (m["recomputed"] if offload else [])
    assert by_name["grpo-1.5b"]["settings"]["algorithm"] == "grpo" and by_name["rloo-1.5b"]["settings"]["algorithm"] == "rloo"
    upcast = {name: by_name[name]["settings"]["quant.upcast_non_quantized"] for name in ("grpo-1.5b", "grpo-1.5b-upcast")}
    assert upcast == {"grpo-1.5b": False, "grpo-1.5b-upcast": True}  # both dtype settings, side by side
    fp16 = by_name["ppo-fp16-1.5b"]
    assert fp16["settings"]["quant.compute_dtype"] == "fp16" and "loss_scale" in fp16["rows"][-1]  # the GradScaler
    steps = fp16["optimizer_steps"]  # two steps an iteration; the case fails when the scaler skipped them all
    assert steps["steps"] == 2 and steps["taken"] + steps["skipped"] == 2 and steps["taken"] >= 1
    assert all(case["optimizer_steps"]["taken"] >= 1 for case in report["cases"])
    # The 7B first, the other PPO cases and then the preference ones, each from the quickest to the slowest by
    # their estimates on the card (here the 4090's, by the planner); on the H200 of our session within its
    # budget, as scripts/gpu_session.sh says.
    for group in (report["cases"][1:-2], report["cases"][-2:]):
        assert [c["estimate_s"] for c in group] == sorted(c["estimate_s"] for c in group)
    assert "running" not in report
    # Sized for the 4090's card, where the 7B's 2 iterations would take over 240 s: 1, 5 + (77 - 5) / 2 s on an H200.
    assert {c["case"]: c["estimate_h200_s"] for c in report["cases"]} == {**H200, "ppo-7b": 41}
    assert report["estimate_s"] > report["estimate_h200_s"]  # a 4090 is slower than an H200
    # `homerlhf train` decided as on the GPU machine (CUDA reported, the 4090's card), measuring nothing:
    # no llama.cpp there (nor here: absent), the default rates' label of a GPU card.
    (placement,) = by_name["cli-1.5b"]["placement"]
    assert placement.startswith("[homerlhf] placement as configured: ref adapter_off, reward function, rollout hf")
    assert "GPU: H200 figures scaled to the RTX 4090 by its published specs" in placement
    assert by_name["reward-adapter-1.5b"]["settings"]["reward.backend"] == "adapter"
    assert by_name["resume-1.5b"]["state_equal"] and [r["iteration"] for r in by_name["resume-1.5b"]["rows"]] == [2]
    assert by_name["cli-1.5b"]["checkpoints"] == ["iter_000001", "iter_000002"]
    # The levers: a critic of its own (beside the reward adapter), and every 2nd layer checkpointed with its
    # input offloaded (resumed; on the CPU homerlhf's save_on_cpu path keeps it where it is).
    assert Path(by_name["reward-adapter-1.5b"]["settings"]["critic.model"]).name == "Qwen--Qwen2.5-0.5B"
    offload = by_name["resume-1.5b"]
    assert offload["settings"]["training.activation_offload"] is True
    assert offload["activation_checkpointing"]["policy"] == {"layers": 2, "recomputed": [0], "offloaded": [0],
                                                             "path": "save_on_cpu"}
    assert "recomputed policy 1/2, offloaded 1" in (out / "gpu_check.log").read_text()


def preference_case_figures(case: dict, method: str) -> None:
    """A preference case's own figures: the two phases its stage meters beside the plan's three, the steps
    it took, TRL's first logged step, the held-out margins, and datasets and trl present."""
    assert set(case["measured_gib"]) == set(case["comparison"]) == {"training", "held-out pass"}
    assert set(case["plan"]["phases"]) == {"reference forward", "train step", "held-out pass"}
    assert case["comparison"]["training"]["plan_phase"] in ("reference forward", "train step")
    assert case["comparison"]["held-out pass"]["plan_phase"] == "held-out pass"
    assert all(c["measured_gib"] > 0 for c in case["comparison"].values())  # the process's RSS here
    assert case["settings"]["algorithm"] == method and case["overrides"][-1] == f"{method}.max_len=48"
    assert case["optimizer_steps"]["taken"] == 2 and case["batch_size"] == 2 and case["max_len"] == 48
    assert case["seconds"]["training"] > 0 and case["seconds"]["held-out pass"] > 0
    assert case["tokens_per_s"]["training"] > 0
    # Before its first update the policy is its reference (a new LoRA: B = 0 adds exactly 0), so the log-ratios
    # are 0: DPO's sigmoid loss -log sigmoid(0) = ln 2, KTO's 1 - sigmoid(0) = 0.5, each computed in fp32
    # (10 x fp32's eps x 0.7 < 1e-6).
    first = case["first_step"]
    assert first["step"] == 1 and first["loss"] == pytest.approx(math.log(2) if method == "dpo" else 0.5, abs=1e-6)
    assert first["rewards/chosen"] == pytest.approx(0, abs=1e-6)
    # 32 training pairs, 8 held out: every row's prompt cut to fit 48 tokens with its answer (its worst case).
    assert case["data"][0]["n_rows"] == 32 and case["data"][1]["n_rows"] == 8
    assert case["data"][0]["n_truncated"] == 40 and case["data"][0]["n_dropped"] == 0
    held = case["held_out"]
    assert held["eval_pairs"] == 8 and all(math.isfinite(held[k]) for k in ("margin_before", "margin_after"))
    assert 0 <= held["accuracy_before"] <= 1 and 0 <= held["accuracy_after"] <= 1
    if method == "kto":  # the pairs' answers as rated: the good ones' and the bad ones' change
        assert case["rows"]["n_train"] == 64 and held["eval_rated"] == 16
        assert math.isfinite(held["good_logp_change"]) and math.isfinite(held["bad_logp_change"])
    else:
        assert case["rows"]["n_train"] == 32
    assert not {"datasets", "trl"} & set(case["absent"]) and {"llama_cpp", "gradio"} <= set(case["absent"])


def test_our_h200_sessions_check_runs_every_case_within_its_limit(tmp_path):
    """On the H200 of our GPU session (no preset names it: the 4090 preset's cases, capped at 24 GiB), every
    case within the check's `timeout -k 15 300` in scripts/gpu_session.sh, 10 s to spare: its start 10, the
    builds of the 7B, the 1.5B and the 0.5B critic 4 s a billion parameters (7.62 + 1.54 + 0.49 B: 38.7 s),
    and the cases' seconds."""
    from homerlhf.check.cases import estimated_seconds
    from homerlhf.check.main import Options, sizing

    sized = sizing(Options(out=tmp_path / "r.json"), "NVIDIA H200", 139.8)
    assert sized.preset == "4090" and in_order([c.name for c in sized.todo])
    assert {c.name: c.estimate_h200_s for c in sized.todo} == H200 and sized.todo[0].iterations == 2
    assert estimated_seconds(sized.todo, h200=True) == round(10 + 38.7 + sum(H200.values())) == 286 <= 300 - 10


def test_cpu_smoke_of_the_largest_model_the_planner_fits(tmp_path):
    done = run("--cpu-smoke", "--largest", "--out", "largest.json", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    [case] = json.loads((tmp_path / "largest.json").read_text())["cases"]
    assert case["case"].startswith("largest-") and case["preset"] == "4090" and "error" not in case


def test_a_failing_case_is_a_line_and_the_next_case_still_runs(tmp_path):
    from homerlhf.check.cases import Case
    from homerlhf.check.lines import line
    from homerlhf.check.run import Run, guarded

    broken = Case("broken", "no-such-preset", "Qwen/Qwen2.5-1.5B", (), 1, 10)
    entry = guarded(broken, Run(smoke=True, tmp=tmp_path))
    assert not list(tmp_path.iterdir())  # refused before any model was built
    assert entry["error"].startswith("UserError: ") and "no-such-preset" in entry["error"]
    assert "Traceback" in entry["traceback"] and entry["overrides"]
    assert line(entry).startswith("FAIL broken")


def test_a_gpu_case_loads_its_model_from_where_the_build_puts_it(monkeypatch, tmp_path):
    """On a GPU the checkpoints are kept in the session's models folder: the path a case configures
    before the build is that folder's (it was the scratch dir's, which the build never wrote)."""
    from homerlhf.check.run import Run

    monkeypatch.setenv("HOMERLHF_GPU_MODELS", str(tmp_path / "models"))
    run = Run(smoke=False, tmp=tmp_path / "scratch")
    assert run.model_dir("Qwen/Qwen2.5-7B", build=False) == tmp_path / "models" / "Qwen--Qwen2.5-7B-seed0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_prints_what_it_would_run_and_exits_0(monkeypatch, tmp_path, capsys):
    """No weights loaded, no model built, no report written: the cases the 4090 preset's card gets, each
    with its estimate, in seconds."""
    from homerlhf.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOMERLHF_GPU_MODELS", str(tmp_path / "models"))
    started = time.perf_counter()
    main(["check"])  # returns: exit code 0
    seconds = time.perf_counter() - started
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert lines[0] == "no CUDA GPU here: nothing run, nothing written. On a GPU, `homerlhf check` runs:"
    assert lines[1].startswith("preset 4090 (no GPU here") and "estimates for the RTX 4090" in lines[1]
    cases = {ln.split()[0]: ln for ln in lines[2:2 + len(CASES)]}
    assert in_order(list(cases)) and lines[2 + len(CASES)].startswith("about ")
    assert "Qwen/Qwen2.5-7B" in cases["ppo-7b"] and "preset t4-colab" in cases["ppo-fp16-1.5b"]
    assert "2 optimizer steps" in cases["dpo-1.5b"] and "2 optimizer steps" in cases["kto-1.5b"]
    assert lines[-1].startswith("(--cpu-smoke runs these code paths")
    assert list(tmp_path.iterdir()) == [] and seconds < 60  # nothing built or written


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_cards_preset_sizes_the_cases(monkeypatch, tmp_path, capsys):
    """--preset 3060-12g: the PPO case on what its 12 GiB fit and its time allows (Qwen2.5-1.5B, not the
    7B), the fp16 case at that preset (a 15 GiB t4-colab cap is more than its card), every case there."""
    from homerlhf.cli import main

    monkeypatch.chdir(tmp_path)
    main(["check", "--preset", "3060-12g"])  # returns: exit code 0
    lines = capsys.readouterr().out.splitlines()
    cases = {ln.split()[0]: ln for ln in lines if ln.startswith("  ") and not ln.startswith("  left out")}
    assert "ppo-1.5b" in cases and "ppo-7b" not in cases and len(cases) == len(CASES)
    assert all("preset 3060-12g" in ln for ln in cases.values())
