"""Full run checkpoints: atomic writes, the last K kept, loading, resume-compatibility checks.

A checkpoint is the directory ``RUN_DIR/checkpoints/iter_XXXXXX/`` (:func:`save_checkpoint` lists its
files), written into ``checkpoints/.tmp-iter_XXXXXX-<pid>/``, every file and the directory fsynced,
then renamed into place and the parent fsynced: a crash at any moment leaves either the previous
checkpoints plus a ``.tmp-`` directory (ignored and later removed), or a complete new one whose
manifest (:mod:`homerlhf.ppo.manifest`, written last) matches its files. ``.pt`` files are our own
tensors and containers, loaded with ``torch.load(..., weights_only=True)``. What reads a checkpoint
first checks its files against the manifest (:func:`verify_checkpoint`). The random states are
:mod:`homerlhf.ppo.rng`'s; what ``--resume`` adds is :mod:`homerlhf.ppo.resuming`. docs/checkpoints.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from safetensors.torch import load_file

from homerlhf.config import to_yaml
from homerlhf.errors import UserError
from homerlhf.ppo.manifest import (FORMAT_VERSION, MANIFEST, checkpoint_problem, is_complete,  # noqa: F401
                                   read_manifest, write_manifest)
from homerlhf.ppo.rng import capture_rng_state, restore_rng_state

CHECKPOINTS = "checkpoints"
POLICY_FILES = ("actor/", "config.yaml")  # what a policy export and the app's Evaluate tab read
LOG_FILES = ("metrics.jsonl", "samples.jsonl")
_NAME = re.compile(r"^iter_(\d{6,})$")

# Config keys whose change makes a checkpoint unusable: other weights, other tensor shapes, other
# optimizer state layout, or a data cursor that points into another dataset. Everything else
# (ppo.iterations, learning rates, kl_coef, logging, checkpoint cadence, ...) may change on resume.
INCOMPATIBLE_KEYS = (
    "model.name_or_path",
    "model.revision",
    "quant.load_in_4bit",
    "quant.quant_type",
    "quant.double_quant",
    "quant.compute_dtype",
    "actor.lora.r",
    "actor.lora.alpha",
    "actor.lora.target_modules",
    "actor.optimizer",
    "critic.lora.r",
    "critic.lora.alpha",
    "critic.lora.target_modules",
    "critic.optimizer",
    "critic.shared_adapter",
    "critic.model",
    "algorithm",
    "data.prompts",
    "data.split",
)

# Fault injection for the crash-during-save test: with HOMERLHF_FAULT_KILL_IN_CHECKPOINT=N the
# process SIGKILLs itself while checkpoint N is half written (adapters on disk, no manifest).
FAULT_ENV = "HOMERLHF_FAULT_KILL_IN_CHECKPOINT"


# -- small file helpers ------------------------------------------------------------------------
def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dotted(data: Mapping[str, Any], key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:06d}"


# -- config fingerprint and the resume check ---------------------------------------------------
def config_fingerprint(config) -> str:
    """sha256 over the values of ``INCOMPATIBLE_KEYS``: equal fingerprints resume safely."""
    data = config.model_dump(mode="json") if hasattr(config, "model_dump") else dict(config)
    subset = {key: _dotted(data, key) for key in INCOMPATIBLE_KEYS}
    return hashlib.sha256(json.dumps(subset, sort_keys=True).encode()).hexdigest()


def incompatible_difference(saved, new) -> Optional[tuple[str, Any, Any]]:
    """The first ``(key, saved_value, new_value)`` among ``INCOMPATIBLE_KEYS`` that differs, or None.

    ``saved``/``new``: ``RunConfig`` or its ``model_dump(mode="json")`` dict.
    """
    saved_d = saved.model_dump(mode="json") if hasattr(saved, "model_dump") else saved
    new_d = new.model_dump(mode="json") if hasattr(new, "model_dump") else new
    saved_d = {"algorithm": "ppo", **saved_d}  # written before there was a choice
    for key in INCOMPATIBLE_KEYS:
        old_value, new_value = _dotted(saved_d, key), _dotted(new_d, key)
        if old_value != new_value:
            return key, old_value, new_value
    return None


def check_resume_compatible(saved, new, where: str | Path) -> None:
    """Raise a one-line ``UserError`` naming the first incompatible key that changed."""
    diff = incompatible_difference(saved, new)
    if diff is not None:
        key, old_value, new_value = diff
        raise UserError(
            f"cannot resume {where}: config key '{key}' differs from the checkpoint's "
            f"({old_value!r} there, {new_value!r} now); drop that change, or start a new run with --out"
        )


# -- the metrics / samples logs ---------------------------------------------------------------
def log_offsets(run_dir: str | Path) -> dict[str, int]:
    """Byte size of each append-only log in the run dir (0 for one not written yet)."""
    run_dir = Path(run_dir)
    return {name: (run_dir / name).stat().st_size if (run_dir / name).exists() else 0 for name in LOG_FILES}


# -- finding and verifying checkpoints ---------------------------------------------------------
def _numbered(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def _sealed_in(root: Path) -> list[Path]:
    return [p for p in _numbered(root) if read_manifest(p) is not None]


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Every ``iter_*`` folder of a run, oldest first, sealed or not: checkpoints are written under
    ``.tmp-`` names and renamed once sealed, so one without a readable manifest was damaged since."""
    return _numbered(Path(run_dir) / CHECKPOINTS)


def sealed_checkpoints(run_dir: str | Path) -> list[Path]:
    """The checkpoints of a run whose manifest was written, oldest first, whatever became of their
    files since (:func:`verify_checkpoint` says)."""
    return _sealed_in(Path(run_dir) / CHECKPOINTS)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The complete checkpoints of a run (every file of the size its manifest records), oldest first."""
    return [p for p in sealed_checkpoints(run_dir) if is_complete(p)]


def verify_checkpoint(ckpt: str | Path, files: Sequence[str] = (),
                      fix: Optional[Callable[[Optional[Path]], str]] = None) -> None:
    """Refuse, in one ``UserError`` line naming the file, a checkpoint whose files are not what its
    manifest recorded: sizes first, then sha256 (:func:`homerlhf.ppo.manifest.checkpoint_problem`).

    ``files``: what the caller loads, as paths or folder prefixes (``POLICY_FILES``); empty: all.
    ``fix(fallback)``: the advice of the caller's command, given the newest earlier checkpoint
    whose same files are intact (None when there is none).
    """
    ckpt = Path(ckpt)
    problem = checkpoint_problem(ckpt, files)
    if problem is None:
        return
    here = _NAME.match(ckpt.name)
    number = int(here.group(1)) if here else -1
    earlier = [p for p in _sealed_in(ckpt.parent) if int(_NAME.match(p.name).group(1)) < number]
    fallback = next((p for p in reversed(earlier) if checkpoint_problem(p, files) is None), None)
    if fix is not None:
        advice = fix(fallback)
    else:
        advice = f"use {fallback.name} instead" if fallback else "no earlier checkpoint is intact"
    raise UserError(f"checkpoint {ckpt}: {problem}; {advice}")


def latest_complete_checkpoint(run_dir: str | Path) -> Optional[Path]:
    """The newest complete checkpoint, or None. Half-written ones (``.tmp-*``, or no manifest) are skipped."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


# -- saving ------------------------------------------------------------------------------------
def _maybe_fault(iteration: int) -> None:
    if os.environ.get(FAULT_ENV) == str(iteration):
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class RunState:
    """The live objects a checkpoint saves and restores. ``policy``: has ``save(dir)`` (adapters in
    peft format + ``value_head.safetensors``); ``optimizers``: name -> object with ``state_dict()``;
    ``stateful``: name -> object whose ``state_dict()`` is JSON-able (KL controller, score normaliser);
    ``generators``: name -> ``torch.Generator``; ``counters``: the trainer's JSON-able counters."""

    policy: Any = None
    optimizers: Mapping[str, Any] = field(default_factory=dict)
    stateful: Mapping[str, Any] = field(default_factory=dict)
    generators: Mapping[str, torch.Generator] = field(default_factory=dict)
    counters: Mapping[str, Any] = field(default_factory=dict)


def save_checkpoint(run_dir: str | Path, iteration: int, state: RunState, config, *, keep: int = 3,
                    rng_state: Optional[Mapping[str, Any]] = None,
                    write_extra: Optional[Callable[[Path], None]] = None) -> Path:
    """Write ``RUN_DIR/checkpoints/iter_XXXXXX`` atomically and keep the newest ``keep``. It holds:

    - ``actor/``, ``critic/``: the LoRA adapters in peft format (no ``critic/`` when shared);
    - ``value_head.safetensors``: the critic's fp32 value head (none for GRPO/RLOO: no critic);
    - ``optimizers.pt``: ``{name: optimizer.state_dict()}``;
    - ``rng.pt``: python, numpy, torch, CUDA and named ``torch.Generator`` states;
    - ``trainer_state.json``: iteration, data cursor, KL controller, score normaliser, the byte offsets
      of ``metrics.jsonl`` / ``samples.jsonl`` at save time and the config fingerprint;
    - ``config.yaml``: the resolved run config;
    - ``buffer/``: the asynchronous mode's batch sampled ahead, if one is pending (``write_extra``);
    - ``MANIFEST.json``: every file above with its size and sha256, written last.

    ``rng_state``: a :func:`capture_rng_state` result (default: captured now, with ``state.generators``);
    a caller that checkpoints the state from before an abandoned half iteration passes its own.
    ``write_extra(dir)``: adds files of its own. The logs' byte offsets are their sizes now.
    """
    run_dir = Path(run_dir)
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(iteration)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    state.policy.save(tmp)
    _maybe_fault(iteration)
    torch.save({k: opt.state_dict() for k, opt in state.optimizers.items()}, tmp / "optimizers.pt")
    torch.save(dict(rng_state) if rng_state is not None else capture_rng_state(state.generators), tmp / "rng.pt")
    saved = {
        "format": FORMAT_VERSION,
        "iteration": iteration,
        "trainer": dict(state.counters),
        "stateful": {k: obj.state_dict() for k, obj in state.stateful.items()},
        "logs": log_offsets(run_dir),
        "config_fingerprint": config_fingerprint(config),
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (tmp / "trainer_state.json").write_text(json.dumps(saved, indent=1))
    (tmp / "config.yaml").write_text(to_yaml(config))
    if write_extra is not None:
        write_extra(tmp)

    _seal(tmp, iteration)
    final = _move_into_place(tmp, root / name)
    prune_checkpoints(run_dir, keep)
    return final


def _seal(tmp: Path, iteration: int) -> None:
    """fsync every file and directory under ``tmp``, then write the manifest (sizes and sha256) last:
    until it exists, nothing there counts as a checkpoint."""
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        _fsync_file(path)
    for sub in sorted((p for p in tmp.rglob("*") if p.is_dir()), reverse=True):
        _fsync_dir(sub)
    _fsync_file(write_manifest(tmp, iteration))
    _fsync_dir(tmp)


def _move_into_place(tmp: Path, final: Path) -> Path:
    """Rename the sealed ``tmp`` to ``final`` (replacing a checkpoint of the same iteration) and
    fsync the parent directory."""
    if final.exists():  # the same iteration saved again (a stop right after a periodic save)
        old = final.parent / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)
    return final


def prune_checkpoints(run_dir: str | Path, keep: int) -> None:
    """Remove all but the newest ``keep`` complete checkpoints, and leftovers of interrupted saves."""
    root = Path(run_dir) / CHECKPOINTS
    complete = list_checkpoints(run_dir)
    for old in complete[: max(len(complete) - keep, 0)]:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in root.glob(".tmp-*"):
        if not leftover.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(leftover, ignore_errors=True)
    for leftover in root.glob(".old-*"):
        shutil.rmtree(leftover, ignore_errors=True)


# -- loading -----------------------------------------------------------------------------------
def load_adapters(policy, ckpt: str | Path) -> None:
    """Copy the checkpoint's adapter weights and value head into an already built ``policy``."""
    from peft.utils import set_peft_model_state_dict  # late: peft adds ~5 s to importing the trainer (measured)

    ckpt = Path(ckpt)
    adapters = ["actor"] if policy.shared_adapter else ["actor", "critic"]
    for adapter in adapters:
        path = ckpt / adapter / "adapter_model.safetensors"
        if not path.is_file():
            raise UserError(f"checkpoint {ckpt} has no {adapter} adapter ({path.name}); "
                            "it was written with another critic.shared_adapter setting")
        weights = load_file(str(path), device=str(policy.device))
        result = set_peft_model_state_dict(policy.peft_model_of(adapter), weights, adapter_name=adapter)
        unexpected = getattr(result, "unexpected_keys", None) or []
        if unexpected:
            raise UserError(f"checkpoint {ckpt}: {adapter} adapter does not fit the model "
                            f"(unexpected key {unexpected[0]}); resume with the run's own model and LoRA settings")
    if policy.has_critic:
        policy.load_value_head(ckpt / "value_head.safetensors")


def load_optimizers(path: Path, optimizers: Mapping[str, Any]) -> None:
    """Optimizer states saved from any device, loaded onto the CPU and handed to each optimizer,
    which places them beside its parameters (torch's and bitsandbytes' ``load_state_dict`` both do).
    Loading them straight onto a GPU would also put torch AdamW's ``step`` counters there, where a
    fresh optimizer keeps them on the CPU (each step would then read them back from the GPU)."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    for name, opt in optimizers.items():
        opt.load_state_dict(saved[name])
        _back_into_paged_buffers(opt)


def _back_into_paged_buffers(opt) -> None:
    """A bitsandbytes paged optimizer keeps its large states in unified memory, which the GPU pages
    out under pressure (the memory plan counts them outside torch's allocator); its
    ``load_state_dict`` moves them into ordinary GPU memory. Copy them back into buffers of the
    optimizer's own making (``get_state_buffer``: paged where a fresh run's are)."""
    if not getattr(opt, "is_paged", False) or not hasattr(opt, "get_state_buffer"):
        return
    for param, state in opt.state.items():
        for key in ("state1", "state2"):
            value = state.get(key)
            if isinstance(value, torch.Tensor) and not getattr(value, "is_paged", False):
                buffer = opt.get_state_buffer(param, dtype=value.dtype)
                if getattr(buffer, "is_paged", False):
                    buffer.copy_(value.reshape(buffer.shape))
                    state[key] = buffer


def load_checkpoint(ckpt: str | Path, state: RunState, restore_rng: bool = True) -> dict[str, Any]:
    """Restore everything :func:`save_checkpoint` wrote into ``state``'s live objects (its ``counters``
    are not read: they are returned). Returns the ``trainer_state.json`` dict (``iteration``,
    ``trainer`` counters, ``logs`` offsets)."""
    ckpt = Path(ckpt)
    verify_checkpoint(ckpt)  # hashed once per process: after find_resume_checkpoint's, only a stat per file
    saved = json.loads((ckpt / "trainer_state.json").read_text())
    if state.policy is not None:
        load_adapters(state.policy, ckpt)
    if state.optimizers:
        load_optimizers(ckpt / "optimizers.pt", state.optimizers)
    for name, obj in state.stateful.items():
        obj.load_state_dict(saved["stateful"][name])
    if restore_rng:
        restore_rng_state(torch.load(ckpt / "rng.pt", map_location="cpu", weights_only=True), state.generators)
    return saved
