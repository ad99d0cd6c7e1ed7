"""`homerlhf train --preset cpu-tiny --set model.name_or_path=<tiny model>` end to end through the
CLI, with the default backends (reference and reward in llama.cpp workers), for each newly
exported family; Gemma 3's reward model comes from `homerlhf reward` itself.

At iteration 1 the actor is the NF4 base (LoRA B = 0) and the reference its --from-nf4 export:
the step-0 KL is ~0 for every family, which the F32 exports of cpu-tiny make exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Short rollouts: one PPO iteration in well under a minute on 2 busy cores.
SMALL_RUN = ["ppo.iterations=1", "rollout.batch_size=8", "rollout.chunk_size=4", "rollout.max_new_tokens=6",
             "rollout.max_prompt_len=32", "ppo.mini_batch_size=8", "ppo.micro_batch_size=4", "ppo.epochs=1",
             "logging.progress=false", "checkpoint.every=1"]


def homerlhf(args, tmp_path, timeout=600) -> subprocess.CompletedProcess:
    env = dict(os.environ, HOMERLHF_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "homerlhf.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def train(model_dir, reward, tmp_path, name):
    sets = [f"model.name_or_path={model_dir}", f"reward.model={reward}", *SMALL_RUN]
    run = tmp_path / f"run-{name}"
    homerlhf(["train", "--preset", "cpu-tiny", *[a for s in sets for a in ("--set", s)], "--out", str(run)], tmp_path)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    health = {role: (run / "workers" / f"{role}.log").exists() for role in ("ref", "reward")}
    return rows, health


@pytest.mark.slow  # about a minute per family on 2 cores
@pytest.mark.parametrize("arch", ["gemma2", "phi3", "mistral"])
def test_train_with_llama_cpp_workers(arch, tmp_path):
    from homerlhf.tiny import build_causal_lm, build_sequence_classifier

    model_dir = build_causal_lm(tmp_path / arch, arch=arch, seed=0)
    reward_dir = build_sequence_classifier(tmp_path / f"{arch}-rm", arch=arch, seed=1)
    rows, logs = train(model_dir, reward_dir, tmp_path, arch)
    assert len(rows) == 1 and logs == {"ref": True, "reward": True}
    print(f"{arch}: step-0 kl_mean {rows[0]['kl_mean']:.2e}, score_mean {rows[0]['score_mean']:.3f}")
    assert abs(rows[0]["kl_mean"]) < 1e-3  # the NF4 export is KL-consistent for this family too


@pytest.mark.slow
def test_gemma3_reward_then_train(tmp_path):
    from homerlhf.tiny import build_causal_lm

    model_dir = build_causal_lm(tmp_path / "gemma3", arch="gemma3_text", seed=0)
    rm_run = tmp_path / "rm"
    homerlhf(["reward", "--preset", "cpu-tiny", "--set", f"model.name_or_path={model_dir}", "--set", "rm.max_steps=2",
              "--set", "rm.eval_data=null", "--set", "data.max_rows=64", "--out", str(rm_run)], tmp_path)
    manifest = json.loads((rm_run / "gguf" / "manifest.json").read_text())
    assert manifest["architecture"] == "gemma3" and manifest["model_type"] == "gemma3_text"
    rows, logs = train(model_dir, rm_run, tmp_path, "gemma3")
    assert len(rows) == 1 and logs == {"ref": True, "reward": True}
    print(f"gemma3_text: step-0 kl_mean {rows[0]['kl_mean']:.2e}, score_mean {rows[0]['score_mean']:.3f}")
    assert abs(rows[0]["kl_mean"]) < 1e-3
