"""benchmarks/generation_rates.py, what ``bash scripts/gpu_session.sh speed`` times: every timed call
of the loop replays the one session its untimed warm-up built (none is built inside the timing), and
the layer passes whose K/V HF's sdpa repeated are put where they ran: none in a decode step of either
decoder, (pieces - 1) x layers in a prefill made in column pieces, the same for both decoders."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
PROMPT_LEN = 64


@pytest.fixture(scope="module")
def rates():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return runpy.run_path(str(BENCHMARKS / "generation_rates.py"))
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny Llama (2 layers, 4 query heads on 2 K/V heads) as a run loads it, cpu-tiny preset, with
    ``rollout.prefill_tokens=128``: 4 rows x 64 prompt tokens are prefilled in 2 pieces of 32 columns,
    2 rows x 64 in one forward."""
    from homerlhf.config import load_config
    from homerlhf.models.policy import PolicyModel
    from homerlhf.tiny import build_causal_lm

    model_dir = build_causal_lm(tmp_path_factory.mktemp("tiny"), arch="llama", seed=0, hidden=64, layers=2)
    cfg = load_config("cpu-tiny", overrides=[f"model.name_or_path={model_dir}", "ref.backend=adapter_off",
                                             "reward.backend=hf", f"rollout.max_prompt_len={PROMPT_LEN}",
                                             "rollout.prefill_tokens=128", "rollout.batch_size=8",
                                             "ppo.mini_batch_size=4", "ppo.micro_batch_size=2"])
    policy = PolicyModel.from_config(cfg, str(model_dir))
    prompts = torch.randint(8, len(policy.tokenizer), (4, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    return policy, cfg, prompts.tolist()


def test_the_timed_calls_replay_the_session_the_warm_up_built(rates, setup):
    """8 and 32 new tokens timed (the GPU profile's 16 and 64, scaled): before, the warm-up (2 tokens),
    8 and 32 each needed a longer cache and built a session: 3 for 3 calls, 2 of them in the timing.
    Now one, in the untimed warm-up at 32."""
    policy, cfg, prompts = setup
    before = policy.static_decoder.sessions_made
    out = rates["rate"](policy, cfg, "static", 4, prompts, 32)
    assert policy.static_decoder.sessions_made - before == 1
    assert out["sessions_built"] == 0 and out["captured_replays"] == 0  # eager on the CPU: nothing replayed


@pytest.mark.parametrize("decoder, rows, prefill", [("hf", 2, 0), ("hf", 4, 2), ("static", 4, 2)])
def test_kv_repeats_are_counted_where_they_ran(rates, setup, decoder, rows, prefill):
    """2 rows x 64 = 128 prompt tokens: one prefill forward, no mask (HF skips it for unpadded causal
    rows; the loop's first piece has none either): 0. 4 rows: pieces of 128 // 4 = 32 columns, 2 pieces,
    the second masked: 1 piece x 2 layers = 2 passes, both decoders. Decode steps: 0 (no mask for HF;
    the loop folds the query groups)."""
    policy, cfg, prompts = setup
    out = rates["rate"](policy, cfg, decoder, rows, prompts, 4)
    assert out["kv_repeated_decode_layer_passes"] == 0
    assert out["kv_repeated_prefill_layer_passes"] == out["kv_repeated_layer_passes"] == prefill
