"""Model names -> local HF model directories, for the exports (moving to ``homerlhf.models``, issue 13).

The GGUF export itself lives in :mod:`homerlhf.workers.gguf`; its public names are re-exported
here for older imports.
"""

from __future__ import annotations

import os
from pathlib import Path

from homerlhf.errors import UserError


def resolve_model_dir(model: str) -> Path:
    """A local HF model directory for ``model`` (``builtin:<name>``, a directory, or a hub id)."""
    if model.startswith("builtin:"):
        from homerlhf.stages.builtin import resolve_model  # Task D's; lazy: it builds models

        model = resolve_model(model)
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"model path {path} is a file; pass the HF model directory that holds config.json")
        return path
    looks_local = model.startswith((".", "/", "~")) or model.count("/") != 1 or os.sep in model.replace("/", "", 1)
    if looks_local:
        raise UserError(f"model directory {model} does not exist; check the path")
    return _hub_snapshot(model)


def _hub_snapshot(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(repo_id, local_files_only=True))
        except Exception:
            if os.environ.get("HF_HUB_OFFLINE") == "1":
                raise
            return Path(snapshot_download(repo_id))
    except Exception as exc:  # any hub failure means the same thing to the user
        raise UserError(
            f"model {repo_id!r} was not found locally and the hub is unreachable ({type(exc).__name__}); "
            f"pass a local HF model directory, or download it first (huggingface-cli download {repo_id})"
        ) from None


from homerlhf.workers.gguf import (  # noqa: E402  (re-exports; gguf imports this module lazily)
    FORMAT_VERSION,
    OUTTYPES,
    SUPPORTED_ARCHS,
    checkpoint_tensors,
    export_ref,
    export_reward,
    nf4_tensors,
    permute_qk,
    reward_model_dir,
)

__all__ = [
    "FORMAT_VERSION", "OUTTYPES", "SUPPORTED_ARCHS", "checkpoint_tensors", "export_ref", "export_reward",
    "nf4_tensors", "permute_qk", "resolve_model_dir", "reward_model_dir",
]
