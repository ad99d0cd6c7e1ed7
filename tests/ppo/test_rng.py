"""Random states: what is drawn after a restore is what was drawn after the capture."""

from __future__ import annotations

import random

import numpy as np
import torch

from homerlhf.ppo.rng import capture_rng_state, restore_rng_state


def _draw(gen: torch.Generator) -> list[float]:
    return [random.random(), random.gauss(0, 1), float(np.random.rand()), float(np.random.randn()),
            float(torch.rand(1)), float(torch.rand(1, generator=gen))]


def test_restore_replays_every_generator_after_a_round_trip_through_torch_save(tmp_path):
    gen = torch.Generator().manual_seed(3)
    random.gauss(0, 1)  # python and numpy keep a cached gaussian: it must travel too
    np.random.randn()
    torch.save(capture_rng_state({"minibatch": gen}), tmp_path / "rng.pt")
    first = _draw(gen)
    other = torch.Generator().manual_seed(99)
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True), {"minibatch": other})
    assert _draw(other) == first
