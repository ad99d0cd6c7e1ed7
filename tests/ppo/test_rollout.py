"""Rollout: left-padded prompts, response masks up to the first stop token, truncation flag and
penalty; on real tokenizers: the stop set ends turns, checkpoint sampling defaults change nothing, and
the scored log-probs are those of the distribution generate sampled from."""

from __future__ import annotations

import pytest
import torch

from homerlhf.config import load_config
from homerlhf.errors import UserError
from homerlhf.ppo.rollout import (
    RolloutBatch,
    apply_truncation_penalty,
    generate_rollout,
    pad_sequences,
    response_mask_and_truncated,
)
from tolerances import fp32_bound

EOS = 1


def test_pad_sequences_left_by_default():
    ids, mask = pad_sequences([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_rollout_batches_concatenate_padded_left_and_right():
    a = RolloutBatch(torch.tensor([[3, 4]]), torch.tensor([[1, 1]]), torch.tensor([[5]]), torch.tensor([[1]]),
                     torch.tensor([True]), torch.tensor([[-0.5]]))
    b = RolloutBatch(torch.tensor([[6]]), torch.tensor([[1]]), torch.tensor([[7, 1, 0]]), torch.tensor([[1, 1, 0]]),
                     torch.tensor([False]), torch.tensor([[-1.0, -2.0, 0.0]]))
    both = RolloutBatch.cat([a, b], pad_id=0)
    assert both.prompt_ids.tolist() == [[3, 4], [0, 6]] and both.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert both.response_ids.tolist() == [[5, 0, 0], [7, 1, 0]]
    assert both.response_mask.tolist() == [[1, 0, 0], [1, 1, 0]]
    assert both.truncated.tolist() == [True, False]
    assert both.behaviour_logprobs.tolist() == [[-0.5, 0.0, 0.0], [-1.0, -2.0, 0.0]]
    assert both.rows(1, 2).behaviour_logprobs.tolist() == [[-1.0, -2.0, 0.0]]
    a.behaviour_logprobs = None
    assert RolloutBatch.cat([a, b], pad_id=0).behaviour_logprobs is None


def test_pad_sequences_right_and_empty_rows():
    ids, mask = pad_sequences([[8], [], [5, 6, 7]], pad_id=2, side="right")
    assert ids.tolist() == [[8, 2, 2], [2, 2, 2], [5, 6, 7]]
    assert mask.tolist() == [[1, 0, 0], [0, 0, 0], [1, 1, 1]]
    assert ids.dtype == mask.dtype == torch.long


def test_mask_runs_up_to_and_including_the_first_eos():
    response = torch.tensor([
        [9, 9, EOS, 0, 0],  # EOS at 2
        [EOS, 0, 0, 0, 0],  # EOS first
        [9, 9, 9, 9, 9],  # no EOS: truncated
        [9, EOS, 9, EOS, 0],  # only the first EOS counts
    ])
    mask, truncated = response_mask_and_truncated(response, {EOS})
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert truncated.tolist() == [False, False, True, False]


def test_mask_ends_at_the_first_token_of_the_stop_set():
    """Gemma-3's set {1 <eos>, 106 <end_of_turn>}: whichever comes first ends the turn; 107 ("\n") does not."""
    response = torch.tensor([
        [9, 106, 107, 1],  # <end_of_turn> at 1
        [9, 9, 1, 106],  # <eos> at 2, before <end_of_turn>
        [107, 107, 9, 9],  # neither: truncated
    ])
    mask, truncated = response_mask_and_truncated(response, [1, 106])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert truncated.tolist() == [False, False, True]


def test_truncation_penalty_replaces_only_truncated_scores():
    batch = RolloutBatch(torch.zeros(3, 1), torch.ones(3, 1), torch.zeros(3, 2), torch.ones(3, 2),
                         torch.tensor([False, True, False]))
    scores = torch.tensor([0.5, 0.7, -0.2])
    cfg = load_config("cpu-tiny", overrides=["rollout.truncation_penalty=-1.5"])
    assert apply_truncation_penalty(scores, batch, cfg.rollout).tolist() == pytest.approx([0.5, -1.5, -0.2])
    off = load_config("cpu-tiny", overrides=["rollout.truncation_penalty=null"])  # the preset sets -5
    assert apply_truncation_penalty(scores, batch, off.rollout).tolist() == pytest.approx([0.5, 0.7, -0.2])


@pytest.fixture(scope="module")
def policy(tiny_llama_dir):
    from homerlhf.models.policy import PolicyModel

    cfg = load_config("cpu-tiny", overrides=["ref.backend=adapter_off", "reward.backend=hf"])
    return PolicyModel.from_config(cfg, str(tiny_llama_dir))


def test_generate_rollout_layout(policy):
    cfg = load_config("cpu-tiny", overrides=[
        "ref.backend=adapter_off", "reward.backend=hf", "rollout.max_new_tokens=6", "rollout.max_prompt_len=4"])
    prompts = [[302, 20, 1, 6], [4, 6]]
    torch.manual_seed(0)
    batch = generate_rollout(policy, prompts, cfg.rollout)
    pad = policy.tokenizer.pad_token_id
    # Prompts kept whole and left-padded.
    assert batch.prompt_lists() == prompts
    assert batch.prompt_ids[1, :2].tolist() == [pad, pad]
    assert batch.response_ids.shape[1] <= 6
    for row in range(2):
        n = int(batch.response_mask[row].sum())
        tokens = batch.response_ids[row].tolist()
        assert batch.response_mask[row].tolist() == [1] * n + [0] * (len(tokens) - n)
        assert all(t == pad for t in tokens[n:])
        assert bool(batch.truncated[row]) == (EOS not in tokens[:n])
        if not batch.truncated[row]:
            assert tokens[n - 1] == EOS
        else:
            assert n == 6


def test_generate_rollout_stops_at_eos(policy):
    """Row 0's EOS logit is forced up by a hook on the LM head: it stops at once, row 1 runs on."""
    cfg = load_config("cpu-tiny", overrides=["ref.backend=adapter_off", "reward.backend=hf", "rollout.max_new_tokens=5"])

    def force_eos_row0(module, args, output):
        output = output.clone()
        output[0, :, EOS] += 1e4
        output[1, :, EOS] -= 1e4
        return output

    handle = policy.lm_head.register_forward_hook(force_eos_row0)
    try:
        batch = generate_rollout(policy, [[4, 300, 6], [4, 6]], cfg.rollout)
    finally:
        handle.remove()
    pad = policy.tokenizer.pad_token_id
    assert batch.response_ids[0].tolist() == [EOS] + [pad] * 4
    assert batch.response_mask.tolist() == [[1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert batch.truncated.tolist() == [False, True]
    assert batch.response_lists()[0] == [EOS]


# -- real tokenizers: tiny random models with the vocabularies and chat templates of Qwen3, Llama-3
# and Gemma-3, loaded in NF4 by the policy's own code (tests/fixtures/README.md) ----------------------
REAL = ["qwen3", "llama3_1", "gemma3"]
# The stop sets the templates and checkpoints imply (tests/models/test_generation.py derives them).
STOPS = {"qwen3": [151643, 151645], "llama3_1": [128001, 128008, 128009], "gemma3": [1, 106]}


def _real_cfg(*extra):
    return load_config("cpu-tiny", overrides=["ref.backend=adapter_off", "reward.backend=hf", *extra])


@pytest.fixture(scope="module")
def real_policies(real_vocab_model_dir):
    """name -> the NF4 policy on that real tokenizer, loaded once (its checkpoint's generation config
    carries the published sampling defaults: temperature 0.6, top_p, top_k)."""
    from homerlhf.models.policy import PolicyModel

    loaded = {}

    def get(name: str):
        if name not in loaded:
            torch.manual_seed(0)
            loaded[name] = PolicyModel.from_config(_real_cfg(), str(real_vocab_model_dir(name)))
        return loaded[name]

    return get


def _chat_prompts(tokenizer) -> list[list[int]]:
    texts = ["Tell me about green tea, please.", "Hi"]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                               return_dict=True)["input_ids"]) for t in texts]


@pytest.mark.parametrize("name", REAL)
def test_rollout_stops_at_each_token_of_the_stop_set(name, real_policies):
    """Row i is forced to emit stop token i at step i + 1, the last row never sees a stop: each row
    ends exactly there (mask included, pad after), the last one is truncated."""
    policy = real_policies(name)
    stops = STOPS[name]
    assert policy.stop_ids == stops
    cfg = _real_cfg("rollout.max_new_tokens=5")
    step = {"n": 0}

    def force(module, args, output):
        output = output.clone()
        output[:, :, stops] -= 1e4
        for row, stop in enumerate(stops):
            if step["n"] == row + 1:
                output[row, :, stop] += 2e4
        step["n"] += 1
        return output

    prompts = [_chat_prompts(policy.tokenizer)[0]] * (len(stops) + 1)
    handle = policy.lm_head.register_forward_hook(force)
    try:
        batch = generate_rollout(policy, prompts, cfg.rollout)
    finally:
        handle.remove()
    pad = policy.tokenizer.pad_token_id
    for row, stop in enumerate(stops):
        assert batch.response_lists()[row][row + 1] == stop and len(batch.response_lists()[row]) == row + 2
        assert batch.response_mask[row].tolist() == [1] * (row + 2) + [0] * (5 - row - 2)
        assert batch.response_ids[row, row + 2:].tolist() == [pad] * (5 - row - 2)
    assert batch.truncated.tolist() == [False] * len(stops) + [True]
    assert len(batch.response_lists()[-1]) == 5


def _with_generation_config(model_dir, out_dir, fields: dict):
    """The same weights and tokenizer (symlinked), with ``fields`` as generation_config.json."""
    import json

    out_dir.mkdir()
    for item in model_dir.iterdir():
        if item.name != "generation_config.json":
            (out_dir / item.name).symlink_to(item)
    (out_dir / "generation_config.json").write_text(json.dumps(fields))
    return out_dir


@pytest.mark.parametrize("name", REAL)
def test_checkpoint_sampling_defaults_change_nothing(name, real_policies, real_vocab_model_dir, tmp_path):
    """Same seed, same ids: with the published sampling defaults, with a probe that sets every kind of
    processor, and with none at all. Plain HF generate on the probe samples something else."""
    import json

    from homerlhf.models.policy import PolicyModel

    model_dir = real_vocab_model_dir(name)
    shipped = json.loads((model_dir / "generation_config.json").read_text())
    ids_only = {k: v for k, v in shipped.items() if k.endswith("token_id")}
    # Fields generate reads from the checkpoint: those we set to "off" ourselves, and those whose
    # only "off" is None (min_p, suppress_tokens, min_new_tokens), which must not be filled in either.
    probe = {**shipped, "repetition_penalty": 1.5, "no_repeat_ngram_size": 1, "top_k": 3, "temperature": 0.3,
             "min_p": 0.9, "suppress_tokens": list(range(100, 200)), "min_new_tokens": 4}
    shipped_policy = real_policies(name)
    # The same tokenizer files: reuse the loaded one (a 262k vocabulary takes seconds to load).
    policies = [shipped_policy] + [
        PolicyModel.from_config(_real_cfg(), str(_with_generation_config(model_dir, tmp_path / tag, fields)),
                                tokenizer=shipped_policy.tokenizer)
        for tag, fields in (("probe", probe), ("plain", ids_only))]
    cfg = _real_cfg("rollout.max_new_tokens=6")
    prompts = _chat_prompts(policies[0].tokenizer)
    rollouts = []
    for policy in policies:
        torch.manual_seed(123)
        rollouts.append(generate_rollout(policy, prompts, cfg.rollout).response_ids.tolist())
    assert rollouts[1] == rollouts[0] and rollouts[2] == rollouts[0]
    assert policies[1].model.get_base_model().generation_config.top_k == 3  # the checkpoint's, back in place

    def hf_default_sample(policy):
        p_ids, p_mask = pad_sequences(prompts, policy.tokenizer.pad_token_id)
        torch.manual_seed(123)
        with torch.no_grad():
            return policy.model.generate(input_ids=p_ids, attention_mask=p_mask, max_new_tokens=6).tolist()

    assert hf_default_sample(policies[1]) != hf_default_sample(policies[2])


@pytest.mark.parametrize("name", REAL)
def test_scored_logprobs_are_those_generate_sampled_from(name, real_policies):
    """HF generate's raw logits of every sampled token, / temperature and log-softmaxed, equal the old
    log-probs the trainer scores and the adapter-off reference's (LoRA B starts at zero), at
    temperature 1.0 and 0.7."""
    from homerlhf.models.generation import build_generation_config, checkpoint_defaults_off
    from homerlhf.models.policy import PolicyModel
    from homerlhf.ppo.backends import AdapterOffReference
    from homerlhf.ppo.collect import score_with_policy

    loaded = real_policies(name)
    pad = loaded.tokenizer.pad_token_id
    p_ids, p_mask = pad_sequences(_chat_prompts(loaded.tokenizer), pad)
    scored = {}
    for temperature in (1.0, 0.7):
        policy = PolicyModel(loaded.model, loaded.value_head, loaded.tokenizer, shared_adapter=False,
                             logprob_chunk_size=3, temperature=temperature)
        config = build_generation_config(max_new_tokens=6, temperature=temperature, stop_ids=policy.stop_ids,
                                         pad_id=pad)
        config.output_logits, config.output_scores, config.return_dict_in_generate = True, True, True
        torch.manual_seed(7)
        with torch.no_grad(), checkpoint_defaults_off(policy.model.get_base_model(), config):
            out = policy.model.generate(input_ids=p_ids, attention_mask=p_mask, generation_config=config)
        response = out.sequences[:, p_ids.shape[1]:]
        raw = torch.stack(out.logits, dim=1).float()  # (B, T, V), before any logits processor
        # What was sampled from is raw / temperature and nothing else, whatever the checkpoint ships.
        torch.testing.assert_close(torch.stack(out.scores, dim=1).float(), raw / temperature, atol=1e-6, rtol=0)
        expected = torch.log_softmax(raw / temperature, -1).gather(-1, response.unsqueeze(-1)).squeeze(-1)
        mask, truncated = response_mask_and_truncated(response, policy.stop_ids)
        batch = RolloutBatch(p_ids, p_mask, torch.where(mask.bool(), response, pad), mask, truncated)
        old, _, _ = score_with_policy(policy, batch)
        bound = fp32_bound((expected * mask).abs().max())  # scoring against generate's logits (tests/tolerances.py)
        torch.testing.assert_close(old * mask, expected * mask, atol=bound, rtol=0)
        ref = AdapterOffReference(policy).logprobs(batch.prompt_lists(), batch.response_lists())
        for row, lp in enumerate(ref):
            torch.testing.assert_close(torch.tensor(lp), expected[row, : len(lp)], atol=bound, rtol=0)
        scored[temperature] = (old, mask)
    # The temperature is not a rounding detail at this tolerance: scoring the 0.7 samples at 1.0 is far off.
    old, mask = scored[0.7]
    at_one = PolicyModel(loaded.model, loaded.value_head, loaded.tokenizer, shared_adapter=False,
                         logprob_chunk_size=3)
    assert ((score_with_policy(at_one, batch)[0] - old) * mask).abs().max() > 1e-2


def test_generate_rollout_refuses_a_prompt_longer_than_max_prompt_len(policy):
    # Ids are never cut in the rollout (that drops BOS and the system turn); tokenize_prompts fits them.
    cfg = load_config("cpu-tiny", overrides=["ref.backend=adapter_off", "reward.backend=hf", "rollout.max_prompt_len=4"])
    with pytest.raises(UserError, match=r"prompt 1 has 5 tokens, more than rollout.max_prompt_len=4"):
        generate_rollout(policy, [[4, 6], [4, 300, 301, 1, 6]], cfg.rollout)


@pytest.mark.parametrize("name", REAL)
def test_rollout_of_a_reply_is_the_reward_models_sequence(name, real_policies):
    """The actor, forced to write a reply and then the template's text after the turn (Qwen/Gemma:
    end-of-turn then "\\n"), yields prompt ids + response ids up to the stop token that are exactly
    ``reward_sequence_ids``: what the reward model is trained and evaluated on."""
    from homerlhf.data.replies import reward_sequence_ids
    from homerlhf.data.tokens import tokenize_prompts

    policy = real_policies(name)
    tok = policy.tokenizer
    records = [{"prompt": [{"role": "user", "content": "Tell me about green tea, please."}],
                "reply": [{"role": "assistant", "content": "Green tea is steamed or pan-fired."}]},
               {"prompt": [{"role": "user", "content": "Hi"}], "reply": [{"role": "assistant", "content": "Hello!"}]}]
    shapes = [reward_sequence_ids(tok, r["prompt"], r["reply"]) for r in records]
    prompts = tokenize_prompts(records, tok, max_prompt_len=64)
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    # What each row is made to write: the reply, its end token, then more text that must not count.
    forced = [shape[len(p):] + newline * 3 for shape, p in zip(shapes, prompts)]
    step = {"n": 0}

    def force(module, args, output):
        output = output.clone()
        for row, tokens in enumerate(forced):
            if step["n"] < len(tokens):
                output[row, -1, :] = -1e4
                output[row, -1, tokens[step["n"]]] = 1e4
        step["n"] += 1
        return output

    handle = policy.lm_head.register_forward_hook(force)
    try:
        batch = generate_rollout(policy, prompts, _real_cfg(f"rollout.max_new_tokens={max(map(len, forced))}").rollout)
    finally:
        handle.remove()
    assert batch.truncated.tolist() == [False, False]
    assert [p + r for p, r in zip(batch.prompt_lists(), batch.response_lists())] == shapes
    assert all(r[-1] in policy.stop_ids for r in batch.response_lists())


@pytest.mark.parametrize("name", REAL)
def test_static_decoder_samples_what_generate_samples(name, real_policies):
    """rollout.decoder static against hf, same per-sample seeds: the same responses, masks and
    truncation flags, and behaviour log-probs within 1e-5. Chat prompts of different lengths (left
    padding); a hook on the LM head (the same module in both loops) makes each token of the stop set
    likely enough that rows stop at different steps, and keeps row 0 from stopping (truncated);
    Gemma-3's sliding-window layers (window 16) see prompt + response cross the window; for it both
    decoders also prefill in pieces of 8 columns (rollout.prefill_tokens 40 over 5 rows), which cross
    the window too: the same samples as one forward."""
    import math

    policy = real_policies(name)
    texts = ["Tell me about green tea and how it is made, please.", "Hi", "What is 2 + 2?", "Name three rivers.",
             "Why is the sky blue? Explain it simply."]
    prompts = [list(policy.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                         return_dict=True)["input_ids"]) for t in texts]
    # A random model's next token is near uniform: e^b / (V / n + e^b) = 0.25 per step and stop token.
    bias = math.log(0.25 / 0.75 * policy.vocab_size / len(policy.stop_ids))

    def push_stops(module, args, output):
        output = output.clone()
        output[1:, :, policy.stop_ids] += bias
        output[0, :, policy.stop_ids] -= 1e4
        return output

    widths = []  # tokens per row of each forward through the first layer
    first = policy.model.get_base_model().model.layers[0]
    hooks = [policy.lm_head.register_forward_hook(push_stops), first.register_forward_pre_hook(
        lambda module, args, kw: widths.append((args[0] if args else kw["hidden_states"]).shape[1]), with_kwargs=True)]
    try:
        runs = [("hf", 0), ("static", 0)] + ([("hf", 40), ("static", 40)] if name == "gemma3" else [])
        hf, static, *pieces = (
            generate_rollout(policy, prompts, _real_cfg("rollout.max_new_tokens=8", "rollout.max_prompt_len=64",
                                                        f"rollout.decoder={decoder}", f"rollout.prefill_tokens={tokens}"
                                                        ).rollout, seeds=[5, 6, 7, 8, 9])
            for decoder, tokens in runs)
    finally:
        for hook in hooks:
            hook.remove()
    width = hf.prompt_ids.shape[1]
    split = [8] * ((width - 1) // 8) + [width - (width - 1) // 8 * 8]  # the prefill's pieces, as torch.split cuts
    assert [w for w in widths if w > 1] == [width, width] + [w for w in split * 2 if w > 1] * bool(pieces)
    for other in [static, *pieces]:
        assert torch.equal(other.response_ids, hf.response_ids) and torch.equal(other.response_mask, hf.response_mask)
        bound = fp32_bound(hf.behaviour_logprobs.abs().max())  # other decoders' kernels (tests/tolerances.py)
        assert (other.behaviour_logprobs - hf.behaviour_logprobs).abs().max().item() <= bound
    ends = hf.response_mask.sum(dim=1)[~hf.truncated].tolist()
    assert hf.truncated.tolist()[0] and len(set(ends)) >= 2, (ends, hf.truncated)  # a batch worth checking
    assert max(map(len, prompts)) > 16
    assert torch.equal(static.response_ids, hf.response_ids) and torch.equal(static.response_mask, hf.response_mask)
    assert torch.equal(static.truncated, hf.truncated)
    gap = (static.behaviour_logprobs - hf.behaviour_logprobs).abs().max().item()
    print(f"{name}: ends {ends}, max |behaviour log-prob difference| {gap:.2e}")
    assert gap <= fp32_bound(hf.behaviour_logprobs.abs().max())
