"""Where homerlhf keeps what it builds once and reuses: builtin models, GGUF exports."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """``$HOMERLHF_CACHE`` (default ``~/.cache/homerlhf``) joined with ``parts``, created."""
    root = Path(os.environ.get("HOMERLHF_CACHE") or Path.home() / ".cache" / "homerlhf")
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
