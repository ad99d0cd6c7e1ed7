"""A tiny Qwen3-MoE policy (4-bit experts, LoRA on attention and experts) through the CLI as a user runs it:
PPO with a small dense critic (``critic.model``) and the llama.cpp reference from its NF4 experts, and GRPO,
each learning a toy task; a run killed at its checkpoint resumes to the straight run's weights and metrics;
the trained policy exports merged and as GGUF.

The toy task: the share of a reply's tokens among the vocabulary's first 256 ids (a function reward). The
policy is random but peaked (``head_scale`` 20, as a trained LM's next-token distribution), so moving that
share is learnable in a dozen short iterations.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from homerlhf.ppo.checkpoint import latest_complete_checkpoint

ITERATIONS = 12
REWARD = '''def low_ids(response_ids) -> float:
    return sum(1 for t in response_ids if t < 256) / max(1, len(response_ids))
'''
COMMON = [f"ppo.iterations={ITERATIONS}", "rollout.batch_size=32", "rollout.chunk_size=32", "rollout.max_new_tokens=8",
          "rollout.max_prompt_len=24", "ppo.mini_batch_size=16", "ppo.micro_batch_size=16", "ppo.epochs=1",
          "logging.progress=false", "actor.lora.experts=true", "rollout.engine=hf", "actor.lr=2e-3",
          "ppo.kl_coef=0.01", "ppo.adaptive_kl=false", "rollout.truncation_penalty=null", "reward.backend=function"]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from homerlhf.tiny import build_causal_lm

    root = tmp_path_factory.mktemp("moe-toy")
    (root / "rewards.py").write_text(REWARD)
    policy = build_causal_lm(root / "moe", arch="qwen3_moe", seed=2, head_scale=20.0, hidden=64, layers=2)
    critic = build_causal_lm(root / "critic", arch="llama", seed=5, hidden=64, layers=2)
    return root, policy, critic


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")


def _train_args(toy, out: Path, *sets: str) -> list[str]:
    root, policy, _ = toy
    overrides = [f"model.name_or_path={policy}", f"reward.function={root / 'rewards.py'}:low_ids", *COMMON, *sets]
    return ["train", "--preset", "cpu-tiny", "--out", str(out)] + [x for o in overrides for x in ("--set", o)]


def _cli(argv) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "homerlhf.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())


def _run(argv, timeout=900) -> str:
    proc = _cli(argv)
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out + err


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time_", "tokens_per_s_", "peak_mem_"))} for r in rows]


def _learned(rows: list[dict]) -> tuple[float, float]:
    """Mean score of the first and the last third of the run."""
    third = len(rows) // 3
    return (sum(r["score_mean"] for r in rows[:third]) / third, sum(r["score_mean"] for r in rows[-third:]) / third)


@pytest.mark.slow  # three short CLI runs and an export, about 3 minutes on 2 busy cores
def test_ppo_with_a_dense_critic_learns_resumes_exactly_and_exports(toy, tmp_path):
    from safetensors.torch import load_file

    _, policy, critic = toy
    ppo = (f"critic.model={critic}", "ppo.score_norm=true", "ref.backend=llamacpp", "ref.threads=1",
           f"checkpoint.every={ITERATIONS // 2}")
    straight = tmp_path / "straight"
    _run(_train_args(toy, straight, *ppo))
    rows = _rows(straight)
    assert abs(rows[0]["kl_mean"]) < 1e-3  # the reference is the NF4 experts' own export: KL 0 at step 0
    first, last = _learned(rows)
    print(f"PPO on the tiny MoE: score {first:.3f} -> {last:.3f} (first / last third of {len(rows)} iterations)")
    assert last > first + 0.1, (first, last)

    killed = tmp_path / "killed"
    proc = _cli(_train_args(toy, killed, *ppo))
    deadline = time.monotonic() + 600
    while latest_complete_checkpoint(killed) is None:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _run(["train", "--resume", str(killed)])
    a, b = (latest_complete_checkpoint(run) for run in (straight, killed))
    for rel in ("actor/adapter_model.safetensors", "critic/adapter_model.safetensors", "value_head.safetensors"):
        wa, wb = load_file(str(a / rel)), load_file(str(b / rel))
        assert wa.keys() == wb.keys() and all((wa[k] - wb[k]).abs().max() <= 1e-6 for k in wa), rel
    assert any(".mlp.experts." in k for k in load_file(str(a / "actor/adapter_model.safetensors")))
    assert _rows(straight) == _rows(killed)

    out = _run(["export", "policy", str(straight), "--out", str(tmp_path / "export"), "--gguf", "f32"])
    gap = float(out.split("log-prob gap to the trained policy on")[1].split("max ")[1].split(",")[0])
    print(f"merged vs trained policy: max |log-prob gap| {gap:.2e}")
    assert gap < 1e-4  # the merged model is the trained 4-bit MoE, LoRA on its experts included
    _gguf_equals_merged(tmp_path / "export")


def _gguf_equals_merged(export: Path) -> None:
    """The exported GGUF (llama.cpp's qwen3moe graph) gives the merged HF model's log-probs within 1e-3."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    import importlib.util

    spec = importlib.util.spec_from_file_location("gguf_tests", Path(__file__).parents[1] / "workers/gguf/conftest.py")
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)  # its llama.cpp logits in a child interpreter

    ids = [2, 4, 17, 30, 41, 50, 51, 52, 60, 61, 62, 63, 64, 65, 1, 7, 8, 9, 10, 11]
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()
    gguf = next((export / "gguf").glob("*-f32.gguf"))
    llama = torch.log_softmax(torch.tensor(helpers._llama_cpp_logits(gguf, ids)), -1).numpy()
    assert np.abs(llama - hf).max() <= 1e-3


@pytest.mark.slow
def test_grpo_learns_on_a_tiny_moe(toy, tmp_path):
    run = tmp_path / "grpo"
    _run(_train_args(toy, run, "algorithm=grpo", "group.size=4", "ref.backend=adapter_off",
                     f"checkpoint.every={ITERATIONS}"))
    first, last = _learned(_rows(run))
    print(f"GRPO on the tiny MoE: score {first:.3f} -> {last:.3f} (first / last third of {ITERATIONS} iterations)")
    assert last > first + 0.1, (first, last)


def test_a_dense_critic_beside_the_moe_is_planned(toy, capsys):
    from homerlhf.cli import main

    _, policy, critic = toy
    main(["plan", "--preset", "cpu-tiny", "--model", str(policy), "--set", f"critic.model={critic}",
          "--set", "actor.lora.experts=true", "--gpu-gib", "1"])
    out = capsys.readouterr().out
    assert "experts (NF4)" in out and "critic base linear weights (NF4)" in out and "(+ experts)" in out
