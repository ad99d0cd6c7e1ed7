"""The static decoder counts the captured steps it replays (``StaticDecoder.replays``): what lets
``homerlhf check`` say "captured" only once a graph was made *and* ran. Counted on the CPU
through the code that owns it, :class:`StepGraphs` with its four CUDA primitives replaced (a "graph"
replays the step eagerly); the eager loop (no graphs, the CPU's) replays nothing."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from homerlhf.models.decode_graphs import StepGraphs
from homerlhf.models.static_decode import StaticDecoder


class StandInGraphs(StepGraphs):
    """StepGraphs on the CPU: a stream and a pool are names, a captured "graph" replays the step."""

    def __init__(self):
        super().__init__("cpu")

    def new_stream(self):
        return "stream"

    def new_pool(self):
        return "pool"

    @contextlib.contextmanager
    def on_stream(self, stream):
        yield

    def capture_graph(self, step, stream, pool):
        return types.SimpleNamespace(replay=step)


@pytest.fixture(scope="module")
def tiny_lm(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), attn_implementation="sdpa").eval()


def _decode(decoder, rows: int, new_tokens: int):
    torch.manual_seed(0)
    ids = torch.randint(8, 200, (rows, 6))
    return decoder.decode(ids, torch.ones_like(ids), max_new_tokens=new_tokens, stop_ids=[1], pad_id=0,
                          temperature=1.0)


def test_every_step_after_the_first_token_is_a_counted_replay(tiny_lm):
    """T new tokens take T - 1 steps (the first token comes from the prefill's logits; the stop check
    every 8 steps never cuts a call of 5 short): 3 calls of one shape are 1 capture and 3 x 4 = 12
    replays; a 2-token call of another shape captures again and replays once: 2 and 13."""
    decoder = StaticDecoder(tiny_lm, graphs=StandInGraphs())
    for _ in range(3):
        _decode(decoder, rows=3, new_tokens=5)
    assert (decoder.graphs_captured, decoder.replays) == (1, 12)
    _decode(decoder, rows=2, new_tokens=2)
    assert (decoder.graphs_captured, decoder.replays) == (2, 13)


def test_the_eager_loop_replays_nothing(tiny_lm):
    decoder = StaticDecoder(tiny_lm)  # on the CPU: no graphs, the step runs eagerly
    out = _decode(decoder, rows=3, new_tokens=5)
    assert out.shape == (3, 5) and (decoder.graphs_captured, decoder.replays) == (0, 0)
