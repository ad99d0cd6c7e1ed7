"""The 4-bit policy: real NF4 packing, adapter independence, padding invariance, saving."""

from __future__ import annotations

import pytest
import torch

from homerlhf.config import load_config
from homerlhf.models.generation import build_generation_config
from homerlhf.models.logprobs import position_ids_from_mask
from homerlhf.models.policy import ACTOR, CRITIC, PolicyModel
from homerlhf.ppo.rollout import pad_sequences
from tolerances import fp32_bound


def _cfg(*extra):
    return load_config("cpu-tiny", overrides=[
        "ref.backend=adapter_off", "reward.backend=hf", "ppo.logprob_chunk_size=3", *extra])


@pytest.fixture(scope="module")
def policy(tiny_llama_dir):
    torch.manual_seed(0)
    return PolicyModel.from_config(_cfg(), str(tiny_llama_dir))


def _batch(pad_id):
    """Two samples with different prompt and response lengths (left / right padded)."""
    prompts = [[4, 300, 301, 302, 20, 1, 6], [4, 310, 1, 6]]
    responses = [[120, 121, 1], [130, 131, 132, 133, 134]]
    p_ids, p_mask = pad_sequences(prompts, pad_id)
    width = max(map(len, responses))
    r_ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in responses])
    r_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in responses])
    return torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1), r_mask, width


def test_base_is_really_nf4_and_only_adapters_and_value_head_train(policy):
    import bitsandbytes as bnb

    linear4 = [m for m in policy.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linear4) == 4 * 7  # q k v o gate up down in each of 4 layers
    for module in linear4:
        assert module.weight.dtype == torch.uint8  # packed, two 4-bit codes per byte
        assert module.weight.quant_state.quant_type == "nf4"
        assert module.weight.quant_state.nested  # double quant
    trainable = {id(p) for p in policy.model.parameters() if p.requires_grad}
    adapters = {id(p) for p in policy.adapter_parameters(ACTOR)} | {id(p) for p in policy.adapter_parameters(CRITIC)}
    assert trainable <= adapters and policy.adapter_parameters(ACTOR) and policy.adapter_parameters(CRITIC)
    assert policy.value_head.linear.weight.dtype == torch.float32


def test_chunked_actor_logprobs_equal_full_logits(policy, naive_logprobs):
    ids, mask, r_mask, T = _batch(policy.tokenizer.pad_token_id)
    with torch.no_grad():
        logprobs, _ = policy.actor_logprobs(ids, mask, T)
        logits = policy.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    naive = naive_logprobs(logits[:, -T - 1 : -1], ids[:, -T:])
    # The chunked log-softmax against one over the full logits: other kernels (tests/tolerances.py).
    torch.testing.assert_close(logprobs * r_mask, naive * r_mask, atol=fp32_bound(naive.abs().max()), rtol=0)


def test_padding_changes_nothing(policy):
    ids, mask, r_mask, T = _batch(policy.tokenizer.pad_token_id)
    with torch.no_grad():
        batch_lp, _, batch_v = policy.actor_logprobs_and_values(ids, mask, T)
        batch_ref = policy.reference_logprobs(ids, mask, T)
        for row in range(2):
            keep = mask[row].bool()
            alone_ids, n = ids[row][keep].unsqueeze(0), int(r_mask[row].sum())
            alone_mask = torch.ones_like(alone_ids)
            lp, _, v = policy.actor_logprobs_and_values(alone_ids, alone_mask, n)
            ref = policy.reference_logprobs(alone_ids, alone_mask, n)
            # A padded batch against one unpadded row: other matmul shapes (tests/tolerances.py).
            torch.testing.assert_close(batch_lp[row, :n], lp[0], atol=fp32_bound(lp.abs().max()), rtol=0)
            torch.testing.assert_close(batch_v[row, :n], v[0], atol=fp32_bound(v.abs().max()), rtol=0)
            torch.testing.assert_close(batch_ref[row, :n], ref[0], atol=fp32_bound(ref.abs().max()), rtol=0)


def test_adapters_are_independent(tiny_llama_dir):
    torch.manual_seed(0)
    policy = PolicyModel.from_config(_cfg(), str(tiny_llama_dir))
    ids, mask, r_mask, T = _batch(policy.tokenizer.pad_token_id)
    with torch.no_grad():
        actor0, _ = policy.actor_logprobs(ids, mask, T)
        critic0 = policy.critic_values(ids, mask, T)
        ref0 = policy.reference_logprobs(ids, mask, T)
    torch.testing.assert_close(actor0, ref0, atol=0, rtol=0)  # LoRA B starts at zero

    policy.checkpoint_activations(True)
    opt = torch.optim.AdamW(policy.actor_parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        logprobs, _ = policy.actor_logprobs(ids, mask, T)
        (-(logprobs * r_mask).sum()).backward()
        opt.step()
    policy.checkpoint_activations(False)
    with torch.no_grad():
        actor1, _ = policy.actor_logprobs(ids, mask, T)
        critic1 = policy.critic_values(ids, mask, T)
        ref1 = policy.reference_logprobs(ids, mask, T)
    assert ((actor1 - actor0) * r_mask).sum() > 0.1  # the actor learned to like these tokens
    torch.testing.assert_close(critic1, critic0, atol=0, rtol=0)
    torch.testing.assert_close(ref1, ref0, atol=0, rtol=0)

    policy.checkpoint_activations(True)
    opt = torch.optim.AdamW(policy.critic_parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        values = policy.critic_values(ids, mask, T)
        (((values - 1.0) * r_mask) ** 2).sum().backward()
        opt.step()
    with torch.no_grad():
        actor2, _ = policy.actor_logprobs(ids, mask, T)
        critic2 = policy.critic_values(ids, mask, T)
    assert (critic2 - critic0).abs().max() > 1e-2
    torch.testing.assert_close(actor2, actor1, atol=0, rtol=0)


def test_shared_adapter_one_forward_and_save(tiny_llama_dir, tmp_path):
    torch.manual_seed(0)
    policy = PolicyModel.from_config(_cfg("critic.shared_adapter=true"), str(tiny_llama_dir))
    assert not policy.adapter_parameters(CRITIC)
    assert policy.critic_parameters() == list(policy.value_head.parameters())
    torch.nn.init.normal_(policy.value_head.linear.weight, std=0.1)
    ids, mask, _, T = _batch(policy.tokenizer.pad_token_id)
    with torch.no_grad():
        lp, ent, v = policy.actor_logprobs_and_values(ids, mask, T)
        torch.testing.assert_close(lp, policy.actor_logprobs(ids, mask, T)[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(v, policy.critic_values(ids, mask, T), atol=1e-6, rtol=0)
    policy.save(tmp_path)
    assert (tmp_path / "actor" / "adapter_model.safetensors").exists()
    assert not (tmp_path / "critic").exists()
    head = policy.value_head.linear.weight.detach().clone()
    torch.nn.init.zeros_(policy.value_head.linear.weight)
    policy.load_value_head(tmp_path / "value_head.safetensors")
    torch.testing.assert_close(policy.value_head.linear.weight, head, atol=0, rtol=0)


def test_generate_returns_only_the_response(policy):
    prompts, prompt_mask = pad_sequences([[4, 300, 301, 1, 6], [4, 1, 6]], policy.tokenizer.pad_token_id)
    config = build_generation_config(max_new_tokens=5, temperature=1.0, stop_ids=policy.stop_ids,
                                     pad_id=policy.tokenizer.pad_token_id)
    torch.manual_seed(0)
    response = policy.generate(prompts, prompt_mask, config)
    assert response.shape[0] == 2 and 1 <= response.shape[1] <= 5
    config.temperature = 0.5  # not the temperature its log-probs are taken at
    with pytest.raises(ValueError, match="temperature"):
        policy.generate(prompts, prompt_mask, config)


def test_load_tokenizer_padding_side_and_pad_fallback(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    from homerlhf.errors import UserError
    from homerlhf.models.policy import load_tokenizer

    saved = AutoTokenizer.from_pretrained(tiny_llama_dir)
    saved.padding_side = "right"
    saved.pad_token = None  # many base models ship without one
    saved.save_pretrained(tmp_path / "tok")

    for_generation = load_tokenizer(str(tmp_path / "tok"))
    assert for_generation.padding_side == "left"
    assert for_generation.pad_token_id == for_generation.eos_token_id
    own = load_tokenizer(str(tmp_path / "tok"), padding_side=None)  # TRL's trainers: the tokenizer's own side
    assert own.padding_side == "right" and own.pad_token_id == own.eos_token_id
    with pytest.raises(UserError, match="cannot load a tokenizer from") as err:
        load_tokenizer(str(tmp_path / "missing"))
    assert "\n" not in str(err.value)


def test_softcapped_logprobs_equal_the_model_forward(tmp_path, naive_logprobs):
    """A Gemma-2 base soft-caps its logits (tanh(z / cap) * cap) in forward: the NF4 policy's chunked
    log-probs go through the same, at temperature 1 and 0.7."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    from homerlhf.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = Gemma2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, final_logit_softcapping=0.5,
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                          bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    ids, mask, r_mask, T = _batch(tokenizer.pad_token_id)
    for temperature in (1.0, 0.7):
        policy = PolicyModel.from_config(_cfg(f"rollout.temperature={temperature}"), str(tmp_path))
        with torch.no_grad():
            ours, _ = policy.actor_logprobs(ids, mask, T)
            ref = policy.reference_logprobs(ids, mask, T)
            logits = policy.model(input_ids=ids, attention_mask=mask,
                                  position_ids=position_ids_from_mask(mask)).logits[:, -T - 1 : -1]
            uncapped = policy.lm_head(policy.hidden_states(ids, mask))[:, -T - 1 : -1]
        expected = naive_logprobs(logits / temperature, ids[:, -T:])
        bound = fp32_bound(expected.abs().max())  # the chunked path against full logits (tests/tolerances.py)
        torch.testing.assert_close(ours * r_mask, expected * r_mask, atol=bound, rtol=0)
        torch.testing.assert_close(ref * r_mask, expected * r_mask, atol=bound, rtol=0)  # LoRA B starts at 0
        # The cap really bites at this setting: without it the log-probs are far off.
        assert ((naive_logprobs(uncapped / temperature, ids[:, -T:]) - expected) * r_mask).abs().max() > 1e-2


def test_a_model_whose_logits_are_more_than_the_lm_head_is_refused():
    """The probe refuses a forward that does something to its logits we do not model (here a
    Llama whose forward doubles them), and passes Cohere's logit_scale, which we do model."""
    from transformers import AutoModelForCausalLM, CohereConfig, LlamaConfig, LlamaForCausalLM

    from homerlhf.errors import UserError
    from homerlhf.models.policy import check_logits_path

    class DoubledLogits(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2.0
            return out

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    torch.manual_seed(0)
    with pytest.raises(UserError, match="computes its logits beyond the LM head"):
        check_logits_path(DoubledLogits(LlamaConfig(**shape)).eval(), "doubled")
    check_logits_path(LlamaForCausalLM(LlamaConfig(**shape)).eval(), "llama")
    cohere = AutoModelForCausalLM.from_config(CohereConfig(**shape, logit_scale=0.0625)).eval()
    check_logits_path(cohere, "cohere")
