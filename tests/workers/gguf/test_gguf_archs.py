"""Every exported architecture family, verified the same way: a tiny random-init model of it,
exported F32, served by the real worker subprocess with an F32 KV cache, gives HF's per-token
log-probs (reference) and scores (reward) within 1e-3.

The samples are longer than the tiny Gemmas' 16-token sliding window and are packed into one
llama.cpp batch, so sliding layers, their pattern and per-sequence masking are all exercised.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from homerlhf.tiny import TINY_WINDOW, build_tokenizer, model_config
from homerlhf.workers.backends import connect
from homerlhf.workers.gguf import export_ref, export_reward
from homerlhf.workers.process import WorkerProcess
from tolerances import LLAMA_CPP_F32

_rng = np.random.default_rng(11)
# Token ids 3..499 of the 512-token tiny vocabulary (0 is the pad id: never inside a sample).
PROMPTS = [[2, *_rng.integers(3, 500, n).tolist()] for n in (20, 5, 30, 9)]
RESPONSES = [_rng.integers(3, 500, n).tolist() for n in (16, 28, 4, 16)]
assert max(len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES)) > 2 * TINY_WINDOW

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
GEMMA3_SCALED = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
# (name, tiny arch, config overrides): each family, and the variants whose hparams differ.
VARIANTS = [
    ("mistral", "mistral", {}),
    ("llama-rope-llama3", "llama", {"rope_parameters": LLAMA3_ROPE}),
    ("phi3", "phi3", {}),
    ("gemma2", "gemma2", {}),
    ("gemma3_text", "gemma3_text", {}),
    ("gemma3_text-linear-rope-softcap", "gemma3_text", {"rope_parameters": GEMMA3_SCALED, "final_logit_softcapping": 30.0}),
]
CLASSIFIERS = ["mistral", "phi3", "gemma2", "gemma3_text"]


def phi3_longrope(rng: np.random.Generator, original: int) -> dict:
    half = 64 // 4 // 2  # rotary dims / 2 of the hidden-64, 4-head tiny model
    return {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
            "original_max_position_embeddings": original,
            "long_factor": (1 + 3 * rng.random(half)).tolist(), "short_factor": (1 + 0.5 * rng.random(half)).tolist()}


def build_variant(out, arch: str, seed: int, classifier: bool = False, **overrides):
    """A tiny model of ``arch`` (hidden 64, 4 layers) with ``overrides`` on its config; returns (dir, model)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    tok = build_tokenizer()
    template = model_config(arch, len(tok), hidden=64, layers=4)
    values = {k: v for k, v in template.to_dict().items() if k != "transformers_version"}
    config = type(template)(**{**values, **overrides})
    if classifier:
        config.num_labels = 1
    torch.manual_seed(seed)
    auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, model


def _worker(role, path, tmp_path, ctx=64):
    log = tmp_path / f"{role}.log"
    return connect(role, process=WorkerProcess(role, path, ctx=ctx, f32_kv_cache=True, threads=1, log_path=log))


def _max_diff(a, b) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


@pytest.mark.slow  # a worker process per variant
@pytest.mark.parametrize("name, arch, overrides", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_reference_logprobs_equal_hf(name, arch, overrides, tmp_path, hf_ref):
    model_dir, model = build_variant(tmp_path / name, arch, seed=21, **overrides)
    gguf = export_ref(str(model_dir), tmp_path / f"{name}.gguf", outtype="f32")
    backend = _worker("ref", gguf, tmp_path)
    try:
        got = backend.logprobs(PROMPTS, RESPONSES)
    finally:
        backend.close()
    diff = _max_diff(got, hf_ref(model, PROMPTS, RESPONSES))
    print(f"{name}: F32 export, F32 KV cache, worker vs HF max |logprob diff| {diff:.2e}")
    assert diff <= LLAMA_CPP_F32


@pytest.mark.slow
@pytest.mark.parametrize("arch", CLASSIFIERS)
def test_reward_scores_equal_hf(arch, tmp_path):
    model_dir, model = build_variant(tmp_path / arch, arch, seed=22, classifier=True)
    export = export_reward(str(model_dir), tmp_path / "export", outtype="f32")
    backend = _worker("reward", export, tmp_path)
    try:
        got = backend.score(PROMPTS, RESPONSES)
    finally:
        backend.close()
    with torch.no_grad():
        want = [float(model(torch.tensor([p + r])).logits[0, 0]) for p, r in zip(PROMPTS, RESPONSES)]
    diff = max(abs(a - b) for a, b in zip(got, want))
    print(f"{arch} reward: worker vs HF max |score diff| {diff:.2e} (scores {np.round(want, 3).tolist()})")
    assert diff <= LLAMA_CPP_F32 and np.std(want) > 1e-3  # distinct scores: the comparison can fail


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_the_sliding_window_changes_these_samples(arch, tmp_path):
    """The Gemma comparisons could fail: without its window the same model gives other log-probs."""
    from transformers import AutoModelForCausalLM

    model_dir, model = build_variant(tmp_path / arch, arch, seed=21)
    unwindowed = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, sliding_window=4096).eval()
    ids = torch.tensor([PROMPTS[2] + RESPONSES[2]])
    with torch.no_grad():
        gap = (model(ids).logits - unwindowed(ids).logits).abs().max().item()
    assert gap > 1e-2


def test_phi3_longrope_long_factors(tmp_path, llama_cpp_logits):
    """Sequences past the original context use the long factors on both sides (llama.cpp picks them
    by context size, HF by sequence length: a 300-token sequence in a 512-token context)."""
    rope = phi3_longrope(np.random.default_rng(3), original=256)
    model_dir, model = build_variant(tmp_path / "phi3", "phi3", seed=23, rope_parameters=rope,
                                     max_position_embeddings=1024, original_max_position_embeddings=256)
    gguf = export_ref(str(model_dir), tmp_path / "phi3.gguf", outtype="f32")
    ids = [2, *np.random.default_rng(4).integers(3, 500, 299).tolist()]
    got = torch.log_softmax(torch.tensor(llama_cpp_logits(gguf, ids, n_ctx=512)), -1)
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    diff = (got - want).abs().max().item()
    print(f"phi3 longrope, long factors (300 tokens): max |logprob diff| {diff:.2e}")
    assert diff <= LLAMA_CPP_F32


@pytest.mark.slow
def test_phi3_longrope_short_factors_through_the_worker(tmp_path, hf_ref):
    rope = phi3_longrope(np.random.default_rng(5), original=1024)
    model_dir, model = build_variant(tmp_path / "phi3", "phi3", seed=24, rope_parameters=rope,
                                     max_position_embeddings=4096, original_max_position_embeddings=1024)
    gguf = export_ref(str(model_dir), tmp_path / "phi3.gguf", outtype="f32")
    backend = _worker("ref", gguf, tmp_path)  # context 1024 (the worker's minimum): short factors
    try:
        diff = _max_diff(backend.logprobs(PROMPTS, RESPONSES), hf_ref(model, PROMPTS, RESPONSES))
    finally:
        backend.close()
    print(f"phi3 longrope, short factors: max |logprob diff| {diff:.2e}")
    assert diff <= LLAMA_CPP_F32
