"""Pipeline stages: sft, reward, ppo and the demo orchestration."""
