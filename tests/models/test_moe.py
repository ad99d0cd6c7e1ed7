"""A mixture-of-experts policy on the 4-bit base: its experts really 4-bit (bytes counted), LoRA where
it is set, the router frozen; MoEs homerlhf does not know refused before a weight is read."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from homerlhf.config import load_config
from homerlhf.errors import UserError
from homerlhf.models import moe
from homerlhf.models.experts4bit import Experts4bit

PPO = ["ref.backend=adapter_off", "reward.backend=hf"]


def nf4_expert_bytes(n: int) -> int:
    """One expert's matrix of ``n`` weights under double quant, by hand: 4-bit codes (n / 2 bytes), an
    8-bit absmax per 64 weights, a fp32 second-level constant per 256 absmax and the fp32 offset."""
    blocks = math.ceil(n / 64)
    return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / 256) + 4


@pytest.fixture(scope="module")
def qwen3_moe_policy(tiny_qwen3_moe_dir):
    from homerlhf.models.policy import PolicyModel

    cfg = load_config("cpu-tiny", overrides=PPO + ["actor.lora.experts=true"])
    return PolicyModel.from_config(cfg, str(tiny_qwen3_moe_dir))


def test_the_experts_are_4bit_in_memory(qwen3_moe_policy, tiny_qwen3_moe_dir):
    """Every experts module holds 4-bit codes and statistics, no 16/32-bit 3-D weight is left, and the
    bytes are the hand count: 4 layers x 8 experts x (gate_up 128 x 128 + down 128 x 64)."""
    config = json.loads((tiny_qwen3_moe_dir / "config.json").read_text())
    model = qwen3_moe_policy.model
    modules = [m for m in model.modules() if isinstance(m, Experts4bit)]
    assert len(modules) == config["num_hidden_layers"] == 4
    float_3d = [n for n, p in model.named_parameters() if p.dim() == 3 and p.is_floating_point()]
    assert not float_3d
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    experts = config.get("num_experts") or config["num_local_experts"]  # transformers 5 writes the latter
    per_layer = experts * (nf4_expert_bytes(2 * inter * hidden) + nf4_expert_bytes(hidden * inter)) + 256 * 4
    assert sum(m.storage_bytes() for m in modules) == 4 * per_layer
    dense = 4 * experts * 3 * inter * hidden * 4  # what the experts hold in fp32
    assert 4 * per_layer < dense / 7


def test_lora_reaches_the_experts_and_the_router_stays_frozen(qwen3_moe_policy):
    policy = qwen3_moe_policy
    ids = torch.randint(3, 500, (2, 12))
    for name, param in policy.model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    policy.checkpoint_activations(True)
    logprobs, _ = policy.actor_logprobs(ids, torch.ones_like(ids), 4)
    logprobs.sum().backward()
    grads = {n: p.grad for n, p in policy.model.named_parameters() if p.grad is not None}
    assert any("mlp.experts" in n and ".actor." in n for n in grads)
    assert any("self_attn" in n for n in grads)
    assert not any("mlp.gate" in n for n in grads)
    routers = [m for m in policy.model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    assert routers and not any(p.requires_grad for r in routers for p in r.parameters())
    assert not any("lora" in n for r in routers for n, _ in r.named_parameters())
    assert policy.model.get_base_model().config.output_router_logits is False
    policy.model.zero_grad(set_to_none=True)


def test_without_lora_experts_only_attention_is_adapted(tiny_gpt_oss_dir):
    from homerlhf.models.policy import PolicyModel

    policy = PolicyModel.from_config(load_config("cpu-tiny", overrides=PPO), str(tiny_gpt_oss_dir))
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in policy.model.named_parameters() if "lora_" in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert all(isinstance(m, Experts4bit) for m in policy.model.modules() if "Experts" in type(m).__name__)


@pytest.mark.parametrize("config, message", [
    ({"model_type": "mixtral", "num_local_experts": 8}, "mixture of experts 'mixtral' is not supported"),
    ({"model_type": "qwen2_moe", "num_experts": 60}, "supported MoE: qwen3_moe, gpt_oss"),
    ({"model_type": "gpt_oss", "num_local_experts": 32, "quantization_config": {"quant_method": "mxfp4"}},
     "stored mxfp4-quantized"),
])
def test_moes_it_does_not_know_are_refused_from_their_config(config, message):
    with pytest.raises(UserError, match=message) as err:
        moe.check_moe(config, "some/model")
    assert "\n" not in str(err.value)
    assert moe.check_moe({"model_type": "llama"}, "x") is None


def test_an_unknown_expert_layout_is_refused_before_a_weight_is_read(tiny_qwen3_moe_dir, tmp_path, monkeypatch):
    """The skeleton's experts are not the class the layout names: refused while it is built. The
    checkpoint is cut short, so reading any weight would fail otherwise (it does, with the known layout)."""
    from homerlhf.models.base_loading import load_base

    for item in tiny_qwen3_moe_dir.iterdir():
        if item.suffix == ".json":
            shutil.copy(item, tmp_path / item.name)
    (tmp_path / "model.safetensors").write_bytes((tiny_qwen3_moe_dir / "model.safetensors").read_bytes()[:2000])
    cfg = load_config("cpu-tiny")
    with pytest.raises(Exception) as err:
        load_base(str(tmp_path), cfg)
    assert not isinstance(err.value, UserError) or "layout" not in str(err.value)
    monkeypatch.setitem(moe.LAYOUTS, "qwen3_moe", moe.ExpertsLayout("OtherExperts", "Qwen3MoeTopKRouter", False))
    with pytest.raises(UserError, match="in a layout homerlhf does not know"):
        load_base(str(tmp_path), cfg)
    monkeypatch.setitem(moe.LAYOUTS, "qwen3_moe", moe.ExpertsLayout("Qwen3MoeExperts", "OtherRouter", False))
    with pytest.raises(UserError, match="router Qwen3MoeTopKRouter is not the OtherRouter"):
        load_base(str(tmp_path), cfg)


def test_the_static_decoder_declines_4bit_experts(qwen3_moe_policy):
    """Each decode step's routing is read on the host, which a CUDA graph cannot hold: HF generate samples."""
    from homerlhf.models.static_refusal import refusal

    assert "4-bit experts" in refusal(qwen3_moe_policy.model.get_base_model())


@pytest.mark.parametrize("config", ["MixtralConfig", "Qwen2MoeConfig"])
def test_train_and_plan_refuse_a_moe_it_does_not_know_in_one_line(config, tmp_path):
    """From its config.json alone: the directory holds no weights at all."""
    import subprocess
    import sys

    import transformers

    getattr(transformers, config)(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path / "moe")
    for args in (["train", "--preset", "cpu-tiny", "--set", f"model.name_or_path={tmp_path / 'moe'}",
                  "--out", str(tmp_path / "run")], ["plan", "--preset", "4090", "--model", str(tmp_path / "moe")]):
        proc = subprocess.run([sys.executable, "-m", "homerlhf.cli", *args], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "is not supported" in lines[0] and "supported MoE: qwen3_moe, gpt_oss" in lines[0]
    assert not (tmp_path / "run").exists()


def test_the_router_loss_is_off_unless_set_then_transformers_own(qwen3_moe_policy):
    """ppo.router_aux_loss_coef 0 (the default): no router loss is computed. Set: the actor's forward with
    grad keeps coef x transformers' own load-balancing loss of that forward (its CausalLM's aux_loss), once;
    it reaches the adapters, not the frozen routers."""
    from homerlhf.ppo.loop import with_router_aux

    policy = qwen3_moe_policy
    ids = torch.randint(3, 500, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    policy.checkpoint_activations(True)
    policy.actor_logprobs(ids, mask, 4)
    assert policy.take_router_aux_loss() is None
    policy.router_aux_coef = 0.01
    try:
        policy.actor_logprobs(ids, mask, 4)
        with torch.no_grad():
            want = policy.model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
        aux = policy.router_aux_loss
        assert aux is not None and aux.item() == pytest.approx(0.01 * want.item(), rel=1e-6)
        loss = with_router_aux(policy, torch.zeros(()))
        assert policy.take_router_aux_loss() is None and loss is not None
        loss.backward()
        grads = {n for n, p in policy.model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        assert any(".lora_" in n for n in grads) and not any("mlp.gate" in n for n in grads)
    finally:
        policy.router_aux_coef = 0.0
        policy.model.zero_grad(set_to_none=True)


def test_a_moe_critic_of_its_own_is_refused_before_it_loads(tiny_qwen3_moe_dir):
    from homerlhf.models.critic_model import CriticModel

    cfg = load_config("cpu-tiny", overrides=PPO + [f"critic.model={tiny_qwen3_moe_dir}"])
    with pytest.raises(UserError, match="a mixture of experts; the critic on a base of its own is a dense model"):
        CriticModel.from_config(cfg, str(tiny_qwen3_moe_dir))
