"""The Evaluate tab's models: one run checkpoint at a time, answering side by side
(:mod:`homerlhf.models.side_by_side`), scored by the run's reward model, whose live worker is
reused while the run is going.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional

from homerlhf.app import runs
from homerlhf.errors import UserError
from homerlhf.models.side_by_side import Answer, EvalModels, Sampling

__all__ = ["Answer", "EvalModels", "Sampling", "get_models", "load_models", "reward_backend", "unload_all"]


def reward_backend(cfg, run_dir: Path, tokenizer):
    """The run's reward model as a ``RewardBackend``, built the way the trainer builds it.

    For ``llamacpp`` the run's own worker is reused while it answers (no second copy of the
    model); otherwise a worker of our own is started on the same exported model.
    """
    from homerlhf.stages.scorers import scoring_reward

    if cfg.reward.backend == "llamacpp" and not cfg.reward.components:  # a weighted sum is more than that worker
        from homerlhf.workers.backends import connect
        from homerlhf.workers.vocab import tokenizer_fingerprint

        live = runs.worker_urls(run_dir).get("reward")
        if live and not cfg.reward.url and runs.run_status(run_dir).running:
            try:
                return connect("reward", url=live, fingerprint=tokenizer_fingerprint(tokenizer))
            except Exception:  # noqa: BLE001 - the run's worker went away: start our own below
                pass
    return scoring_reward(cfg, tokenizer)


def checkpoint_config(run_dir: str | Path, checkpoint: str | Path):
    """The config a checkpoint was trained with: its run's, or (a dpo / kto run keeps one per checkpoint) its own."""
    cfg = runs.run_config(run_dir)
    if cfg is None and (Path(checkpoint) / "config.yaml").is_file():
        from homerlhf.config import from_yaml_file

        cfg = from_yaml_file(Path(checkpoint) / "config.yaml")
    if cfg is None:
        raise UserError(f"{run_dir} has no run config yet; start the run or attach to a finished one")
    return cfg


def load_models(run_dir: str | Path, checkpoint: str | Path, with_reward: bool = True,
                right: Optional[str | Path] = None) -> EvalModels:
    """A checkpoint of the run in ``run_dir``, loaded with the run's config and reward model; ``right``:
    a checkpoint of the same base to answer on the right (None: the base, adapter off)."""
    run_dir = Path(run_dir)
    cfg = checkpoint_config(run_dir, checkpoint)
    if right is not None:
        other = checkpoint_config(Path(right).parent.parent, right).model.name_or_path
        if other != cfg.model.name_or_path:
            raise UserError(f"{Path(right).name} was trained on {other}, not on {cfg.model.name_or_path}: compare "
                            "with the base or a checkpoint of the same model")
    reward = (lambda cfg, tokenizer: reward_backend(cfg, run_dir, tokenizer)) if with_reward else None
    return EvalModels(cfg, checkpoint, reward=reward, right=right)


_LOADED: dict[tuple, EvalModels] = {}
_LOAD_LOCK = threading.Lock()


def get_models(run_dir: str | Path, checkpoint: str | Path, right: Optional[str | Path] = None) -> EvalModels:
    """The loaded checkpoint (and the one compared on the right), kept while in use (one at a time: memory
    is scarce)."""
    key = (str(Path(run_dir).resolve()), str(Path(checkpoint).resolve()), str(Path(right).resolve()) if right else "")
    with _LOAD_LOCK:
        if key not in _LOADED:
            _drop_loaded()
            _LOADED[key] = load_models(run_dir, checkpoint, right=right)
        return _LOADED[key]


def unload_all() -> None:
    with _LOAD_LOCK:
        _drop_loaded()


def _drop_loaded() -> None:
    """Close the loaded checkpoint and free its memory before another loads: its 4-bit layers are
    reference cycles (bitsandbytes' ``Params4bit.module``), gone only once collected."""
    from homerlhf.memory.oom import free_memory

    while _LOADED:
        _LOADED.popitem()[1].close()
    free_memory()
