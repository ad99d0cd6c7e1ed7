"""The static-cache decode loop: the same samples as HF ``generate`` (same per-sample seeds -> same
tokens, behaviour log-probs within tests/tolerances.py's fp32 bound) on the NF4 tiny Llama, with rows stopping at different steps
and some never (tests/ppo/test_rollout.py: the same through the rollout on real tokenizers); and the
step it captures on CUDA is a pure function of its static buffers (checked eagerly: no CUDA in CI);
models whose step cannot be captured are refused, a step that syncs is declined before any capture,
and one capture, side stream and memory pool serve every chunk of a shape (counted on the CPU through
the code that owns them, its CUDA primitives replaced)."""

from __future__ import annotations

import contextlib
import logging
import math
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from homerlhf.config import load_config
from homerlhf.models.generation import BehaviourLogprobs, build_generation_config
from homerlhf.models.decode_graphs import StepGraphs
from homerlhf.models.host_sync import HostSync, NoHostSync
from homerlhf.models.logprobs import position_ids_from_mask
from homerlhf.models.sampling import PerSampleSampler
from homerlhf.models.static_decode import (
    STOP_CHECK_EVERY,
    DecodeBuffers,
    StaticDecoder,
    decode_step,
    prefill,
    refusal,
    resolve_decoder,
    sample,
)
from homerlhf.ppo.rollout import pad_sequences
from tolerances import fp32_bound


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


def _both_decoders(policy, prompts, seeds, new_tokens: int, bias: float, noise=None, hold_first: bool = True,
                   decoders=("hf", "static"), prefill_columns=None):
    """``{decoder: (generated ids (B, T), behaviour log-probs (B, T))}`` of ``policy.generate`` with
    HF generate and with the static loop, each with a fresh recorder and per-sample sampler (``noise``
    its noise source; or, ``seeds=None``, torch's global generator, reseeded before each). A hook on
    the LM head (the same module in both loops) adds ``bias`` to the stop tokens' logits of every row
    but the first, whose stop tokens it pushes out of reach (it runs to the end; ``hold_first=False``:
    the first row too gets the bias). ``prefill_columns``: the prompt block prefilled in pieces of
    that many columns (``generation_config.prefill_chunk_size``)."""
    def push_stops(module, args, output):
        output = output.clone()
        output[int(hold_first):, :, policy.stop_ids] += bias
        if hold_first:
            output[0, :, policy.stop_ids] -= 1e4
        return output

    ids, mask = pad_sequences(prompts, policy.tokenizer.pad_token_id)
    config = build_generation_config(max_new_tokens=new_tokens, temperature=policy.temperature,
                                     stop_ids=policy.stop_ids, pad_id=policy.tokenizer.pad_token_id,
                                     prefill_chunk_size=prefill_columns)
    handle = policy.lm_head.register_forward_hook(push_stops)
    try:
        out = {}
        for decoder in decoders:
            torch.manual_seed(1234)
            recorder = BehaviourLogprobs(policy.temperature)
            sampler = PerSampleSampler(seeds, policy.temperature, "cpu", noise) if seeds is not None else None
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
    assert gap <= fp32_bound(hf_logprobs.abs().max())  # other kernels (tests/tolerances.py)


TINY_PROMPTS = [[302, 20, 1, 6], [4, 6], [5, 7, 9], [33, 44, 55, 66, 77, 88], [9, 10], [100, 200, 300], [7]]


def test_same_samples_as_generate_with_per_sample_seeds(tiny_policy):
    """With the counter noise (CUDA's default); the generator noise (the CPU's) through the rollout
    on real tokenizers: tests/ppo/test_rollout.py."""
    out = _both_decoders(tiny_policy, TINY_PROMPTS, seeds=list(range(11, 18)), new_tokens=12,
                         bias=_stop_bias(tiny_policy), noise="counter")
    _assert_same_samples(out, tiny_policy.stop_ids)


def test_a_batch_that_stops_early_ends_where_generate_ends(tiny_policy):
    """Every row stops within a few steps; the loop reads "all stopped?" on the host only every
    STOP_CHECK_EVERY steps, runs on up to the next check and cuts the steps after the last stop off
    (the recorder's too): the same ids, as many columns, the same behaviour log-probs."""
    out = _both_decoders(tiny_policy, TINY_PROMPTS, seeds=list(range(21, 28)), new_tokens=24,
                         bias=_stop_bias(tiny_policy, per_step=0.3), noise="counter", hold_first=False)
    (hf, hf_logprobs), (static, static_logprobs) = out["hf"], out["static"]
    ends = _first_stops(hf, tiny_policy.stop_ids)
    assert None not in ends and hf.shape[1] == max(ends) < 24 and hf.shape[1] % STOP_CHECK_EVERY, ends
    assert torch.equal(static, hf)
    assert (static_logprobs - hf_logprobs).abs().max().item() <= fp32_bound(hf_logprobs.abs().max())


class CountHostReads(TorchDispatchMode):
    """Counts the ops that read a device value on the host (``bool(t)``, ``.item()``; ``multinomial``,
    which on CUDA checks its input on the host)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.multinomial)
        return func(*args, **(kwargs or {}))


def test_the_loop_reads_the_device_on_the_host_every_few_steps_only(tiny_policy):
    """Per step HF's loop reads the stop flags and draws with ``multinomial`` (over a one-hot, from the
    per-sample sampler); the static loop takes the sampler's token and reads once per
    STOP_CHECK_EVERY steps (and the per-step flags once at the end: one device-to-host copy, not an op
    a dispatch mode sees)."""
    steps = STOP_CHECK_EVERY + 1
    causal_lm, bufs, ids, _, first = _prefilled(tiny_policy, TINY_PROMPTS[:2], new_tokens=steps)
    sampler = PerSampleSampler([1, 2], tiny_policy.temperature, "cpu", "counter")
    with torch.no_grad(), CountHostReads() as counter:
        out = sample(decode_step(causal_lm, bufs), bufs, first, ids, max_new_tokens=steps, stop_ids=[], pad_id=0,
                     temperature=tiny_policy.temperature, processors=[BehaviourLogprobs(tiny_policy.temperature), sampler])
    assert out.shape == (2, steps) and counter.reads == 1, counter.reads


def test_prefill_in_pieces_samples_as_one_forward(tiny_policy):
    """A prompt block (7 x 6, left-padded: rows of 1 to 6 tokens) prefilled in pieces of 4 columns
    (6 = 4 + 2; the second piece holds the last token of every row) by the static loop and by HF
    generate's chunked prefill gives the samples and behaviour log-probs of one forward."""
    seeds = list(range(11, 18))
    kwargs = dict(seeds=seeds, new_tokens=12, bias=_stop_bias(tiny_policy), noise="counter")
    whole = _both_decoders(tiny_policy, TINY_PROMPTS, decoders=("hf",), **kwargs)["hf"]
    widths = []  # the tokens per row of each forward through the first layer (1: a decode step)
    layer = tiny_policy.model.get_base_model().model.layers[0]
    handle = layer.register_forward_pre_hook(
        lambda module, args, kw: widths.append((args[0] if args else kw["hidden_states"]).shape[1]), with_kwargs=True)
    try:
        pieces = _both_decoders(tiny_policy, TINY_PROMPTS, prefill_columns=4, **kwargs)
    finally:
        handle.remove()
    assert [w for w in widths if w > 1] == [4, 2, 4, 2]  # HF generate's prefill, then the static loop's
    _assert_same_samples(pieces, tiny_policy.stop_ids)
    assert torch.equal(pieces["hf"][0], whole[0])
    assert (pieces["hf"][1] - whole[1]).abs().max().item() <= fp32_bound(whole[1].abs().max())


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


@pytest.mark.parametrize("columns", [1, 2, 4, 5])
def test_prefill_in_pieces_fills_the_cache_as_one_forward(tiny_policy, columns):
    """Pieces of 1, 2, 4 or 5 columns of a 6-column block (an all-padding first piece for the shorter
    rows; a last piece of 1 to 2 columns): the same last-position logits as a cache-free forward, the
    same cache (every layer's K and V, the write offset) and first-step positions as one forward."""
    prompts = [[302, 20, 1, 6], [4, 6], [5, 7, 9], [33, 44, 55, 66, 77, 88]]
    causal_lm, whole, ids, mask, _ = _prefilled(tiny_policy, prompts, new_tokens=2)
    bufs = DecodeBuffers(causal_lm, len(prompts), ids.shape[1] + 2, ids.device)
    with torch.no_grad():
        first = prefill(causal_lm, bufs, ids, mask, columns)
    fresh = _fresh_last_logits(causal_lm, ids, mask)  # a cache-free forward: other shapes (tests/tolerances.py)
    torch.testing.assert_close(first, fresh, atol=fp32_bound(fresh.abs().max()), rtol=0)
    assert torch.equal(bufs.positions, whole.positions) and torch.equal(bufs.attention_mask, whole.attention_mask)
    for piece, one in zip(bufs.cache.layers, whole.cache.layers):
        assert int(piece.cumulative_length) == int(one.cumulative_length) == ids.shape[1]
        torch.testing.assert_close(piece.keys, one.keys, atol=fp32_bound(one.keys.abs().max()), rtol=0)
        torch.testing.assert_close(piece.values, one.values, atol=fp32_bound(one.values.abs().max()), rtol=0)


def test_step_output_equals_a_fresh_forward_for_inputs_changed_in_place(tiny_policy):
    """Each step's buffers are rewritten in place (token, mask column, position); the step's logits,
    always in the same buffer, equal a cache-free forward of the whole sequence so far."""
    prompts = [[302, 20, 1, 6], [4, 6], [5, 7, 9]]
    causal_lm, bufs, ids, mask, first = _prefilled(tiny_policy, prompts, new_tokens=3)
    fresh = _fresh_last_logits(causal_lm, ids, mask)  # a cache-free forward: other shapes (tests/tolerances.py)
    torch.testing.assert_close(first, fresh, atol=fp32_bound(fresh.abs().max()), rtol=0)
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
        fresh = _fresh_last_logits(causal_lm, ids, mask)
        torch.testing.assert_close(bufs.logits, fresh, atol=fp32_bound(fresh.abs().max()), rtol=0)
        assert (bufs.logits.data_ptr(), bufs.tokens.data_ptr(), bufs.cache.layers[0].keys.data_ptr()) == addresses


def test_the_sync_guard_catches_host_syncs():
    t = torch.tensor([1.0, -2.0])
    for sync in (lambda: t.sum().item(), lambda: bool(t.any()), lambda: t.nonzero(), lambda: t[t > 0],
                 lambda: t.to("meta"), lambda: torch.empty(2, device="meta").copy_(t)):  # (a host-to-device copy)
        with pytest.raises(HostSync, match="host sync|host-to-device copy"), NoHostSync():
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


# -- models whose step cannot be captured: refused up front -----------------------------------------
def _rope_model(arch: str, rope: dict):
    from transformers import AutoModelForCausalLM

    from homerlhf.tiny import model_config

    config = model_config(arch, 512, hidden=64, layers=2)
    config.rope_parameters = {"rope_theta": 10000.0, **rope}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _step_syncs(causal_lm) -> bool:
    """Whether the model's decode step (after a prefill of 3 tokens) makes a host sync."""
    ids = torch.tensor([[5, 6, 7]])
    bufs = DecodeBuffers(causal_lm, 1, 6, ids.device)
    with torch.no_grad():
        prefill(causal_lm, bufs, ids, torch.ones_like(ids))
        bufs.feed(torch.tensor([9]), 3)
        try:
            with NoHostSync():
                decode_step(causal_lm, bufs)()
        except HostSync:
            return True
    return False


def test_dynamic_rope_is_refused_for_the_host_sync_its_step_makes():
    """A dynamic-RoPE model's rotary update branches on ``max(position_ids)`` (a host sync, and a graph
    would freeze the branch): refused before anything is captured. A linear-scaled RoPE is not."""
    dynamic = _rope_model("llama", {"rope_type": "dynamic", "factor": 2.0})
    assert _step_syncs(dynamic)
    assert "'dynamic' RoPE" in refusal(dynamic)
    linear = _rope_model("llama", {"rope_type": "linear", "factor": 2.0})
    assert not _step_syncs(linear) and refusal(linear) is None


def test_long_rope_is_refused_where_its_step_syncs():
    """Long-RoPE (Phi-3-128k, Phi-3.5): transformers 5.17 picks the short or long factors with a
    host-side branch (refused), 5.24 with ``torch.where`` (runs): refused exactly when the step syncs."""
    import transformers

    half = 64 // 4 // 2
    phi = _rope_model("phi3", {"rope_type": "longrope", "short_factor": [1.0] * half, "long_factor": [2.0] * half,
                               "original_max_position_embeddings": 256})
    syncs, reason = _step_syncs(phi), refusal(phi)
    print(f"transformers {transformers.__version__}: step syncs {syncs}, refusal {reason!r}")
    assert (reason is not None) == syncs
    assert reason is None or "'longrope' RoPE" in reason


# -- what a capture makes and keeps: counted on the CPU through the code that owns it -----------------
class CountingGraphs(StepGraphs):
    """:class:`StepGraphs` with its four CUDA primitives replaced for the CPU (everything else, the
    order of warm-up, host-sync check and capture included, is what runs on a GPU): each stream, pool
    and graph made is counted, and a "graph" replays the captured step eagerly."""

    def __init__(self):
        super().__init__("cpu")
        self.made = {"stream": 0, "pool": 0, "graph": 0}
        self.events = []

    def new_stream(self):
        self.made["stream"] += 1
        return f"stream {self.made['stream']}"

    def new_pool(self):
        self.made["pool"] += 1
        return f"pool {self.made['pool']}"

    @contextlib.contextmanager
    def on_stream(self, stream):
        self.events.append(f"warm-up on {stream}")
        yield

    def capture_graph(self, step, stream, pool):
        self.made["graph"] += 1
        self.events.append(f"capture on {stream} into {pool}")
        return types.SimpleNamespace(replay=step)


@contextlib.contextmanager
def _decoder_with(policy, graphs):
    saved = policy.static_decoder
    policy.static_decoder = StaticDecoder(policy.model.get_base_model(), graphs=graphs)
    try:
        yield policy.static_decoder
    finally:
        policy.static_decoder = saved


def test_one_capture_per_shape_one_stream_and_one_pool_across_chunks(tiny_policy):
    """Five chunks sampled back to back (as the asynchronous producer does): the same 3 rows twice (one
    capture, replayed), 3 rows with a longer prompt (the cache must grow: a second capture), the first
    3 again (they fit the grown cache: replayed), then 2 rows (a third). One side stream and one memory
    pool for all; the replayed chunks sample what HF samples. Any other forward of the model (here HF
    generate's) frees the kept session first: the memory plan's scoring and update never hold it."""
    chunks = [TINY_PROMPTS[:3], TINY_PROMPTS[:3], TINY_PROMPTS[3:6], TINY_PROMPTS[:3], TINY_PROMPTS[:2]]
    seeds = [[30 + i + r for r in range(len(prompts))] for i, prompts in enumerate(chunks)]
    graphs = CountingGraphs()
    with _decoder_with(tiny_policy, graphs) as decoder:
        static = [_both_decoders(tiny_policy, p, s, 3, 0.0, "counter", decoders=("static",))["static"]
                  for p, s in zip(chunks, seeds)]
        assert decoder.off_reason is None and decoder.sessions_made == 3
        assert graphs.made == {"stream": 1, "pool": 1, "graph": 3}
        assert graphs.events[:3] == ["warm-up on stream 1", "capture on stream 1 into pool 1", "warm-up on stream 1"]
        for i in (1, 3):  # the replayed ones (a fresh session's samples: the tests above)
            (ids, logprobs), prompts, seed = static[i], chunks[i], seeds[i]
            hf_ids, hf_logprobs = _both_decoders(tiny_policy, prompts, seed, 3, 0.0, "counter", decoders=("hf",))["hf"]
            assert torch.equal(ids, hf_ids)
            assert (logprobs - hf_logprobs).abs().max().item() <= fp32_bound(hf_logprobs.abs().max())
            assert decoder._session is None  # freed at HF generate's first forward
        _both_decoders(tiny_policy, chunks[0], seeds[0], 3, 0.0, "counter", decoders=("static",))
    assert decoder.sessions_made == 4 and graphs.made == {"stream": 1, "pool": 2, "graph": 4}


def test_a_step_that_syncs_is_declined_before_any_capture(tiny_policy, caplog):
    """A decode step with a host sync (here a hook on the first layer that branches on a device value,
    as a dynamic RoPE does) fails the host-sync check of the last warm-up step: no capture begins (a
    failed ``cudaStreamEndCapture`` would leave the allocator in capture mode), the chunk is sampled by
    HF generate, and the reason is logged once."""
    layer = tiny_policy.model.get_base_model().model.layers[0]
    handle = layer.register_forward_hook(lambda module, args, output: None if bool(args[0].sum() > 0) else None)
    graphs = CountingGraphs()
    try:
        with _decoder_with(tiny_policy, graphs) as decoder, \
                caplog.at_level(logging.WARNING, logger="homerlhf.models.static_decode"):
            runs = [_both_decoders(tiny_policy, TINY_PROMPTS[:3], [1, 2, 3], new_tokens=3, bias=0.0) for _ in range(2)]
    finally:
        handle.remove()
    assert all(torch.equal(out["hf"][0], out["static"][0]) for out in runs)
    assert graphs.made["graph"] == 0 and graphs.events == ["warm-up on stream 1"]
    assert "host sync" in decoder.off_reason and "declined before capturing" in decoder.off_reason
    assert [r.getMessage() for r in caplog.records] == [
        f"rollout.decoder static: {decoder.off_reason}; sampling with HF generate instead"]
