"""The planner against peaks measured on a GPU: an NVIDIA H200 (CUDA 13, torch 2.11, bitsandbytes
0.50.2, 2026-11-30), random weights of the published shapes, homerlhf's own ``PolicyModel`` +
``RLTrainer`` as ``scripts/validate_memory_gpu.py`` runs them (adapter-off reference, an in-process
reward, prompts of full ``max_prompt_len`` random ids, HF ``generate``), the process capped at the
card's size. Measured: ``torch.cuda.max_memory_allocated`` per phase, last of two iterations.

Every phase of the three runs is within 5% of the measurement (docs/memory.md has the table, before
and after this calibration). These are a GPU's numbers, not the planner's own: the test fails when a
change to the planner moves a prediction away from what the card allocated.

The runs kept a 4-bit base's other weights, and so hidden states and KV cache, in fp32 (peft's
``prepare_model_for_kbit_training``, all there was then): they are pinned with
``quant.upcast_non_quantized=true``; and they prefilled each chunk's prompt block in one forward (pinned with
``rollout.prefill_tokens=0``: the pieces came later); and checkpointed every layer, their inputs on the card
(pinned: the presets' ``auto`` may now choose fewer or offload). The compute dtype end to end (the setting's default since) has
not run on a GPU: its plans are predictions (docs/memory.md) until ``homerlhf check`` measures them.
"""

from __future__ import annotations

import pytest

from homerlhf.config import load_config
from homerlhf.memory.components import Assumptions
from homerlhf.memory.planner import plan
from homerlhf.memory.shapes import BUILTIN_SHAPES

# generation, scoring, update: GiB allocated (measured)
MEASURED = {
    "ppo-7b": (11.85, 12.36, 11.49),
    "grpo-1.5b": (3.45, 4.11, 3.08),
    "t4-fp16-1.5b": (2.33, 2.86, 2.54),
}
# preset, model, rollout chunk, micro-batch, prompt + new tokens, extra settings. The script sets the
# batch to 2 chunks and the mini-batch to 1 chunk. Recorded for the 7B and the T4 run; the GRPO run's
# chunk, micro-batch and lengths were not, and these (the 4090 preset's lengths, the 7B run's chunk and
# micro-batch, batch 16 = one chunk) are the settings whose plan is the 3.13 / 3.96 / 2.97 GiB the run
# printed beside its measurement (no other chunk in 4-16, micro-batch in 2-8 or length pair of the
# script's defaults, the T4's or the 4090 preset's gave them, with the planner of then).
RUNS = {
    "ppo-7b": ("4090", "Qwen/Qwen2.5-7B", 16, 4, 512, 256),
    "grpo-1.5b": ("4090", "Qwen/Qwen2.5-1.5B", 16, 4, 512, 256, "algorithm=grpo", "group.size=4",
                  "rollout.batch_size=16"),
    "t4-fp16-1.5b": ("t4-colab", "Qwen/Qwen2.5-1.5B", 8, 2, 384, 192),
}


def run_config(preset, model, chunk, micro, prompt, new, *extra):
    """The config ``scripts/validate_memory_gpu.py`` builds for these settings."""
    return load_config(preset, None, [
        f"rollout.chunk_size={chunk}", f"rollout.batch_size={2 * chunk}", "rollout.generation_chunk=null",
        f"rollout.max_prompt_len={prompt}", f"rollout.max_new_tokens={new}", f"ppo.mini_batch_size={chunk}",
        f"ppo.micro_batch_size={micro}", "ppo.epochs=1", "ref.backend=adapter_off", "reward.backend=hf",
        "reward.model=in-process", "quant.upcast_non_quantized=true", "rollout.prefill_tokens=0",
        "training.checkpoint_every_n_layers=1", "training.activation_offload=false", *extra])


def allocated(run: str, assumptions: Assumptions) -> dict[str, float]:
    preset, model, *settings = RUNS[run]
    result = plan(run_config(preset, model, *settings), BUILTIN_SHAPES[model], 24, assumptions=assumptions,
                  with_suggestion=False)
    return {p.name: p.allocated_gib for p in result.phases}


@pytest.mark.parametrize("run", sorted(RUNS))
def test_the_measured_runs_are_within_five_percent(run):
    # The runs sampled with HF generate; the planner's default also counts the static-cache decoder.
    steady = allocated(run, Assumptions(decoder="hf"))
    predicted = dict(steady)
    if run == "t4-fp16-1.5b":
        # Under fp16 the loss scaler starts at 2**16 and skips a step (dropping its gradients) on each
        # overflow. This run's generation and scoring held neither gradients nor the critic's AdamW
        # states (they are made at the first step), as before any step: with them, the plan is 0.28
        # GiB (+12%) over both measurements, and the update, measured after a step, holds them. What
        # the run's loss scale was is not recorded: this is the reading the numbers allow.
        first = allocated(run, Assumptions(decoder="hf", after_first_step=False))
        predicted.update(generation=first["generation"], scoring=first["scoring"])
    for phase, measured in zip(("generation", "scoring", "update"), MEASURED[run]):
        assert predicted[phase] == pytest.approx(measured, rel=0.05), (run, phase)
