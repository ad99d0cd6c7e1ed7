"""Fixtures of the worker tests: tiny exports (F32) and real worker subprocesses, cleaned up."""

from __future__ import annotations

import pytest
import torch

from homerlhf.workers.backends import connect
from homerlhf.workers.gguf import export_ref, export_reward
from homerlhf.workers.process import WorkerProcess

# Different lengths, so packing several sequences into one decode is exercised.
PROMPTS = [[2, 4, 17, 30, 41], [2, 5, 99], [2, 4, 200, 201, 202, 203, 7, 8], [2, 6]]
RESPONSES = [[50, 51, 52, 1], [60, 61, 62, 63, 64, 65, 1], [70, 1], [80, 81, 82]]


def hf_logprobs(model, prompts, responses, temperature: float = 1.0) -> list[list[float]]:
    """Per-token log p(response) under a HF causal LM at ``temperature``, one sequence at a time
    (no padding): ``log_softmax(logits / temperature)``."""
    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            ids = torch.tensor([list(p) + list(r)])
            logp = torch.log_softmax(model(ids).logits[0].double() / temperature, dim=-1)  # (T, V)
            rows = torch.arange(len(p) - 1, len(p) + len(r) - 1)
            out.append(logp[rows, torch.tensor(r)].tolist())
    return out


@pytest.fixture(scope="session")
def samples():
    """(prompts, responses): token ids of a few samples of different lengths."""
    return PROMPTS, RESPONSES


@pytest.fixture(scope="session")
def hf_ref():
    """``hf_ref(model, prompts, responses)``: the HF log-probs the worker must reproduce."""
    return hf_logprobs


@pytest.fixture(scope="session")
def llama_f32_gguf(tiny_llama_dir, tmp_path_factory):
    return export_ref(str(tiny_llama_dir), tmp_path_factory.mktemp("gguf") / "llama-f32.gguf", outtype="f32")


@pytest.fixture(scope="session")
def qwen2_f32_gguf(tiny_qwen2_dir, tmp_path_factory):
    return export_ref(str(tiny_qwen2_dir), tmp_path_factory.mktemp("gguf") / "qwen2-f32.gguf", outtype="f32")


@pytest.fixture(scope="session")
def llama_rm_dir(tmp_path_factory):
    from homerlhf.tiny import build_sequence_classifier

    return build_sequence_classifier(tmp_path_factory.mktemp("rm-llama"), arch="llama", seed=3)


@pytest.fixture(scope="session")
def qwen2_rm_dir(tmp_path_factory):
    from homerlhf.tiny import build_sequence_classifier

    return build_sequence_classifier(tmp_path_factory.mktemp("rm-qwen2"), arch="qwen2", seed=4)


@pytest.fixture(scope="session")
def llama_rm_export(llama_rm_dir, tmp_path_factory):
    return export_reward(str(llama_rm_dir), tmp_path_factory.mktemp("rm-llama-export"), outtype="f32")


@pytest.fixture(scope="module")
def llama_ref(llama_f32_gguf, tmp_path_factory):
    """A ref worker subprocess on the tiny Llama, F32 export and F32 KV cache."""
    log = tmp_path_factory.mktemp("logs") / "ref.log"
    backend = connect("ref", process=WorkerProcess("ref", llama_f32_gguf, ctx=64, f32_kv_cache=True, threads=2, log_path=log))
    yield backend
    backend.close()
