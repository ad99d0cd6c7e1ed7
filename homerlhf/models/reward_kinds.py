"""Where a reward model can run, from what its files are: ``reward.backend: auto`` chooses among these.

- a llama.cpp export (``manifest.json`` + ``backbone.gguf``, or a run's ``gguf/`` alone) or a ``.gguf``
  file: ``llamacpp`` only;
- an HF sequence classifier (a dir with ``config.json``, or a reward run's merged ``model/``):
  ``llamacpp`` (exported on first use) and ``hf``;
- a reward run whose ``adapter/`` was trained on the policy's own base (:func:`check_same_base`):
  ``adapter`` too;
- a name that is no path here (a hub id, a run not trained yet): what ``homerlhf reward`` makes of the
  policy's base, all three (the start of a run checks again, and refuses what does not hold).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from homerlhf.errors import UserError

ALL = ("llamacpp", "adapter", "hf")


def _local(name: str, build: bool = False) -> Optional[Path]:
    """The local path of ``name``, or None; a ``builtin:`` model is built only with ``build``."""
    from homerlhf.models.registry import PREFIX, resolve_model

    if name.startswith(PREFIX) and not build:
        return None
    try:
        path = Path(resolve_model(name)).expanduser()
    except UserError:
        return None
    return path if path.exists() else None


def possible_reward_backends(reward_model: Optional[str], policy_model: Optional[str] = None, *,
                             build: bool = False) -> list[str]:
    """The backends ``reward_model`` can be served by (see the module docstring), in
    :data:`ALL`'s order. ``policy_model``: the policy's model, whose base a reward adapter must share
    (checked when it is on this machine; nothing is downloaded). ``build``: build a ``builtin:`` model
    to look at it (a run's start does; ``homerlhf plan`` does not, and counts all three)."""
    if not reward_model:
        return ["llamacpp"]  # a remote worker (reward.url) or nothing to load
    if Path(reward_model).expanduser().suffix == ".gguf":  # a GGUF reward model: llama.cpp's alone
        return ["llamacpp"] if Path(reward_model).expanduser().is_file() else list(ALL)
    path = _local(reward_model, build)
    if path is None:
        return _builtin_kinds(reward_model) or list(ALL)
    if path.is_file():
        return []
    found = []
    gguf = (path / "manifest.json").is_file() or (path / "gguf" / "manifest.json").is_file()
    hf = (path / "config.json").is_file() or (path / "model" / "config.json").is_file()
    if gguf or hf:
        found.append("llamacpp")
    if _same_base_adapter(path, policy_model, build):
        found.append("adapter")
    if hf:
        found.append("hf")
    return found


def _builtin_kinds(name: str):
    from homerlhf.models.registry import builtin_reward_backends

    return builtin_reward_backends(name)


def assumed_note(reward_model: Optional[str]) -> str:
    """A line for a plan whose reward model is not on this machine (its backends are assumed, not read
    from its files); '' when they were read."""
    if not reward_model or _local(reward_model) is not None or _builtin_kinds(reward_model):
        return ""
    return (f"the reward model {reward_model} is not on this machine yet: the placements count reward.backend=adapter "
            "as if it will be a LoRA reward run on the policy's own base (homerlhf reward makes one with "
            "rm.method=lora); a run's start reads its files and refuses what does not hold")


def named_backend_note(backend: str, reward_model: Optional[str], possible: list[str]) -> str:
    """A line for a plan whose named ``reward.backend`` is none of those ``possible`` for
    ``reward_model`` (:func:`possible_reward_backends`): the plan counts it as named, a run's start
    refuses it. '' when it is one of them, or names no model backend (``auto``, ``function``)."""
    if backend not in ALL or backend in possible or not reward_model:
        return ""
    fix = ("train a LoRA reward model on the policy's base (`homerlhf reward --set rm.method=qlora`) and name "
           "its run dir as reward.model" if backend == "adapter" else f"use reward.backend={' or '.join(possible)}")
    return (f"reward.backend={backend}: the reward model {reward_model} runs on {' or '.join(possible) or 'no backend'} "
            f"only, so a run's start refuses it; {fix}, or set reward.backend=auto")


def _same_base_adapter(path: Path, policy_model: Optional[str], build: bool) -> bool:
    from homerlhf.models.reward_adapter import check_same_base, reward_adapter_dir

    policy_dir = _local(policy_model, build) if policy_model else None  # a hub id is not fetched: train checks
    try:
        reward_adapter_dir(path)
        if policy_dir is not None:
            check_same_base(path, policy_dir)
    except UserError:
        return False
    return True
