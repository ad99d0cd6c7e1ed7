"""Pipeline stages: sft, reward, ppo and the demo orchestration."""

# Registers builtin:demo-sft and builtin:demo-rm (trained by these stages) with homerlhf.models.registry.
from homerlhf.stages import builtin as _builtin  # noqa: F401
