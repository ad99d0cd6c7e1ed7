"""Every random state a PPO iteration draws from, captured for a checkpoint and restored on resume.

Python's, numpy's, torch's and CUDA's global generators, plus named ``torch.Generator`` objects (the
mini-batch shuffles), as tensors and plain containers: ``torch.load(..., weights_only=True)`` reads
them back.
"""

from __future__ import annotations

import random
from typing import Any, Mapping, Optional

import numpy as np
import torch


def capture_rng_state(generators: Optional[Mapping[str, torch.Generator]] = None) -> dict[str, Any]:
    """Every random state a PPO iteration draws from, as tensors and plain containers."""
    version, mt_state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(mt_state), "gauss": gauss},
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "generators": {name: gen.get_state() for name, gen in (generators or {}).items()},
    }
    return state


def restore_rng_state(state: Mapping[str, Any], generators: Optional[Mapping[str, torch.Generator]] = None) -> None:
    """Inverse of :func:`capture_rng_state`. CUDA states are restored only when as many GPUs exist."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state((npst["name"], npst["keys"].numpy().astype(np.uint32), npst["pos"],
                         npst["has_gauss"], npst["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    cuda_states = state.get("cuda") or []
    if cuda_states and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda_states):
        torch.cuda.set_rng_state_all(cuda_states)
    saved_generators = state.get("generators", {})
    for name, gen in (generators or {}).items():
        if name in saved_generators:
            gen.set_state(saved_generators[name])


def sample_seeds(seed: int, iteration: int, n: int) -> list[int]:
    """One seed per sample of an iteration, from the run's seed and the iteration alone: a sample's
    response then does not depend on how the prompts were chunked (or re-chunked after an OOM)."""
    base = (int(seed) * 1_000_003 + int(iteration)) * 100_003
    return [(base + i) % 2**63 for i in range(n)]
