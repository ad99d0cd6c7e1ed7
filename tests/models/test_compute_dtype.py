"""The compute dtype end to end (``quant.upcast_non_quantized`` off) against the fp32 upcast (on): the
dtype of every tensor class of the policy, and the fp32 logits its sampler reads."""

from __future__ import annotations

import pytest
import torch

from homerlhf.config import load_config
from homerlhf.models.policy import ACTOR, PolicyModel
from homerlhf.ppo.rollout import pad_sequences


def _cfg(upcast: bool, *extra):
    return load_config("cpu-tiny", overrides=["ref.backend=adapter_off", "reward.backend=hf", "quant.compute_dtype=bf16",
                                              f"quant.upcast_non_quantized={str(upcast).lower()}", *extra])


def _sampled_logits(policy, ids, mask):
    """The logits HF generate hands its processors (the behaviour recorder, the sampler) at the first step."""
    from homerlhf.models.generation import build_generation_config, checkpoint_defaults_off

    pad = policy.tokenizer.pad_token_id
    config = build_generation_config(max_new_tokens=1, temperature=1.0, stop_ids=policy.stop_ids, pad_id=pad)
    config.output_logits, config.return_dict_in_generate = True, True
    with torch.no_grad(), policy.use_adapter(ACTOR), checkpoint_defaults_off(policy.model.get_base_model(), config):
        return policy.model.generate(input_ids=ids, attention_mask=mask, generation_config=config).logits[0]


@pytest.mark.parametrize("upcast", [False, True])
def test_every_tensor_class_has_the_dtype_the_config_says(peaked_policy_dir, upcast):
    """bf16 compute: weights, hidden states and both KV caches in bf16 (fp32 with the upcast); logits,
    LoRA, value head, gradients and optimizer states fp32 either way. The sampler reads the head's fp32
    logits of the final hidden state: for this peaked model (logits up to ~10) the bf16 head output
    would be off by ~0.03."""
    from homerlhf.models.static_decode import DecodeBuffers, prefill

    policy = PolicyModel.from_config(_cfg(upcast), str(peaked_policy_dir))
    base = policy.model.get_base_model()
    frozen = torch.float32 if upcast else torch.bfloat16
    inner = base.model
    assert inner.embed_tokens.weight.dtype == policy.lm_head.weight.dtype == inner.norm.weight.dtype == frozen
    assert {layer.input_layernorm.weight.dtype for layer in inner.layers} == {frozen}
    assert inner.layers[0].self_attn.q_proj.base_layer.weight.dtype == torch.uint8  # NF4 codes
    assert {p.dtype for p in policy.actor_parameters() + policy.critic_parameters()} == {torch.float32}

    ids, mask = pad_sequences([[4, 300, 301, 302, 20, 6], [4, 77, 6]], policy.tokenizer.pad_token_id)
    with torch.no_grad():
        hidden = policy.hidden_states(ids, mask)
        assert hidden.dtype == frozen
        assert policy.lm_head(hidden).dtype == torch.float32  # the logits chunk
        with policy.use_adapter(ACTOR):
            dynamic = base(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
            static = DecodeBuffers(base, 2, ids.shape[1] + 2, ids.device)
            first = prefill(base, static, ids, mask)
    assert dynamic.layers[0].keys.dtype == dynamic.layers[0].values.dtype == frozen  # HF generate's cache
    assert static.cache.layers[0].keys.dtype == static.cache.layers[0].values.dtype == frozen  # the static loop's
    assert first.dtype == torch.float32

    sampled, last = _sampled_logits(policy, ids, mask), hidden[:, -1]
    exact = last.double() @ policy.lm_head.weight.double().t()
    assert sampled.dtype == torch.float32 and exact.abs().max() > 5
    assert (sampled.double() - exact).abs().max() < 1e-4
    if not upcast:
        assert (torch.nn.functional.linear(last, policy.lm_head.weight).double() - exact).abs().max() > 1e-2

    # One step: gradients and AdamW states fp32, as the weights they follow; values fp32 from the value head.
    policy.checkpoint_activations(True)
    sequences, both = torch.cat([ids, ids], 1), torch.cat([mask, mask], 1)
    assert policy.critic_values(sequences, both, 3).dtype == torch.float32
    logprobs, _ = policy.actor_logprobs(sequences, both, 3)
    assert logprobs.dtype == torch.float32
    logprobs.sum().backward()
    optimizer = torch.optim.AdamW(policy.actor_parameters(), lr=1e-3)
    optimizer.step()
    assert {v.dtype for s in optimizer.state.values() for k, v in s.items() if k != "step"} == {torch.float32}
    assert {p.grad.dtype for p in policy.actor_parameters() if p.grad is not None} == {torch.float32}
