"""``actor.lr: auto``: the actor's LoRA learning rate by the policy's size, and where each figure comes from.

A LoRA with alpha fixed (ours: r 16, alpha 32 on every linear layer) wants about the same learning rate at any
rank, and a smaller one the larger the model (Thinking Machines' "LoRA Without Regret", 2025, as TRL
reproduces it). RL with such LoRAs, published with their models:

- Qwen3-0.6B, GRPO, LoRA alpha 32 on all linear layers: 5e-5 (TRL, docs/source/lora_without_regret.md);
- SmolLM3-3B, GRPO, LoRA alpha 32 on all linear layers: 1e-5 (the same page's table);
- Gemma-3-270M on the capitals task (benchmarks/real_learning.py, docs/learning.md): 3e-6 to 3e-5 moved
  neither GRPO nor PPO in 12 iterations; at 1e-4 GRPO raised the held-out score on each of 3 seeds (+0.29
  +- 0.35, KL at most 3.6 under the budget of 6); at 3e-4 both left the KL budget and GRPO gamed the reward.

Between the two peer points the rate falls as 1 / size (5e-5 x 0.6B / N, the line through both); it is held
at 1e-5 above 3B (no published point of ours or theirs goes lower for LoRA RL) and at 1e-4 below 0.3B
(our measurement). ``homerlhf plan`` and a run's start print the rate chosen and why.
"""

from __future__ import annotations

LR_AT_1B = 3e-5  # 5e-5 x 0.6B = 1e-5 x 3B = 3e-5 x 1B
LR_MIN, LR_MAX = 1e-5, 1e-4
SOURCE = "docs/learning.md"


def auto_actor_lr(total_params: int) -> float:
    """The actor's LoRA learning rate for a policy of ``total_params`` parameters (the rule above)."""
    if total_params <= 0:
        raise ValueError(f"total_params must be positive, got {total_params}")
    return min(LR_MAX, max(LR_MIN, LR_AT_1B * 1e9 / total_params))


def auto_lr_line(total_params: int) -> str:
    """What ``actor.lr: auto`` chose, for the plan and a run's start."""
    lr = auto_actor_lr(total_params)
    return f"actor.lr auto: {lr:.1e} for a {total_params / 1e9:.2f}B-parameter policy ({SOURCE})"
