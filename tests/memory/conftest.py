"""The small PPO shape and the hand-made throughputs the time-model tests derive their timelines from."""

from __future__ import annotations

import pytest

from homerlhf.config import load_config
from homerlhf.memory.timing import Throughputs

# 4 sequences in chunks of 2, each 6 prompt + 4 new tokens (L = 10); PPO with actor + critic
# adapters (2 forwards per sequence to score, 2 forward+backward passes per epoch), 1 epoch; the HF
# generate engine named and the llama.cpp engine on every logical core (the preset's: auto, 1 thread;
# tests/memory/test_engine_choice.py).
SMALL = ["rollout.batch_size=4", "rollout.chunk_size=2", "rollout.max_prompt_len=6", "rollout.max_new_tokens=4",
         "ppo.mini_batch_size=2", "ppo.micro_batch_size=2", "ppo.epochs=1", "rollout.engine=hf",
         "rollout.engine_threads=0"]


@pytest.fixture
def small_cfg():
    """``small_cfg(*overrides)``: the cpu-tiny preset at the small shape above."""
    return lambda *extra: load_config("cpu-tiny", None, SMALL + list(extra))


@pytest.fixture
def rates() -> Throughputs:
    """Tokens/s; threads 1 for the trainer when it shares 2 cores with a worker or two, 2 when alone."""
    return Throughputs(
        worker_ref={1: 10.0}, worker_reward={1: 5.0}, llama_gen={2: 1.0},
        trainer_gen={1: 4.0, 2: 8.0}, trainer_forward={1: 20.0, 2: 40.0}, trainer_train={1: 10.0, 2: 20.0},
        source="hand-made",
    )


# The 4090 preset with its placement, generation chunk and checkpointing named (llama.cpp workers, the
# rollout chunk, every layer checkpointed on the card): the tests that pin memory figures of fixed settings.
NAMED = ["ref.backend=llamacpp", "reward.backend=llamacpp", "rollout.generation_chunk=null",
         "training.checkpoint_every_n_layers=1", "training.activation_offload=false"]


@pytest.fixture
def preset_named():
    """``preset_named(name, *overrides)``: a GPU preset with the settings it has ``auto`` named (:data:`NAMED`)."""
    return lambda name="4090", *extra: load_config(name, None, NAMED + list(extra))
