"""Per-GPU memory with several GPUs: DDP splits only the experience and adds the all-reduce buffers;
FSDP shards the base, adapters and optimizer states and gathers two layers."""

from __future__ import annotations

import pytest

from homerlhf.config import load_config
from homerlhf.memory.components import nf4_bytes_per_param
from homerlhf.memory.planner import plan
from homerlhf.memory.render import shape_for


def _component(p, phase: str, name: str):
    return next(c for c in p.phase(phase).components if c.name == name)


def _plans(*overrides):
    # Every layer checkpointed: the preset's auto would spend what sharding frees on fewer recomputed layers.
    one = load_config("4090", None, ["rollout.batch_size=128", "training.checkpoint_every_n_layers=1",
                                     "training.activation_offload=false", *overrides])
    return one, plan(one, shape_for(one), with_suggestion=False)


def test_ddp_splits_the_experience_and_adds_two_flat_gradient_copies():
    cfg1, one = _plans()
    cfg2, two = _plans("distributed.gpus=2")
    shape = shape_for(cfg1)
    assert _component(two, "update", "experience buffer").bytes == _component(one, "update", "experience buffer").bytes // 2
    for name in ("base linear weights (NF4)", "LoRA actor", "LoRA critic", "optimizer states critic (adamw)"):
        assert _component(two, "update", name).bytes == _component(one, "update", name).bytes
    # actor + critic LoRA (r 16, all-linear) + value head (h + 1), fp32, sent and received: 2 x 4 B each.
    trainable = 2 * shape.lora_params(16, "all-linear") + shape.hidden_size + 1
    assert _component(two, "update", "gradient all-reduce buffers").bytes == 8 * trainable
    assert not any(c.name == "gradient all-reduce buffers" for c in two.phase("generation").components)
    assert two.distributed == {"gpus": 2, "fsdp": False, "global_batch": 128, "per_gpu_batch": 64}
    assert one.distributed["gpus"] == 1 and one.to_dict()["distributed"]["per_gpu_batch"] == 128


def test_fsdp_shards_base_adapters_and_optimizer_and_gathers_two_layers():
    cfg1, one = _plans()
    cfg4, four = _plans("distributed.gpus=4", "distributed.fsdp=true")
    shape = shape_for(cfg1)
    for name in ("base linear weights (NF4)", "LoRA actor", "LoRA critic", "optimizer states critic (adamw)"):
        assert _component(four, "scoring", name).bytes == _component(one, "scoring", name).bytes // 4
    assert _component(four, "scoring", "embeddings").bytes == _component(one, "scoring", "embeddings").bytes
    layer = int(shape.linear_weight_params / shape.num_layers * nf4_bytes_per_param(True))
    assert _component(four, "scoring", "gathered layers (FSDP)").bytes == 2 * layer
    assert not any(c.name == "gradient all-reduce buffers" for c in four.phase("update").components)
    assert four.peak_gib < one.peak_gib


def test_plan_cli_refuses_a_batch_that_does_not_split(capsys):
    from homerlhf.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--preset", "4090", "--gpus", "3"])  # 64 rows over 3 GPUs
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "does not split over 3 processes" in err and "Traceback" not in err
