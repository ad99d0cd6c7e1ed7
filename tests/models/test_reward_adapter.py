"""``reward.backend: adapter``: a LoRA reward model on the policy's own NF4 base (real bitsandbytes)
scores as the stand-alone reward model does and leaves the actor exactly as it was."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from homerlhf.config import load_config
from homerlhf.errors import UserError
from homerlhf.models.reward_adapter import REWARD, RewardAdapter, check_same_base
from tolerances import fp32_bound


@pytest.fixture(scope="module")
def policy(tiny_llama_dir):
    """The NF4 policy (actor + critic) on the reward model's base, its actor moved off the base:
    an actor adapter left on while scoring would change the scores."""
    from homerlhf.models.policy import PolicyModel

    cfg = load_config("cpu-tiny", overrides=[f"model.name_or_path={tiny_llama_dir}"])
    policy = PolicyModel.from_config(cfg, str(tiny_llama_dir))
    torch.manual_seed(0)
    with torch.no_grad():
        for param in policy.actor_parameters():
            param.normal_(std=0.05)
    return policy


def _sequences(tokenizer) -> list[list[int]]:
    from homerlhf.data.replies import reward_sequence_ids

    pairs = [("Tell me about tea.", "Happy to help! Tea is made from leaves."), ("Share a fact.", "Go away."),
             ("Hi", "Hello there, how can I help you today with anything at all?")]
    return [reward_sequence_ids(tokenizer, [{"role": "user", "content": p}], [{"role": "assistant", "content": r}])
            for p, r in pairs]


def _stand_alone_scores(base_dir, adapter_dir, sequences, pad_id) -> torch.Tensor:
    """The reward model on a 4-bit base of its own, as the reward stage loads it (``load_model``,
    qlora) with the 4-bit kernels the policy uses (no CPU bf16 repacking, see
    ``homerlhf.models.policy.keep_cpu_4bit_differentiable``), scored by ``score_sequences``."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from homerlhf.models.policy import keep_cpu_4bit_differentiable
    from homerlhf.models.scores import score_sequences
    from homerlhf.stages.common import load_model

    cfg = load_config("cpu-tiny", overrides=[f"model.name_or_path={base_dir}"])
    model = load_model(AutoModelForSequenceClassification, str(base_dir), cfg, "qlora", num_labels=1)
    keep_cpu_4bit_differentiable(model)
    model = PeftModel.from_pretrained(model, str(adapter_dir))
    return score_sequences(model, sequences, pad_id, batch_size=2)


def test_scores_equal_the_stand_alone_reward_model_and_the_actor_is_untouched(policy, tiny_llama_dir, tiny_lora_rm_dir):
    adapter_dir = check_same_base(tiny_lora_rm_dir, tiny_llama_dir)
    assert adapter_dir == tiny_lora_rm_dir / "adapter"
    sequences = _sequences(policy.tokenizer)
    ids = torch.tensor([sequences[0]])
    mask = torch.ones_like(ids)

    policy.checkpoint_activations(True)  # the update's mode; then the critic active, as after a value forward
    with torch.no_grad(), policy.use_adapter("actor"):
        actor_before = policy.model(input_ids=ids, attention_mask=mask).logits
    policy.model.set_adapter("critic")
    grads = {n: p.requires_grad for n, p in policy.model.named_parameters()}
    modes = {n: m.training for n, m in policy.model.named_modules()}

    scorer = RewardAdapter(policy.model, adapter_dir, policy.tokenizer.pad_token_id, batch_size=2)
    try:
        ours = scorer.scores(sequences)
        assert policy.model.active_adapter == "critic"
        assert {n: p.requires_grad for n, p in policy.model.named_parameters() if n in grads} == grads
        assert {n: m.training for n, m in policy.model.named_modules() if n in modes} == modes
        assert all(not p.requires_grad for n, p in policy.model.named_parameters() if f".{REWARD}." in n)
        with torch.no_grad(), policy.use_adapter("actor"):
            actor_after = policy.model(input_ids=ids, attention_mask=mask).logits
    finally:
        scorer.unload()
    assert torch.equal(actor_before, actor_after)
    assert sorted(policy.model.peft_config) == ["actor", "critic"]

    theirs = _stand_alone_scores(tiny_llama_dir, adapter_dir, sequences, policy.tokenizer.pad_token_id)
    torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=0)
    assert (ours.max() - ours.min()).item() > 1e-2  # three different scores, not one constant
    # The trained LoRA matters: the same head on the bare base scores otherwise.
    with torch.no_grad(), policy.model.disable_adapter():
        from homerlhf.models.scores import pooled_hidden

        bare = scorer.head(pooled_hidden(policy.backbone, ids, mask)).squeeze(-1)
    assert (bare - ours[:1]).abs().item() > 1e-3


def test_an_oom_while_scoring_halves_the_batch_and_gives_the_same_scores(policy, tiny_llama_dir, tiny_lora_rm_dir):
    from homerlhf.ppo.backends import AdapterReward

    scorer = RewardAdapter(policy.model, tiny_lora_rm_dir / "adapter", policy.tokenizer.pad_token_id, batch_size=4)
    reward = AdapterReward(scorer)
    try:
        sequences = _sequences(policy.tokenizer)
        prompts, responses = [s[:3] for s in sequences], [s[3:] for s in sequences]
        expected = reward.score(prompts, responses)
        real, seen = scorer.head.forward, []

        def head(pooled):
            seen.append(pooled.shape[0])
            if len(seen) == 1:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
            return real(pooled)

        scorer.head.forward = head
        future = reward.submit_score(prompts, responses)
        assert future.done()  # scored in the caller's thread: it shares the policy's modules
        # Other batches, other padding (tests/tolerances.py).
        assert future.result() == pytest.approx(expected, abs=fp32_bound(max(map(abs, expected))))
        assert seen == [3, 2, 1] and scorer.batch_size == 2
    finally:
        reward.close()
    assert "reward" not in policy.model.peft_config


def test_another_base_is_refused_in_one_line(tiny_lora_rm_dir, tmp_path):
    from homerlhf.tiny import build_causal_lm

    other = build_causal_lm(tmp_path / "other", arch="llama", seed=7)  # same shape, other weights
    with pytest.raises(UserError) as err:
        check_same_base(tiny_lora_rm_dir, other)
    message = str(err.value)
    assert "\n" not in message and str(other) in message and "weights" in message
    assert "homerlhf reward --model" in message and "reward.backend=llamacpp or hf" in message


def test_an_old_run_without_a_recorded_fingerprint_uses_the_adapters_base_path(tiny_lora_rm_dir, tiny_llama_dir,
                                                                                 tmp_path):
    old = tmp_path / "old-rm"
    shutil.copytree(tiny_lora_rm_dir, old)
    run = json.loads((old / "reward_run.json").read_text())
    assert run["base_fingerprint"]["weights"]  # recorded by homerlhf reward
    del run["base_fingerprint"]
    (old / "reward_run.json").write_text(json.dumps(run))
    assert check_same_base(old, tiny_llama_dir) == old / "adapter"

    config = json.loads((old / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (old / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="cannot tell which base"):
        check_same_base(old, tiny_llama_dir)


def test_a_reward_model_without_an_adapter_is_refused(tiny_llama_dir, tmp_path):
    (tmp_path / "model").mkdir()  # a full fine-tune's run dir: model/ only
    with pytest.raises(UserError, match="has no LoRA adapter .* rm.method=qlora or lora"):
        check_same_base(tmp_path, tiny_llama_dir)
