"""FSDP + QLoRA on the CPU (gloo), through ``scripts/validate_multi_gpu.py``'s per-process mode: two
processes shard the tiny Llama's NF4 base (codes stored in fp32) and its LoRA; a forward/backward
gives the unsharded model's loss and LoRA gradients.
About 40 s on 2 shared cores (two processes each load the model twice)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from homerlhf.config import load_config
from homerlhf.errors import UserError
from homerlhf.models.sharding import check_trainable_sharded
from homerlhf.stages.data_parallel import free_port

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "validate_multi_gpu.py"


@pytest.mark.slow
def test_fsdp_qlora_on_two_cpu_processes_matches_the_unsharded_model(tiny_llama_dir, tmp_path):
    out = tmp_path / "fsdp.json"
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
           "--dynamo_backend", "no", str(SCRIPT), "--fsdp-rank", str(tiny_llama_dir), str(out), "cpu"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = json.loads(out.read_text())  # the figures of each process, as scripts/validate_multi_gpu.py runs it
    print(ranks)
    assert len(ranks) == 2
    for got in ranks:
        assert got["world"] == 2
        assert got["codes"] == ["Params4bit", "torch.float32"]  # 4-bit codes in fp32 storage
        assert got["loss_sharded"] == pytest.approx(got["loss_plain"], abs=1e-6)
        assert got["grads"][0] == got["grads"][1] > 0  # every LoRA gradient comes back
        assert got["max_grad_diff"] <= 1e-6
        # Each process holds about half of the parameters (shards are padded to equal sizes).
        assert 0.45 * got["full_numel"] <= got["local_shard_numel"] <= 0.55 * got["full_numel"]


def test_the_trainer_refuses_fsdp_in_one_line():
    cfg = load_config("cpu-tiny", None, ["distributed.fsdp=true", "distributed.gpus=2"])
    with pytest.raises(UserError, match="does not run sharded yet"):
        check_trainable_sharded(cfg)
