"""`run_ppo` with rollout.engine=llamacpp: the stage builds the engine on the KL-consistent export,
the run's metrics carry its (near-1) IS weights, and closing the run leaves no adapter file behind.
The run is a child process: llama.cpp runs in it (a build that dies fails this test only)."""

from __future__ import annotations

import json

import pytest

CHILD = r"""
import json, sys
from homerlhf.config import load_config
from homerlhf.stages.ppo import run_ppo
from homerlhf.ppo.metrics import read_metrics

model_dir, rm_dir, run_dir = sys.argv[1:4]
cfg = load_config("cpu-tiny", overrides=[
    f"model.name_or_path={model_dir}", "ref.backend=adapter_off", "reward.backend=hf", f"reward.model={rm_dir}",
    "rollout.engine=llamacpp", "rollout.engine_outtype=f32", "rollout.engine_f32_kv_cache=true",
    "rollout.batch_size=4", "rollout.chunk_size=2", "rollout.max_new_tokens=4", "rollout.max_prompt_len=16",
    "ppo.mini_batch_size=4", "ppo.micro_batch_size=4", "ppo.epochs=1", "ppo.iterations=2", "logging.progress=false"])
result = run_ppo(cfg, out_dir=run_dir)
print(json.dumps({"rows": read_metrics(result["run_dir"]), "iteration": result["iteration"]}))
"""


def test_run_ppo_with_the_llamacpp_engine(tiny_llama_dir, tmp_path):
    from homerlhf.doctor import ChildFailed, run_child
    from homerlhf.tiny import build_sequence_classifier

    rm_dir = build_sequence_classifier(tmp_path / "rm", arch="llama", seed=3)
    run_dir = tmp_path / "run"
    try:
        out = run_child(CHILD, str(tiny_llama_dir), str(rm_dir), str(run_dir), timeout=900)
    except ChildFailed as exc:
        pytest.fail(f"PPO run with the llamacpp engine: {exc.detail}; {exc.fix}", pytrace=False)
    assert out["iteration"] == 2 and len(out["rows"]) == 2
    for row in out["rows"]:
        assert abs(row["is_weight_mean"] - 1) < 1e-3 and row["is_capped_fraction"] == 0.0, json.dumps(row)
        assert row["kl_behaviour_old"] < 1e-6
    assert (run_dir / "engine").is_dir() and not list((run_dir / "engine").iterdir())
