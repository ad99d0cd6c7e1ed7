"""The critic on a base of its own (``critic.model``): its tokenizer checked before any weight loads, a
reward model's score head as the value head's start, and what it trains."""

from __future__ import annotations

import pytest
import torch

from homerlhf.config import load_config
from homerlhf.errors import UserError
from homerlhf.models.policy import CRITIC, PolicyModel
from tolerances import fp32_bound

IDS = torch.tensor([[4, 300, 301, 302, 20, 1, 6, 120, 121], [4, 310, 1, 6, 130, 131, 132, 133, 134]])


def _cfg(*extra):
    return load_config("cpu-tiny", overrides=["ref.backend=adapter_off", "reward.backend=hf", *extra])


@pytest.fixture(scope="module")
def other_tokenizer_model(tmp_path_factory):
    """A tiny causal LM on another tokenizer: a byte-level BPE of 384 tokens, not the builtin 512."""
    from homerlhf.tiny import build_causal_lm, build_tokenizer

    root = tmp_path_factory.mktemp("other-tokenizer")
    build_tokenizer(vocab_size=384).save_pretrained(root / "tokenizer")
    return build_causal_lm(root / "model", tokenizer_dir=root / "tokenizer", hidden=32, layers=1)


def test_a_critic_of_another_tokenizer_is_refused_before_any_weight_loads(tiny_llama_dir, other_tokenizer_model,
                                                                          monkeypatch):
    import transformers

    def loaded(*args, **kwargs):
        raise AssertionError(f"weights were loaded from {args[0] if args else kwargs}")

    for auto in (transformers.AutoModel, transformers.AutoModelForCausalLM,
                 transformers.AutoModelForSequenceClassification):
        monkeypatch.setattr(auto, "from_pretrained", loaded)
    with pytest.raises(UserError) as err:
        PolicyModel.from_config(_cfg(f"critic.model={other_tokenizer_model}"), str(tiny_llama_dir))
    msg = str(err.value)
    assert f"critic.model {other_tokenizer_model} does not share the tokenizer of the policy {tiny_llama_dir}" in msg
    assert "their vocabularies differ (512 vs 384 tokens" in msg and "\n" not in msg


def test_special_tokens_and_the_chat_template_count_not_only_the_vocabulary(tiny_llama_dir):
    from homerlhf.models.critic_model import tokenizer_difference
    from homerlhf.models.policy import load_tokenizer

    policy, same = load_tokenizer(str(tiny_llama_dir)), load_tokenizer(str(tiny_llama_dir))
    assert tokenizer_difference(policy, same) is None
    same.chat_template = policy.chat_template.replace("<|end|>", "\n")
    assert tokenizer_difference(policy, same) == "their chat templates differ"
    other_eos = load_tokenizer(str(tiny_llama_dir))
    other_eos.eos_token = "<|user|>"  # in the vocabulary, id 4; the policy's eos <|end|> is id 1
    assert tokenizer_difference(policy, other_eos) == "their special tokens differ (eos: 1 vs 4)"


def test_a_reward_run_is_a_critic_whose_first_values_are_its_scores(tiny_llama_dir, tmp_path):
    """Its score head initialises the value head, so before any step the critic's value of each prefix is
    the score HF's own sequence classifier gives that prefix (the same 4-bit weights, LoRA B zero)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    from homerlhf.models.policy import keep_cpu_4bit_differentiable, quantization_config
    from homerlhf.tiny import build_sequence_classifier

    run = tmp_path / "rm-run"  # a reward run dir: the classifier in model/, as `homerlhf reward` writes it
    build_sequence_classifier(run / "model", seed=3, hidden=64, layers=2)
    cfg = _cfg(f"critic.model={run}")
    policy = PolicyModel.from_config(cfg, str(tiny_llama_dir))
    score = load_file(str(run / "model" / "model.safetensors"))["score.weight"]
    assert torch.equal(policy.value_head.linear.weight, score) and policy.value_head.linear.bias.item() == 0.0
    reference = AutoModelForSequenceClassification.from_pretrained(
        run / "model", quantization_config=quantization_config(cfg.quant, "cpu"), device_map="cpu", dtype=torch.float32)
    keep_cpu_4bit_differentiable(reference)  # the same 4-bit kernel as the policy's (no AVX512-BF16 repacking)
    with torch.no_grad():
        values = policy.critic_values(IDS, torch.ones_like(IDS), 3)  # V(prompt + response[:t]), t = 0, 1, 2
        # The classifier's pooled score of each of those prefixes (6, 7 and 8 tokens: their last position).
        scores = torch.stack([reference(input_ids=IDS[:, :6 + t]).logits.squeeze(-1) for t in range(3)], 1)
    assert scores.abs().min() > 1e-3  # not zeros
    torch.testing.assert_close(values, scores, atol=fp32_bound(scores.abs().max()), rtol=0)  # other shapes


def test_a_smaller_critic_trains_its_own_lora_and_head_and_nothing_of_the_actor(tiny_llama_dir, small_critic_dir):
    cfg = _cfg(f"critic.model={small_critic_dir}", "critic.value_head_init_std=0.1")  # a head that passes gradient
    policy = PolicyModel.from_config(cfg, str(tiny_llama_dir))
    assert CRITIC not in policy.model.peft_config and policy.adapter_parameters(CRITIC) == []
    params = policy.critic_parameters()
    # LoRA r 8 on q, k, v, o, gate, up, down of 2 layers of width 64 (kv 32, MLP 192): 8 x 1216 x 2; head 64 + 1
    assert sum(p.numel() for p in params) == 8 * 1216 * 2 + 65
    assert policy.value_head.linear.in_features == 64 and {p.dtype for p in params} == {torch.float32}
    policy.checkpoint_activations(True)
    policy.critic_values(IDS, torch.ones_like(IDS), 3).sum().backward()
    lora_b = [p for p in params if p.ndim == 2 and p.shape[1] == 8]
    assert lora_b and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_b)
    assert all(p.grad is None for p in policy.actor_parameters())


def test_a_critic_of_its_own_checkpoints_and_offloads_as_the_run_says(tiny_llama_dir, small_critic_dir, monkeypatch):
    """``training.checkpoint_every_n_layers`` and ``activation_offload`` act on the critic's own base as on
    the policy's (it checkpointed every layer, nothing offloaded, whatever they said): every 2nd of its 2
    layers is layer 0 alone, its input offloaded; one critic forward moves m x t x h x 4 bytes through the
    offload's pack hook, what the planner's offloaded_bytes says for the critic's shape."""
    from homerlhf.memory.recompute import offloaded_bytes
    from homerlhf.memory.shapes import critic_shape
    from homerlhf.models import activations
    from homerlhf.models.activations import checkpointing_report

    packed: list[int] = []

    class Counting(torch.autograd.graph.save_on_cpu):
        def __init__(self, pin_memory: bool = False, device_type: str = "cuda"):
            super().__init__(pin_memory=False, device_type=device_type)
            pack = self.pack_hook
            self.pack_hook = lambda tensor: (packed.append(tensor.nbytes), pack(tensor))[1]

    monkeypatch.setattr(activations, "save_on_cpu", Counting)
    cfg = _cfg(f"critic.model={small_critic_dir}", "critic.value_head_init_std=0.1", "training.gradient_checkpointing=true",
               "training.checkpoint_every_n_layers=2", "training.activation_offload=true", "rollout.max_prompt_len=6",
               "rollout.max_new_tokens=3", "ppo.micro_batch_size=2")
    policy = PolicyModel.from_config(cfg, str(tiny_llama_dir))
    report = checkpointing_report(policy.critic_model.backbone)
    assert report == {"layers": 2, "recomputed": [0], "offloaded": [0], "path": "save_on_cpu"}
    assert checkpointing_report(policy.model.get_base_model())["recomputed"] == [0, 2]  # the policy's 4 layers
    policy.checkpoint_activations(True)
    policy.critic_values(IDS, torch.ones_like(IDS), 3).sum().backward()  # 2 x (6 + 3) tokens, the critic alone
    assert sum(packed) == offloaded_bytes(cfg, critic_shape(cfg)) == 1 * 2 * 9 * 64 * 4
    assert all(p.grad is not None for p in policy.critic_parameters())


def test_an_actor_id_past_a_smaller_critics_embedding_reads_as_a_filler(tmp_path):
    """An actor whose head has 640 rows (the 512 tokens, padded as Qwen pads) and a critic of 576 rows, on
    the same tokenizer: the actor can sample id 600, which names no token. The critic reads it as its last
    row (575, a filler past the tokenizer's 512 tokens, as 600 is the actor's) instead of indexing past its
    embedding (IndexError on a CPU, a device-side assert on a GPU)."""
    from homerlhf.models.policy import load_tokenizer
    from homerlhf.tiny import build_causal_lm

    actor = build_causal_lm(tmp_path / "actor", seed=1, rows=640, hidden=64, layers=2)
    critic = build_causal_lm(tmp_path / "critic", seed=5, rows=576, hidden=32, layers=1)
    policy = PolicyModel.from_config(_cfg(f"critic.model={critic}", "critic.value_head_init_std=0.1"), str(actor))
    ids, mask = IDS.clone(), torch.ones_like(IDS)
    ids[0, -1], ids[1, -2] = 600, 639  # sampled ids of the actor's padding rows
    filled = ids.clone()
    filled[0, -1] = filled[1, -2] = 575
    with torch.no_grad():
        values = policy.critic_values(ids, mask, 3)
        assert torch.equal(values, policy.critic_values(filled, mask, 3)) and torch.isfinite(values).all()
    from homerlhf.models.critic_model import filler_id

    assert policy.vocab_size == 640 and policy.critic_model.rows == 576 and policy.critic_model.filler == 575
    tokenizer = load_tokenizer(str(actor))
    # A critic of exactly the tokenizer's rows has no filler row: the pad token stands in. No more rows in
    # the actor's head than in the critic's embedding: nothing to replace.
    assert filler_id(512, 640, tokenizer) == tokenizer.pad_token_id and filler_id(640, 640, tokenizer) is None
