"""homerlhf: SFT, reward model and PPO on one consumer GPU.

A 4-bit base is shared by a LoRA actor and a LoRA critic on the GPU; the reference and reward
models run on the CPU in llama.cpp worker processes.
"""

__version__ = "0.1.0"
