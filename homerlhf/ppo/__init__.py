"""PPO: pure math, rollout, experience, the trainer loop, KL controllers."""
