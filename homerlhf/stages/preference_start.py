"""Where a DPO / KTO run starts: the policy it trains and the reference it is held to.

``--model`` (or ``dpo.base`` / ``kto.base``, else ``model.name_or_path``) names one of:

- a model: a local HF dir, a hub id, ``builtin:<name>``, or an SFT run dir (its ``model/``): a new
  LoRA (``actor.lora``) on it, the reference the model itself (adapters off);
- a PPO / GRPO / RLOO run dir, or a DPO / KTO run dir: its newest checkpoint's ``actor`` adapter,
  checked against the checkpoint's manifest, trained further on that run's base, with that run's
  LoRA and 4-bit settings; the reference is the adapter as it was loaded (TRL's ``ref`` adapter, a
  copy of the LoRA weights only: one base in memory);
- one checkpoint dir of such a run (``RUN/checkpoints/iter_000012``).

Everything here reads files only: a bad start is one line before any weight is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from homerlhf.errors import UserError

START_FILE = "start.json"  # in each DPO / KTO checkpoint: what the run started from
RUN_FILE = "preference_run.json"


@dataclass(frozen=True)
class Start:
    """The policy a run starts from. ``adapter``: the actor adapter trained further (None: a new LoRA)."""

    name: str  # as given
    kind: str  # "model", "sft run", "ppo run" (any RL algorithm) or "dpo run" / "kto run"
    base: str  # model.name_or_path of the policy's base
    adapter: Optional[str] = None
    checkpoint: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "base": self.base, "adapter": self.adapter,
                "checkpoint": self.checkpoint}


def _run_kind(run_dir: Path) -> str:
    import json

    summary = run_dir / RUN_FILE
    if summary.is_file():
        return f"{json.loads(summary.read_text()).get('stage', 'dpo')} run"
    for ckpt in sorted((run_dir / "checkpoints").glob("iter_*"), reverse=True):
        start = ckpt / START_FILE
        if start.is_file():
            return f"{json.loads(start.read_text()).get('method', 'dpo')} run"
    return "ppo run"


def _from_checkpoint(name: str, ckpt: Path, kind: str) -> tuple[Start, Any]:
    """The checkpoint's actor adapter on its run's base; returns the start and the run's config."""
    from homerlhf.ppo.checkpoint import POLICY_FILES, verify_checkpoint
    from homerlhf.ppo.resuming import saved_config

    verify_checkpoint(ckpt, POLICY_FILES)  # the adapter and config are what the manifest recorded
    actor = ckpt / "actor"
    if not (actor / "adapter_config.json").is_file() or not (actor / "adapter_model.safetensors").is_file():
        raise UserError(f"checkpoint {ckpt} has no actor adapter (actor/adapter_model.safetensors); "
                        "start from a checkpoint of a `homerlhf train`, dpo or kto run, or from a model")
    saved = saved_config(ckpt)
    return Start(name, kind, saved.model.name_or_path, str(actor), str(ckpt)), saved


def resolve_start(name: str) -> tuple[Start, Optional[Any]]:
    """``(start, the config of the run it comes from or None)`` for the name given; one-line errors."""
    from homerlhf.ppo.checkpoint import checkpoint_dirs, sealed_checkpoints

    path = Path(name).expanduser()
    if not path.is_dir():
        return Start(name, "model", name), None  # a hub id or builtin name: resolved when loaded
    if (path / "MANIFEST.json").is_file() and path.name.startswith("iter_"):
        return _from_checkpoint(name, path, _run_kind(path.parent.parent))
    if (path / "checkpoints").is_dir():
        found = sealed_checkpoints(path)
        if not found:
            dirs = checkpoint_dirs(path)
            what = f"its {len(dirs)} checkpoint dirs have no manifest" if dirs else "it has no checkpoint yet"
            raise UserError(f"--model {name}: a run dir without a complete checkpoint ({what}); "
                            "give a finished run, one of its checkpoints, or a model")
        return _from_checkpoint(name, found[-1], _run_kind(path))
    if (path / "model" / "config.json").is_file():
        return Start(name, "sft run", str(path.resolve() / "model")), None
    if (path / "config.json").is_file():
        return Start(name, "model", str(path.resolve())), None
    raise UserError(f"--model {name}: neither a model dir (config.json), an SFT run (model/), nor a run with "
                    "checkpoints; give one of those, a hub id or builtin:<name>")


def start_config(cfg, start: Start, run_cfg):
    """``cfg`` with the policy's base, and for an adapter start the 4-bit and LoRA settings of the run
    that trained it (the adapter's shapes and the base it was trained on)."""
    from homerlhf.config.schema import RunConfig

    data = cfg.model_dump(mode="json")
    data["model"] = {**data["model"], "name_or_path": start.base}
    if run_cfg is not None:
        saved = run_cfg.model_dump(mode="json")
        data["model"] = {**saved["model"], "name_or_path": start.base}
        data["quant"], data["actor"] = saved["quant"], saved["actor"]
    return RunConfig.model_validate(data)


def check_start_unchanged(start: Start) -> None:
    """On resume: the adapter the run started from is still what its checkpoint's manifest recorded."""
    if start.checkpoint is None:
        return
    ckpt = Path(start.checkpoint)
    if not ckpt.is_dir():
        raise UserError(f"cannot resume: the run started from {ckpt}, which is gone; its reference cannot be "
                        "rebuilt: start a new run with --out")
    from homerlhf.ppo.checkpoint import POLICY_FILES, verify_checkpoint

    verify_checkpoint(ckpt, POLICY_FILES)
