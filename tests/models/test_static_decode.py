"""The static-cache decode loop: the same samples as HF ``generate`` (same per-sample seeds -> same
tokens, behaviour log-probs within 1e-5) on the NF4 tiny Llama, with rows stopping at different steps
and some never (tests/ppo/test_rollout.py: the same through the rollout on real tokenizers); and the
step it captures on CUDA is a pure function of its static buffers (checked eagerly: no CUDA in CI)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from homerlhf.config import load_config
from homerlhf.models.generation import BehaviourLogprobs, build_generation_config
from homerlhf.models.logprobs import position_ids_from_mask
from homerlhf.models.sampling import PerSampleSampler
from homerlhf.models.static_decode import (
    DecodeBuffers,
    StaticDecoder,
    decode_step,
    prefill,
    resolve_decoder,
)
from homerlhf.ppo.rollout import pad_sequences


def _cfg(*extra):
    return load_config("cpu-tiny", overrides=["ref.backend=adapter_off", "reward.backend=hf", *extra])


def _policy(model_dir, temperature: float = 1.0, tokenizer=None):
    from homerlhf.models.policy import PolicyModel

    torch.manual_seed(0)
    return PolicyModel.from_config(_cfg(f"rollout.temperature={temperature}"), str(model_dir), tokenizer=tokenizer)


@pytest.fixture(scope="module")
def tiny_policy(tiny_llama_dir):
    return _policy(tiny_llama_dir, temperature=0.7)


def _stop_bias(policy, per_step: float = 0.03) -> float:
    """A logit bias on each stop token that makes stopping about ``per_step`` likely per step for a
    random model, whose next-token distribution is near uniform: e^b / (V / n + e^b) = per_step."""
    return math.log(per_step / (1 - per_step) * policy.vocab_size / len(policy.stop_ids))


def _both_decoders(policy, prompts, seeds, new_tokens: int, bias: float):
    """``{decoder: (generated ids (B, T), behaviour log-probs (B, T))}`` of ``policy.generate`` with
    HF generate and with the static loop, each with a fresh recorder and per-sample sampler (or,
    ``seeds=None``, torch's global generator, reseeded before each). A hook on the LM head (the same
    module in both loops) adds ``bias`` to the stop tokens' logits of every row but the first, whose
    stop tokens it pushes out of reach (it runs to the end)."""
    def push_stops(module, args, output):
        output = output.clone()
        output[1:, :, policy.stop_ids] += bias
        output[0, :, policy.stop_ids] -= 1e4
        return output

    ids, mask = pad_sequences(prompts, policy.tokenizer.pad_token_id)
    config = build_generation_config(max_new_tokens=new_tokens, temperature=policy.temperature,
                                     stop_ids=policy.stop_ids, pad_id=policy.tokenizer.pad_token_id)
    handle = policy.lm_head.register_forward_hook(push_stops)
    try:
        out = {}
        for decoder in ("hf", "static"):
            torch.manual_seed(1234)
            recorder = BehaviourLogprobs(policy.temperature)
            sampler = PerSampleSampler(seeds, policy.temperature, "cpu") if seeds is not None else None
            generated = policy.generate(ids, mask, config, recorder=recorder, logits_processor=sampler, decoder=decoder)
            out[decoder] = (generated, recorder.taken(generated))
    finally:
        handle.remove()
    return out


def _first_stops(generated, stop_ids):
    """Per row, the number of tokens up to and including the first stop token; None: none (truncated)."""
    stops = [[t in stop_ids for t in row] for row in generated.tolist()]
    return [row.index(True) + 1 if True in row else None for row in stops]


def _assert_same_samples(out, stop_ids):
    (hf, hf_logprobs), (static, static_logprobs) = out["hf"], out["static"]
    # The batch is one worth checking: rows stop at different steps, some never (truncated).
    ends = _first_stops(hf, stop_ids)
    assert None in ends and len({e for e in ends if e is not None}) >= 2, ends
    assert torch.equal(static, hf)  # every column, the pad after each stop included
    gap = (static_logprobs - hf_logprobs).abs().max().item()
    print(f"rows end at {ends}; max |behaviour log-prob difference| {gap:.2e}")
    assert gap <= 1e-5


TINY_PROMPTS = [[302, 20, 1, 6], [4, 6], [5, 7, 9], [33, 44, 55, 66, 77, 88], [9, 10], [100, 200, 300], [7]]


def test_same_samples_as_generate_with_per_sample_seeds(tiny_policy):
    out = _both_decoders(tiny_policy, TINY_PROMPTS, seeds=list(range(11, 18)), new_tokens=12,
                         bias=_stop_bias(tiny_policy))
    _assert_same_samples(out, tiny_policy.stop_ids)


def test_same_samples_as_generate_from_the_global_generator(tiny_policy):
    """Without seeds both loops draw with ``multinomial`` from torch's generator, in the same order."""
    out = _both_decoders(tiny_policy, TINY_PROMPTS, seeds=None, new_tokens=12, bias=_stop_bias(tiny_policy))
    _assert_same_samples(out, tiny_policy.stop_ids)


# -- the step a graph captures: a pure function of its static buffers --------------------------------
def _prefilled(policy, prompts, new_tokens: int):
    causal_lm = policy.model.get_base_model()
    ids, mask = pad_sequences(prompts, policy.tokenizer.pad_token_id)
    bufs = DecodeBuffers(causal_lm, len(prompts), ids.shape[1] + new_tokens, ids.device)
    with torch.no_grad():
        first = prefill(causal_lm, bufs, ids, mask)
    return causal_lm, bufs, ids, mask, first


@torch.no_grad()
def _fresh_last_logits(causal_lm, ids, mask):
    """The last position's fp32 logits of a full forward without a cache: what a step must equal."""
    out = causal_lm(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False)
    return out.logits[:, -1].float()


def test_step_output_equals_a_fresh_forward_for_inputs_changed_in_place(tiny_policy):
    """Each step's buffers are rewritten in place (token, mask column, position); the step's logits,
    always in the same buffer, equal a cache-free forward of the whole sequence so far."""
    prompts = [[302, 20, 1, 6], [4, 6], [5, 7, 9]]
    causal_lm, bufs, ids, mask, first = _prefilled(tiny_policy, prompts, new_tokens=3)
    torch.testing.assert_close(first, _fresh_last_logits(causal_lm, ids, mask), atol=1e-5, rtol=0)
    step = decode_step(causal_lm, bufs)
    addresses = (bufs.logits.data_ptr(), bufs.tokens.data_ptr(), bufs.cache.layers[0].keys.data_ptr())
    width = ids.shape[1]
    for t, tokens in enumerate(([10, 11, 12], [40, 41, 42], [7, 8, 9])):
        tokens = torch.tensor(tokens)
        bufs.feed(tokens, width + t)
        with torch.no_grad():
            step()
        bufs.positions.add_(1)
        ids, mask = torch.cat([ids, tokens[:, None]], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        torch.testing.assert_close(bufs.logits, _fresh_last_logits(causal_lm, ids, mask), atol=1e-5, rtol=0)
        assert (bufs.logits.data_ptr(), bufs.tokens.data_ptr(), bufs.cache.layers[0].keys.data_ptr()) == addresses


class NoHostSync(TorchDispatchMode):
    """Raises on every op that makes the host wait for the device or gives a data-dependent shape:
    what breaks a CUDA graph capture (``.item()``, ``bool(t)``, ``nonzero``, boolean indexing)."""

    SYNCS = {torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero, torch.ops.aten.masked_select,
             torch.ops.aten.equal, torch.ops.aten._unique2, torch.ops.aten.unique_consecutive,
             torch.ops.aten.unique_dim}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bool_index = func.overloadpacket in (torch.ops.aten.index, torch.ops.aten.index_put_) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []))
        if func.overloadpacket in self.SYNCS or bool_index:
            raise AssertionError(f"host sync in the decode step: {func}")
        return func(*args, **kwargs)


def test_the_sync_guard_catches_host_syncs():
    t = torch.tensor([1.0, -2.0])
    for sync in (lambda: t.sum().item(), lambda: bool(t.any()), lambda: t.nonzero(), lambda: t[t > 0]):
        with pytest.raises(AssertionError, match="host sync"), NoHostSync():
            sync()


def test_step_makes_no_host_sync(tiny_policy):
    causal_lm, bufs, ids, _, _ = _prefilled(tiny_policy, [[302, 20, 1, 6], [4, 6]], new_tokens=2)
    step = decode_step(causal_lm, bufs)
    bufs.feed(torch.tensor([10, 11]), ids.shape[1])
    with torch.no_grad(), NoHostSync():
        step()


def test_a_refused_model_samples_with_generate_and_says_why_once(tiny_policy, caplog):
    """A model the loop cannot run (here: a layer type it does not know) gets HF generate's samples
    and one log line naming the reason, however many rollouts follow."""
    from homerlhf.models.policy import PolicyModel

    config = tiny_policy.model.get_base_model().config
    policy = PolicyModel(tiny_policy.model, None, tiny_policy.tokenizer, shared_adapter=True,
                         logprob_chunk_size=8, temperature=0.7)
    # Chunks of 64 tokens: longer than every sequence here, so HF generate's cache keeps them whole.
    config.layer_types, config.attention_chunk_size = ["chunked_attention"] * config.num_hidden_layers, 64
    try:
        with caplog.at_level(logging.WARNING, logger="homerlhf.models.static_decode"):
            runs = [_both_decoders(policy, TINY_PROMPTS[:3], [1, 2, 3], new_tokens=3, bias=0.0) for _ in range(2)]
    finally:
        del config.layer_types, config.attention_chunk_size
    assert all(torch.equal(out["hf"][0], out["static"][0]) for out in runs)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["rollout.decoder static: layer types ['chunked_attention'] (the static loop has full and "
                     "sliding-window attention only); sampling with HF generate instead"]
    assert isinstance(policy.static_decoder, StaticDecoder) and policy.static_decoder.off_reason is not None


def test_auto_is_the_static_loop_on_cuda_only():
    assert resolve_decoder("auto", "cuda") == "static" and resolve_decoder("auto", torch.device("cuda", 0)) == "static"
    assert resolve_decoder("auto", "cpu") == "hf"
    assert resolve_decoder("static", "cpu") == "static" and resolve_decoder("hf", "cuda") == "hf"
