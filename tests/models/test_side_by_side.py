"""Side-by-side answers: the actor adapter on vs off, the same seed, reward scores from the run's RM."""

from __future__ import annotations

import pytest
import torch

from homerlhf.models.side_by_side import EvalModels, Sampling


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as the trainer leaves it: resolved config and one checkpoint whose actor
    adapter is perturbed (a fresh LoRA has B = 0 and would equal the reference exactly)."""
    from homerlhf.config import load_config, to_yaml
    from homerlhf.models.policy import PolicyModel
    from homerlhf.models.registry import resolve_model
    from homerlhf.tiny import build_sequence_classifier

    root = tmp_path_factory.mktemp("eval-run")
    rm_dir = build_sequence_classifier(root / "rm", arch="llama", seed=3)
    cfg = load_config("cpu-tiny", None, [
        "model.name_or_path=builtin:tiny-llama", "ref.backend=adapter_off",
        "reward.backend=hf", f"reward.model={rm_dir}",
    ])
    (root / "config.yaml").write_text(to_yaml(cfg))
    policy = PolicyModel.from_config(cfg, resolve_model(cfg.model.name_or_path))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name and ".actor." in name:
                param.normal_(std=0.5)
    policy.save(root / "checkpoints" / "iter_000001")
    return root


@pytest.mark.slow  # ~15 s idle, ~35 s on a busy 2-core machine
def test_actor_and_reference_answer_with_scores(run_dir):
    from homerlhf.errors import UserError
    from homerlhf.ppo.backends import HFReward

    from homerlhf.config import from_yaml_file
    from homerlhf.stages.scorers import scoring_reward

    cfg = from_yaml_file(run_dir / "config.yaml")
    models = EvalModels(cfg, run_dir / "checkpoints" / "iter_000001", reward=scoring_reward)
    sampling = Sampling(max_new_tokens=6, temperature=1.0, seed=7)
    actor, ref = models.answer_both("Tell me about tea.", sampling)
    assert actor.prompt_ids == ref.prompt_ids
    assert 0 < len(actor.response_ids) <= 6 and 0 < len(ref.response_ids) <= 6
    assert actor.response_ids != ref.response_ids  # the perturbed adapter changes the answer

    # The same seed reproduces both answers exactly.
    again = models.answer_both("Tell me about tea.", sampling)
    assert (again[0].response_ids, again[1].response_ids) == (actor.response_ids, ref.response_ids)

    # Scores are the run's reward model on exactly these ids.
    rm = HFReward(str(run_dir / "rm"))
    expected = rm.score([actor.prompt_ids, ref.prompt_ids], [actor.response_ids, ref.response_ids])
    assert [actor.score, ref.score] == pytest.approx(expected, abs=1e-5)

    # The reference is the base with the adapter off: a plain base model samples the same ids.
    from homerlhf.models.policy import load_base
    from homerlhf.models.registry import resolve_model

    base = load_base(resolve_model("builtin:tiny-llama"), models.cfg)
    torch.manual_seed(7)
    ids = torch.tensor([ref.prompt_ids])
    out = base.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=True,
                        temperature=1.0, top_p=1.0, top_k=0, pad_token_id=models.tokenizer.pad_token_id,
                        eos_token_id=models.tokenizer.eos_token_id)
    assert out[0, ids.shape[1]:].tolist()[: len(ref.response_ids)] == ref.response_ids

    with pytest.raises(UserError, match="type a message"):
        models.answer_both("  ", sampling)


def test_the_right_side_can_be_another_checkpoint_of_the_same_base(run_dir, tmp_path):
    """``right``: a second checkpoint's actor answers on the right, in the same model: exactly (same seed, same
    ids) what that checkpoint answers as the actor on its own; the left stays the first checkpoint's actor."""
    import shutil

    from homerlhf.config import from_yaml_file
    from homerlhf.errors import UserError

    cfg = from_yaml_file(run_dir / "config.yaml")
    first = run_dir / "checkpoints" / "iter_000001"
    second = tmp_path / "checkpoints" / "iter_000002"
    shutil.copytree(first, second)
    from safetensors.torch import load_file, save_file

    weights = second / "actor" / "adapter_model.safetensors"
    tensors = {name: (-t if "lora_B" in name else t) for name, t in load_file(weights).items()}  # another policy
    save_file(tensors, weights)
    sampling = Sampling(max_new_tokens=6, temperature=1.0, seed=5)
    both = EvalModels(cfg, first, right=second)
    left, right = both.answer_both("Tell me about tea.", sampling)
    alone_first = EvalModels(cfg, first).answer_both("Tell me about tea.", sampling)[0]
    alone_second = EvalModels(cfg, second).answer_both("Tell me about tea.", sampling)[0]
    assert left.response_ids == alone_first.response_ids
    assert right.response_ids == alone_second.response_ids != left.response_ids
    # The actor is switched back after the right side answered: a draft is the first checkpoint's again.
    assert both.answer_actor("Tell me about tea.", sampling).response_ids == left.response_ids
    with pytest.raises(UserError, match="has no 'actor' adapter"):
        EvalModels(cfg, first, right=tmp_path)


def test_without_a_reward_model_answers_are_unscored(run_dir):
    from homerlhf.config import from_yaml_file

    models = EvalModels(from_yaml_file(run_dir / "config.yaml"), run_dir / "checkpoints" / "iter_000001")
    actor, ref = models.answer_both("Tell me about tea.", Sampling(max_new_tokens=3, seed=1))
    assert models.reward is None and actor.score is None and ref.score is None
    assert 0 < len(actor.response_ids) <= 3
    models.close()


@pytest.mark.slow  # an NF4 Gemma-3-vocabulary policy (262k tokens) loaded twice, ~40 s on 2 cores
def test_answers_end_at_the_stop_set_and_are_scored_on_the_reward_models_sequence(real_tokenizer_dirs, tmp_path):
    """A base-style Gemma-3 tokenizer (EOS ``<eos>``, turns end ``<end_of_turn>``): both answers end
    at ``<end_of_turn>`` with nothing after it, and each is scored on exactly the sequence the reward
    model is trained on (``reward_sequence_ids``), read at its last token."""
    from transformers import AutoTokenizer

    from homerlhf.config import load_config
    from homerlhf.data.replies import reward_sequence_ids
    from homerlhf.models.policy import PolicyModel
    from homerlhf.models.scores import score_sequences
    from homerlhf.ppo.backends import HFReward
    from homerlhf.tiny import build_causal_lm, build_sequence_classifier

    tokenizer_dir = tmp_path / "tokenizer"
    tok = AutoTokenizer.from_pretrained(str(real_tokenizer_dirs["gemma3"]))
    tok.eos_token = "<eos>"  # as a base checkpoint ships it: EOS is not the turn's end
    tok.save_pretrained(tokenizer_dir)
    shape = dict(hidden=64, layers=2)
    model_dir = build_causal_lm(tmp_path / "lm", arch="gemma3_text", seed=0, tokenizer_dir=tokenizer_dir,
                                tie_embeddings=True, **shape)
    (model_dir / "generation_config.json").unlink()  # no eos list to help: the template's token must stop
    rm_dir = build_sequence_classifier(tmp_path / "rm", arch="gemma3_text", seed=2, tokenizer_dir=tokenizer_dir, **shape)
    cfg = load_config("cpu-tiny", None, [f"model.name_or_path={model_dir}", "ref.backend=adapter_off",
                                         "reward.backend=hf", f"reward.model={rm_dir}"])
    PolicyModel.from_config(cfg, str(model_dir)).save(tmp_path / "ckpt")
    models = EvalModels(cfg, tmp_path / "ckpt", reward=lambda cfg, tokenizer: HFReward(str(rm_dir)))
    assert models.stop_ids == sorted(tok.convert_tokens_to_ids(["<eos>", "<end_of_turn>"]))

    prompt = [{"role": "user", "content": "Tell me about tea."}]
    sequence = reward_sequence_ids(models.tokenizer, prompt, [{"role": "assistant", "content": "Green tea."}])
    n_prompt = len(models.prompt_ids("Tell me about tea."))
    forced = sequence[n_prompt:] + models.tokenizer("\n", add_special_tokens=False)["input_ids"] * 3
    step = {"n": 0}

    def restart(module, args):
        if args[0].shape[1] > 1:  # the prompt's forward: a new answer starts
            step["n"] = 0

    def force(module, args, output):
        output = output.clone()
        if step["n"] < len(forced):
            output[:, -1, :] = -1e4
            output[:, -1, forced[step["n"]]] = 1e4
        step["n"] += 1
        return output

    handles = [models.model.get_input_embeddings().register_forward_pre_hook(restart),
               models.model.get_output_embeddings().register_forward_hook(force)]
    try:
        actor, ref = models.answer_both("Tell me about tea.", Sampling(max_new_tokens=len(forced), seed=3))
    finally:
        for handle in handles:
            handle.remove()
    for answer in (actor, ref):
        assert answer.prompt_ids + answer.response_ids == sequence
        assert answer.text == "Green tea."
    rm = HFReward(str(rm_dir))
    want = score_sequences(rm.model, [sequence], pad_id=rm.pad_id).item()
    assert actor.score == pytest.approx(want, abs=1e-5) and ref.score == pytest.approx(want, abs=1e-5)
    models.close()


@pytest.mark.slow  # ~15 s idle
def test_answer_many_matches_one_at_a_time_per_seed(run_dir):
    """A batched answer depends on its own message and seed only: the same as that message alone
    in a batch of one, whatever else is in the batch; both sides are scored by the run's RM."""
    from homerlhf.config import from_yaml_file
    from homerlhf.ppo.backends import HFReward
    from homerlhf.stages.scorers import scoring_reward

    cfg = from_yaml_file(run_dir / "config.yaml")
    models = EvalModels(cfg, run_dir / "checkpoints" / "iter_000001", reward=scoring_reward)
    sampling = Sampling(max_new_tokens=8, seed=0)
    texts = ["Tell me about tea.", "Hi", "Can you explain the moon to me?"]
    many = models.answer_many(texts, sampling, seeds=[11, 12, 13])
    alone = models.answer_many([texts[2]], sampling, seeds=[13])[0]
    assert [a.response_ids for a in many[2]] == [a.response_ids for a in alone]
    assert any(actor.response_ids != ref.response_ids for actor, ref in many)  # the adapter matters
    assert all(0 < len(a.response_ids) <= 8 for pair in many for a in pair)

    rm = HFReward(str(run_dir / "rm"))
    flat = [a for pair in many for a in pair]
    expected = rm.score([a.prompt_ids for a in flat], [a.response_ids for a in flat])
    assert [a.score for a in flat] == pytest.approx(expected, abs=1e-4)
    with pytest.raises(ValueError, match="seeds"):
        models.answer_many(texts, sampling, seeds=[1])
    models.close()


def test_an_answer_cut_inside_a_character_leaves_the_partial_character_out(tiny_llama_dir):
    """The tiny tokenizer is byte-level: '☕' is three byte tokens. Cut after two of them by the token
    cap, the answer ends before it, not in U+FFFD; a stopped answer and bytes that form no character
    elsewhere are shown as they decode."""
    from transformers import AutoTokenizer

    from homerlhf.models.side_by_side import answer_text

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tok.encode(" tea ☕", add_special_tokens=False)
    assert tok.decode(ids) == " tea ☕" and tok.decode(ids[:-1]).endswith("\ufffd")
    assert answer_text(tok, ids[:-1], stop_ids={tok.eos_token_id}) == "tea"
    assert answer_text(tok, ids, stop_ids={tok.eos_token_id}) == "tea ☕"
    stray = tok.encode("é", add_special_tokens=False)[-1:]  # a lone continuation byte, then text
    assert answer_text(tok, stray + tok.encode(" tea", add_special_tokens=False), set()) == "\ufffd tea"
