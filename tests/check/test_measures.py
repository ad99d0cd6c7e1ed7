"""What the GPU check measures beside memory and time (homerlhf/check/measures.py, runs.py): the
sampled-vs-scored log-prob gap per token, the precision / kernel flags put back after each case, the
cuBLAS workspaces freed between cases, and "captured" said only of a graph that was made and replayed."""

from __future__ import annotations

import runpy
import types
from pathlib import Path

import pytest
import torch


@pytest.fixture
def scripts():
    from homerlhf.check import measures, runs

    return types.SimpleNamespace(measures=measures, runs=runs)


def _experience(response_ids, mask, logprobs):
    from homerlhf.ppo.experience import Experience

    rows = len(response_ids)
    return Experience(prompt_ids=torch.ones(rows, 2, dtype=torch.long), prompt_mask=torch.ones(rows, 2, dtype=torch.long),
                      response_ids=torch.tensor(response_ids), response_mask=torch.tensor(mask),
                      old_logprobs=torch.tensor(logprobs), ref_logprobs=torch.zeros(rows, len(mask[0])),
                      values=torch.zeros(rows, len(mask[0])), scores=torch.zeros(rows),
                      truncated=torch.zeros(rows, dtype=torch.bool))


def test_the_gap_is_per_response_token_across_chunks(scripts):
    """Two chunks sampled (1 row each, widths 2 and 3), one experience of width 3: |old - sampled| on
    the 4 response tokens is 0.5, 0, 0.25, 0.25 (the padding's 9.0 is off the mask): max 0.5, mean 0.25."""
    kept = scripts.measures.SampledLogprobs()
    kept.keep(types.SimpleNamespace(response_ids=torch.tensor([[5, 6]]), response_mask=torch.tensor([[1, 1]]),
                                    behaviour_logprobs=torch.tensor([[-1.0, -2.0]])))
    kept.keep(types.SimpleNamespace(response_ids=torch.tensor([[7, 8, 9]]), response_mask=torch.tensor([[1, 1, 0]]),
                                    behaviour_logprobs=torch.tensor([[-3.0, -0.5, 0.0]])))
    exp = _experience([[5, 6, 0], [7, 8, 0]], [[1, 1, 0], [1, 1, 0]], [[-1.5, -2.0, 9.0], [-3.25, -0.25, 0.0]])
    assert kept.compare(exp) == {"tokens": 4, "max_abs": 0.5, "mean_abs": 0.25}
    assert kept.summary()["per_iteration"] == [{"tokens": 4, "max_abs": 0.5, "mean_abs": 0.25}] and not kept.batches
    kept.keep(types.SimpleNamespace(response_ids=torch.tensor([[5, 1]]), response_mask=torch.tensor([[1, 1]]),
                                    behaviour_logprobs=torch.tensor([[-1.0, -2.0]])))
    with pytest.raises(AssertionError, match="does not hold the sampled tokens"):
        kept.compare(_experience([[5, 6]], [[1, 1]], [[-1.0, -2.0]]))


def test_a_case_puts_the_flags_back_it_found(scripts, monkeypatch, tmp_path):
    """A case's policy sets TF32 and the SDPA backends for itself (on the CPU: TF32 off); the check puts
    the flags it found before the case back after it, so the next case starts from them (a bf16 case's
    TF32 never reaches an upcast case's fp32 matmuls through the process)."""
    from homerlhf.check.cases import Case, SMALL
    from homerlhf.check.run import Run, guarded, write_files
    from homerlhf.models import cuda_kernels

    run = Run(smoke=True, tmp=tmp_path)
    write_files(run)
    case = Case("grpo-1.5b", "4090", "Qwen/Qwen2.5-1.5B", SMALL + ("algorithm=grpo", "group.size=4"), 1, 14)
    before = cuda_kernels.current_flags()
    torch.backends.cuda.matmul.allow_tf32 = True  # what a bf16 policy on CUDA leaves
    try:
        entry = guarded(case, run)
        assert "error" not in entry, entry.get("traceback")
        assert entry["kernel_settings"]["tf32"] is False  # what the case's policy ran with
        assert torch.backends.cuda.matmul.allow_tf32 is True  # put back after the case
    finally:
        cuda_kernels.restore(before)


def test_workspaces_are_freed_between_cases_before_the_cache_is_emptied(scripts, monkeypatch):
    """On CUDA, ``release_memory`` frees every cuBLAS workspace (a case's decode side stream leaves
    32 MiB) and then hands the cached blocks back: the CUDA calls in order (their primitives recorded:
    a CPU build has neither)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("clear workspaces"), raising=False)
    scripts.runs.release_memory()
    assert calls == ["clear workspaces", "empty_cache"]


def test_captured_is_said_of_a_graph_made_and_replayed(scripts, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from homerlhf.models.static_decode import StaticDecoder

    models_tests = Path(__file__).resolve().parents[1] / "models"
    graphs = runpy.run_path(str(models_tests / "test_decode_replays.py"))["StandInGraphs"]()  # CUDA primitives replaced
    lm = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), attn_implementation="sdpa").eval()
    decoder = StaticDecoder(lm, graphs=graphs)
    trainer = types.SimpleNamespace(cfg=types.SimpleNamespace(rollout=types.SimpleNamespace(decoder="static")),
                                    policy=types.SimpleNamespace(device=torch.device("cuda"), static_decoder=decoder))
    assert scripts.runs.decoder_used(trainer) == "static loop, NOT captured (0 graphs made, 0 replays)"
    ids = torch.randint(8, 200, (2, 4), generator=torch.Generator().manual_seed(0))
    decoder.decode(ids, torch.ones_like(ids), max_new_tokens=3, stop_ids=[1], pad_id=0, temperature=1.0)
    assert scripts.runs.decoder_used(trainer) == "static loop, captured" and decoder.replays == 2
