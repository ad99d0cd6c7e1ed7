"""The 4-bit base, LoRA adapters, value head; log-prob computation in chunks."""
