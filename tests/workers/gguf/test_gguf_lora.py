"""The actor's LoRA as a llama.cpp GGUF LoRA adapter: the keys llama.cpp reads, one lora_a/lora_b
pair per adapted weight under the base tensor's GGUF name, peft's scaling folded into lora_b and
Llama's q/k rope permutation applied to lora_b's rows. (llama.cpp applying it: tests/workers/
test_rollout_engine.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def peft_llama(tiny_llama_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"]),
                           adapter_name="actor")
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_()
    return model


def test_adapter_keys_names_and_values(peft_llama, tiny_llama_dir, tmp_path):
    from gguf import GGUFReader

    from homerlhf.workers.gguf import permute_qk
    from homerlhf.workers.gguf.lora import write_lora_gguf
    from homerlhf.workers.gguf.tensors import read_config

    config = read_config(tiny_llama_dir)
    path = write_lora_gguf(peft_llama, "actor", config, tmp_path / "actor.gguf")
    reader = GGUFReader(str(path))
    fields = {k: reader.fields[k].contents() for k in ("general.type", "general.architecture", "adapter.type",
                                                        "adapter.lora.alpha")}
    assert fields == {"general.type": "adapter", "general.architecture": "llama", "adapter.type": "lora",
                      "adapter.lora.alpha": 0.0}
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    n_layers = int(config["num_hidden_layers"])
    expected_names = {f"blk.{i}.{m}.weight.lora_{ab}" for i in range(n_layers)
                      for m in ("attn_q", "attn_k", "attn_v", "ffn_down") for ab in "ab"}
    assert set(tensors) == expected_names
    layer = peft_llama.base_model.model.model.layers[0]
    scaling = 12 / 4
    for module, gguf_name, heads in ((layer.self_attn.q_proj, "attn_q", config["num_attention_heads"]),
                                     (layer.self_attn.k_proj, "attn_k", config.get("num_key_value_heads")),
                                     (layer.self_attn.v_proj, "attn_v", None), (layer.mlp.down_proj, "ffn_down", None)):
        a = module.lora_A["actor"].weight.detach().numpy()
        b = module.lora_B["actor"].weight.detach().numpy() * scaling
        if heads is not None:  # q/k rows in llama.cpp's interleaved rope order
            b = permute_qk(b, int(heads or config["num_attention_heads"]))
        np.testing.assert_array_equal(tensors[f"blk.0.{gguf_name}.weight.lora_a"], a)
        np.testing.assert_allclose(tensors[f"blk.0.{gguf_name}.weight.lora_b"], b, rtol=0, atol=1e-6)
    # The permutation is not a no-op on these rows (else the q/k check above would prove nothing).
    q_b = layer.self_attn.q_proj.lora_B["actor"].weight.detach().numpy()
    assert not np.array_equal(permute_qk(q_b, int(config["num_attention_heads"])), q_b)


def test_an_adapter_the_policy_lacks_is_a_user_error(peft_llama, tiny_llama_dir, tmp_path):
    from homerlhf.errors import UserError
    from homerlhf.workers.gguf.lora import write_lora_gguf
    from homerlhf.workers.gguf.tensors import read_config

    with pytest.raises(UserError, match="no LoRA modules for adapter 'critic'"):
        write_lora_gguf(peft_llama, "critic", read_config(tiny_llama_dir), tmp_path / "critic.gguf")
    assert not list(tmp_path.iterdir())  # nothing half-written left behind
