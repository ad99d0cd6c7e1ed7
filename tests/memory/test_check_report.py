"""``homerlhf plan --calibration REPORT.json``: a ``homerlhf check`` report's measured rates and peaks for
its card, in place of the H200's scaled figures (``homerlhf.memory.check_report``).

The hand-derived figures read ``tests/fixtures/check_reports/rtx4090_example.json`` (hand-made in the
shape a GPU run writes: tests/fixtures/README.md); the read-back of a real report and the privacy grep
read the CPU smoke's report (the session fixture ``gpu_session_smoke``: scripts/gpu_session.sh, ``homerlhf check``)."""

from __future__ import annotations

import getpass
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from homerlhf.cli import main
from homerlhf.memory.check_report import card_matches, scrub_report

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "tests" / "fixtures" / "check_reports" / "rtx4090_example.json"
# The 4090 preset's run (batch 64 of 512 + 256 tokens, 1 epoch), its reference on the base and its reward
# on a llama.cpp worker named, not auto: with and without a report the plan is of one placement; every layer
# checkpointed, as the cases' update rates were measured (the preset's auto may recompute fewer).
B, N, L, EPOCHS = 64, 256, 768, 1
PINNED = ["--set", "ref.backend=adapter_off", "--set", "reward.backend=llamacpp",
          "--set", "training.checkpoint_every_n_layers=1", "--set", "training.activation_offload=false"]


def plan_json(capsys, *args) -> dict:
    main(["plan", "--json", *args])
    return json.loads(capsys.readouterr().out)


def allocated(plan: dict) -> dict:
    return {p["name"]: p["allocated_gib"] for p in plan["phases"]}


def test_the_plan_takes_the_reports_rates_and_peaks(capsys):
    plain = plan_json(capsys, "--preset", "4090", "--model", "Qwen/Qwen2.5-7B", *PINNED)
    cal = plan_json(capsys, "--preset", "4090", "--model", "Qwen/Qwen2.5-7B", *PINNED, "--calibration", str(EXAMPLE))
    # Case ppo-7b: 500 generated tokens/s at chunk 16; scoring 4,000 tokens/s over its 3 forwards (actor,
    # critic, the adapter-off reference) = 12,000 a forward; update 1,500 tokens/s per epoch over 2
    # adapters = 3,000 a forward + backward. A decode step's time does not depend on the chunk (the
    # time model's rule), so at chunk c the rate is 500 c / 16, up to the forward rate.
    chunk = cal["generation"]["chunk"]
    assert chunk == plain["generation"]["chunk"] == 64  # the chunk is the memory plan's, before the correction
    phases = cal["time"]["current"]["phases"]
    assert phases["generation"] == pytest.approx(B * N / min(500 * chunk / 16, 12_000), rel=1e-6)  # 8.192 s
    assert phases["reference"] == pytest.approx(B * L / 12_000, rel=1e-6)  # 4.096 s
    assert phases["policy_scoring"] == pytest.approx(2 * B * L / 12_000, rel=1e-6)  # 8.192 s
    assert phases["update"] == pytest.approx(EPOCHS * 2 * B * L / 3_000, rel=1e-6)  # 32.768 s
    assert phases["reward"] == plain["time"]["current"]["phases"]["reward"]  # a CPU worker: this machine's figures
    assert cal["time"]["current"]["source"].startswith(
        "GPU: `homerlhf check` case ppo-7b on NVIDIA GeForce RTX 4090, 2000-01-01 (")
    # Memory: measured / planned 8.8 / 8.0 = 1.10 (generation), 8.55 / 9.0 = 0.95 (kept), 7.14 / 7.0 = 1.02.
    before, after = allocated(plain), allocated(cal)
    assert after["generation"] == pytest.approx(before["generation"] * 1.10, abs=2e-4)
    assert after["scoring"] == before["scoring"]
    assert after["update"] == pytest.approx(before["update"] * 1.02, abs=2e-4)
    added = {p["name"]: [c for c in p["components"] if c["name"] == "measured on this card beyond the plan"]
             for p in cal["phases"]}
    assert [len(v) for v in added.values()] == [1, 0, 1]
    assert added["generation"][0]["note"] == "ppo-7b: allocated peak x1.100 of its plan"
    notes = [n for n in cal["notes"] if n.startswith("calibration:")]
    assert notes[0].startswith("calibration: time from `homerlhf check` case ppo-7b on NVIDIA GeForce RTX 4090, "
                               "2000-01-01") and "instead of H200 figures scaled to the RTX 4090" in notes[0]
    assert notes[1].startswith("calibration: memory: measured / planned allocated peak of that case: generation "
                               "x1.100, scoring x0.950 (kept as planned), update x1.020")
    assert not [n for n in plain["notes"] if n.startswith("calibration:")]


def test_the_case_of_the_plans_model_is_the_one_used(capsys):
    """Qwen2.5-1.5B: the grpo-1.5b case (the rloo-1.5b case failed and is passed over). GRPO scores with
    one adapter and the adapter-off reference: 10,000 tokens/s of scoring over 2 forwards = 20,000 a
    forward; 5,000 a forward + backward; 200 generated tokens/s at chunk 8."""
    cal = plan_json(capsys, "--preset", "4090", "--model", "Qwen/Qwen2.5-1.5B", *PINNED, "--set", "algorithm=grpo",
                    "--set", "group.size=4", "--calibration", str(EXAMPLE))
    chunk, phases = cal["generation"]["chunk"], cal["time"]["current"]["phases"]
    assert phases["generation"] == pytest.approx(B * N / min(200 * chunk / 8, 20_000), rel=1e-6)
    assert phases["policy_scoring"] == pytest.approx(B * L / 20_000, rel=1e-6)
    assert phases["update"] == pytest.approx(EPOCHS * B * L / 5_000, rel=1e-6)
    assert "case grpo-1.5b on NVIDIA GeForce RTX 4090" in cal["time"]["current"]["source"]


def test_the_plan_text_says_which_figures_it_used(capsys):
    main(["plan", "--preset", "4090", "--model", "Qwen/Qwen2.5-7B", "--calibration", str(EXAMPLE)])
    out = " ".join(capsys.readouterr().out.split())
    assert "note: calibration: time from `homerlhf check` case ppo-7b on NVIDIA GeForce RTX 4090, 2000-01-01" in out
    assert "measured on this card beyond the plan" in out


def _failed_only(tmp_path) -> Path:
    report = json.loads(EXAMPLE.read_text())
    report["cases"] = [c for c in report["cases"] if "error" in c]
    path = tmp_path / "failed.json"
    path.write_text(json.dumps(report))
    return path


BAD = {
    "missing": (lambda tmp: tmp / "nope.json", [], r"--calibration .*nope\.json: no such file; give the JSON report"),
    "not-json": (lambda tmp: _write(tmp, "{oops"), [], r"--calibration .*: not JSON \(.*\); give the report"),
    "not-a-report": (lambda tmp: _write(tmp, "[1, 2]"), [], r"--calibration .*: not a `homerlhf check` report"),
    "no-card": (lambda tmp: _write(tmp, json.dumps({"mode": "gpu", "cases": []})), [],
                r"--calibration .*: not a `homerlhf check` report \(mode 'gpu', card None\)"),
    "no-usable-case": (_failed_only, [], r"--calibration .*: no usable case: every case failed \(rloo-1\.5b\); run"),
    "another-card": (lambda tmp: EXAMPLE, ["--preset", "3090"],
                     r"--calibration .*: measured on NVIDIA GeForce RTX 4090, not the plan's RTX 3090 \(24 GiB\); plan"),
    "another-model": (lambda tmp: EXAMPLE, ["--model", "Qwen/Qwen2.5-14B"],
                      r"--calibration .*: it measured Qwen/Qwen2.5-1.5B, Qwen/Qwen2.5-7B, not Qwen/Qwen2.5-14B's shape"),
}


def _write(tmp: Path, text: str) -> Path:
    path = tmp / "report.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_report_is_one_line_and_exit_2(name, tmp_path, capsys):
    make, extra, message = BAD[name]
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--preset", "4090", *extra, "--calibration", str(make(tmp_path))])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert re.fullmatch("error: " + message + ".*", err.strip()), err


def test_a_bad_report_stops_before_anything_heavy_loads(tmp_path):
    code = ("import sys\nfrom homerlhf.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print(e.code, sorted(m for m in ('torch', 'transformers', 'bitsandbytes') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, "plan", "--preset", "4090", "--calibration", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "2 []" and done.stderr.startswith("error: --calibration")


def test_cards_match_by_their_model_words_and_memory():
    assert card_matches("RTX 4090", 24, "NVIDIA GeForce RTX 4090", 23.52)
    assert card_matches("Tesla T4 (Colab)", 15, "Tesla T4", 14.58)
    assert card_matches("A100 80GB", 80, "NVIDIA A100-SXM4-80GB", 79.15)
    assert card_matches("RTX 3060 12GB", 12, "NVIDIA GeForce RTX 3060", 11.63)
    assert not card_matches("A100 80GB", 80, "NVIDIA A100-SXM4-40GB", 39.39)  # same chip, half the memory
    assert not card_matches("RTX 4060 Ti 16GB", 16, "NVIDIA GeForce RTX 4060", 7.6)
    assert not card_matches("RTX 4090", 24, "NVIDIA H200", 139.8)
    assert not card_matches("RTX 4090", 24, "NVIDIA GeForce RTX 4090 D", 23.5)  # another card of the same number


# ---- the CPU smoke's report: read back, and what it must not hold ------------------------------------
def leaks(text: str, secrets: list[str]) -> list[str]:
    """What in ``text`` names this machine or its user: an absolute path of two or more parts, the
    home directory, the host name and user name as words (4 characters or more), a secret's value."""
    found = re.findall(r"(?<![\w.<>~/-])/(?:[\w.+@%-]+/)+[\w.+@%-]*", text)
    found += [s for s in secrets if s in text]
    home = str(Path.home())
    found += [home] if len(home) > 1 and re.search(rf"{re.escape(home)}\b", text) else []
    for name in (socket.gethostname(), getpass.getuser()):
        found += [name] if len(name) >= 4 and re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) else []
    return found


def _smoke(gpu_session_smoke) -> tuple[dict, Path, list[str]]:
    done, out = gpu_session_smoke
    path = out / "gpu_check.json"
    secrets = [done.env["HF_TOKEN"]]
    return json.loads(path.read_text()), path, secrets


@pytest.mark.slow
def test_a_cpu_smoke_report_is_read_back(gpu_session_smoke, capsys):
    """The smoke's ppo-7b case (a tiny model standing in for Qwen2.5-7B on the CPU) becomes the 4090 plan's
    trainer rates; its peaks are the process's RSS, so the memory stays as planned."""
    report, path, _ = _smoke(gpu_session_smoke)
    case = next(c for c in report["cases"] if c["case"] == "ppo-7b")
    rates, gen_chunk = case["tokens_per_s"], case["settings"]["rollout.generation_chunk"]
    plain = plan_json(capsys, "--preset", "4090", "--model", "Qwen/Qwen2.5-7B", *PINNED)
    cal = plan_json(capsys, "--preset", "4090", "--model", "Qwen/Qwen2.5-7B", *PINNED, "--calibration", str(path))
    forward = 3 * rates["tokens_per_s_scoring"]  # actor, critic, adapter-off reference
    # The plan's JSON writes seconds to 4 decimals: within 5e-5 of the hand-derived figure.
    phases, chunk = cal["time"]["current"]["phases"], cal["generation"]["chunk"]
    assert phases["generation"] == pytest.approx(B * N / min(rates["tokens_per_s_generation"] * chunk / gen_chunk,
                                                             forward), rel=1e-6, abs=5e-5)
    assert phases["reference"] == pytest.approx(B * L / forward, rel=1e-6, abs=5e-5)
    assert phases["update"] == pytest.approx(EPOCHS * 2 * B * L / (2 * rates["tokens_per_s_update"]), rel=1e-6, abs=5e-5)
    assert allocated(cal) == allocated(plain)
    assert "calibration: memory as planned: a CPU smoke measures the process's RSS, not the CUDA allocator" in cal["notes"]
    assert "a CPU smoke run (tiny models standing in for the RTX 4090's" in cal["time"]["current"]["source"]


@pytest.mark.slow
def test_the_cpu_smoke_report_holds_no_path_host_user_or_token(gpu_session_smoke):
    report, path, secrets = _smoke(gpu_session_smoke)
    assert leaks(path.read_text(), secrets) == []


@pytest.mark.slow
def test_scrubbing_the_cpu_smoke_report_leaves_nothing_to_find(gpu_session_smoke):
    """`homerlhf check` writes its report scrubbed: scrubbing it again changes nothing, and what the
    scrub took out (its scratch dir's paths, the token in its environment) the grep finds."""
    report, path, secrets = _smoke(gpu_session_smoke)
    _, out = gpu_session_smoke
    raw = json.dumps({**report, "unscrubbed": [f"reward.function={out}/homerlhf-check-x/rewards.py:reward", *secrets]})
    assert leaks(raw, secrets)  # the grep finds what a report written unscrubbed would hold, so it can fail
    scrubbed = scrub_report(report)
    assert scrubbed == report and leaks(json.dumps(scrubbed, indent=1), secrets) == []
    overrides = [o for c in scrubbed["cases"] for o in c["overrides"]
                 if o.startswith("reward.function=") and o != "reward.function=null"]  # the reward adapter's case: none
    assert overrides and all(o == "reward.function=<path>/rewards.py:reward" for o in overrides)


def test_scrub_takes_out_paths_secrets_and_names():
    env = {"HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyz", "WANDB_API_KEY": "0123456789abcdef", "HOME": "/home/ada",
           "PATH_KEY": "short"}
    report = {"overrides": ["reward.function=/tmp/homerlhf-gpu-check-x1/rewards.py:reward", "rollout.batch_size=16"],
              "traceback": 'File "/home/ada/venv/lib/python3.12/site-packages/torch/nn/modules/module.py", line 1',
              "error": "OSError: /home/ada/runs/rm/adapter missing on gpu-box-7 for ada",
              "placement": ["tokens/s 12.5; planned/measured 1.0; key 0123456789abcdef; hf_zzzzzzzzzzzzzzzzzzzzzzzz"],
              "n": 3, "ok": True, "none": None}
    assert scrub_report(report, env=env, host="gpu-box-7", user="ada") == {
        "overrides": ["reward.function=<path>/rewards.py:reward", "rollout.batch_size=16"],
        "traceback": 'File "torch/nn/modules/module.py", line 1',
        "error": "OSError: <path>/adapter missing on <name> for ada",  # 3 letters: too common a word to take out
        "placement": ["tokens/s 12.5; planned/measured 1.0; key <redacted>; <redacted>"],
        "n": 3, "ok": True, "none": None}
    assert scrub_report({"x": "ada lovelace runs on adabox"}, env={}, host="adabox", user="lovelace") == \
        {"x": "ada <name> runs on <name>"}


def test_a_plan_the_measured_peaks_take_over_the_margin_gets_a_suggestion(capsys):
    """14 GiB: 11.72 GiB planned fits (12.6 allowed); x1.10 in generation makes it tight, and the
    suggestion is searched for 14 / 1.10 = 12.73 GiB."""
    args = ["--preset", "4090", "--model", "Qwen/Qwen2.5-7B", "--gpu-gib", "14", *PINNED]
    plain, cal = plan_json(capsys, *args), plan_json(capsys, *args, "--calibration", str(EXAMPLE))
    assert plain["status"] == "fits" and plain["suggestion"] is None
    assert cal["status"] == "tight" and cal["suggestion"]["set_args"]
    assert "calibration: the suggestion is searched for 12.73 GiB, the card over the largest measured factor (x1.100)" \
        in " ".join(cal["notes"])
