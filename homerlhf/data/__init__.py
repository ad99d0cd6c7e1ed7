"""Dataset loading and normalisation to prompt and preference records, plus the builtin task."""
