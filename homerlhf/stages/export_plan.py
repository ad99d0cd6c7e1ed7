"""What `homerlhf export policy` will do, checked from files alone before a weight loads.

:func:`plan_policy_export` checks the run, the checkpoint (and that its actor is what its manifest
recorded), the adapter, the output dir, the dtype, the architecture and tokenizer for GGUF and the
Hub login, and returns a :class:`PolicyExport`. :mod:`homerlhf.stages.export` runs it and
:mod:`homerlhf.stages.model_card` describes it; both import this module, neither the other.

The dtype: by default the one the policy computed in (:func:`compute_dtype_name`: float32 for a CPU
run, bf16 on most GPUs), so the merged model is the trained policy up to that dtype's rounding;
``--dtype`` chooses another, and the export then says what the rounding cost, measured
(:func:`rounding_note`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from homerlhf.config import RunConfig
from homerlhf.errors import UserError

ACTOR = "actor"
EXPORT_FILE = "export.json"
Progress = Callable[[float, str], None]
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --dtype -> torch's name
FLAGS = {name: flag for flag, name in DTYPES.items()}


@dataclass
class PolicyExport:
    """An export checked and ready to run: nothing here has loaded a weight. ``dtype``: what the merged
    model is saved in; ``compute``: what the policy computed in (torch's names, e.g. ``float32``)."""

    run_dir: Path
    checkpoint: Path
    iteration: int
    cfg: RunConfig
    base_dir: Path
    out: Path
    base: str = "nf4"
    gguf: list[str] = field(default_factory=list)
    hub_repo: Optional[str] = None
    private: bool = False
    overwrite: bool = False
    dtype: str = "float32"
    compute: str = "float32"

    @property
    def name(self) -> str:
        """The file stem of the GGUFs and the Ollama model name: the output dir's name, tidied."""
        return re.sub(r"[^a-z0-9._-]+", "-", self.out.resolve().name.lower()).strip("-.") or "policy"


def compute_dtype_name(cfg: RunConfig) -> str:
    """The dtype the run's policy computed in, as torch names it: ``quant.compute_dtype`` on the run's
    ``card.device``, resolved as the policy resolves it (:func:`homerlhf.models.policy.compute_dtype`)."""
    from homerlhf.models.policy import compute_dtype

    return str(compute_dtype(cfg.quant, cfg.card.device)).removeprefix("torch.")


def export_dtype(asked: Optional[str], compute: str) -> str:
    """``--dtype`` (fp32, bf16, fp16, or torch's name; None or ``auto``: ``compute``) as torch's name."""
    key = (asked or "auto").strip().lower()
    if key == "auto":
        return compute
    if key in DTYPES or key in FLAGS:
        return DTYPES.get(key, key)
    raise UserError(f"--dtype {asked!r} is not known; use fp32, bf16 or fp16, or leave it out for the dtype "
                    "the policy computed in")


def rounding_note(result: dict[str, Any]) -> Optional[str]:
    """A sentence when a merge into the trained-on weights was saved in another dtype than the policy
    computed in: what that rounding cost on the held sequences (the measured gap); else None."""
    dtype, compute = result["dtype"], result.get("compute_dtype", result["dtype"])
    if dtype == compute or result.get("base") != "nf4":
        return None
    gap = result["gap"]
    return (f"saved in {dtype}, not the {compute} the policy computed in: the rounding costs up to "
            f"{gap['max_abs']:.2e} nats/token (mean {gap['mean_abs']:.2e}) on {gap['tokens']} held tokens; "
            f"--dtype {FLAGS.get(compute, compute)} exports the policy as it computed")


def resolve_checkpoint(run_dir: Path, which: str) -> Path:
    """The checkpoint ``--checkpoint`` names: an iteration number, ``last`` or ``best`` (the one whose
    iteration logged the highest ``score_mean``, the mean reward of its rollouts), among those whose
    manifest was written (whether their files still match it is :func:`verify_policy_files`'s)."""
    from homerlhf.ppo.checkpoint import checkpoint_dirs, checkpoint_name, sealed_checkpoints

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory; give the --out of a `homerlhf train` run")
    found, dirs = sealed_checkpoints(run_dir), checkpoint_dirs(run_dir)
    which = str(which).strip().lower()
    if dirs and which == "last":
        return dirs[-1]  # sealed or not: verify_policy_files refuses an unsealed one, never passes it over
    if not found:
        raise UserError(f"{run_dir} has no complete checkpoint: nothing trained to export yet "
                        "(checkpoints are written every checkpoint.every iterations and at the end)")
    if which == "best":
        return _best_checkpoint(run_dir, found)
    iterations = ", ".join(str(int(p.name.split("_")[1])) for p in found)
    if not which.isdigit():
        raise UserError(f"--checkpoint {which!r}: give an iteration number ({iterations}), last or best")
    wanted = run_dir / "checkpoints" / checkpoint_name(int(which))
    if wanted not in found:
        raise UserError(f"--checkpoint {int(which)}: {run_dir} has no complete checkpoint of that iteration; "
                        f"it has {iterations} (or pass last or best)")
    return wanted


def verify_policy_files(ckpt: Path) -> None:
    """Refuse a checkpoint whose actor adapter or config is not what its manifest recorded, naming
    the file and the newest earlier checkpoint to export instead."""
    from homerlhf.ppo.checkpoint import POLICY_FILES, verify_checkpoint

    def fix(fallback: Optional[Path]) -> str:
        if fallback is None:
            return "no earlier checkpoint's actor is intact: restore the file from a backup, or train again"
        return f"export {fallback.name} instead with --checkpoint {int(fallback.name.split('_')[1])}"

    verify_checkpoint(ckpt, POLICY_FILES, fix)


def _best_checkpoint(run_dir: Path, found: list[Path]) -> Path:
    from homerlhf.ppo.metrics import read_metrics

    scores = {int(r["iteration"]): r["score_mean"] for r in read_metrics(run_dir)
              if isinstance(r.get("score_mean"), (int, float))}
    scored = [(scores[int(p.name.split("_")[1])], i, p) for i, p in enumerate(found) if int(p.name.split("_")[1]) in scores]
    if not scored:
        raise UserError(f"--checkpoint best: {run_dir}/metrics.jsonl has no score_mean for any kept checkpoint; "
                        "pass last or an iteration number")
    return max(scored)[2]  # a tie goes to the later checkpoint


def _check_out(out: Path, run_dir: Path, overwrite: bool) -> Path:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; choose a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out {out} already exists and is not empty; pass --overwrite to replace it or choose another --out")
    if out.exists() and (out.resolve() == run_dir.resolve() or out.resolve() in run_dir.resolve().parents):
        raise UserError(f"--out {out} holds the run {run_dir} itself; choose another --out")
    return out


def _check_hub(repo: Optional[str], private: bool) -> None:
    if repo is None:
        if private:
            raise UserError("--private makes sense only with --push-to-hub REPO")
        return
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", repo):
        raise UserError(f"--push-to-hub {repo!r} is not a Hub repo id; use NAME or USER/NAME")
    import huggingface_hub

    if huggingface_hub.get_token() is None:  # read from HF_TOKEN or the saved login, never shown
        raise UserError("--push-to-hub: no Hugging Face login; run `hf auth login` or set HF_TOKEN, then export again")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        raise UserError("--push-to-hub: HF_HUB_OFFLINE is set, so nothing can be uploaded; unset it or drop --push-to-hub")


def plan_policy_export(run_dir: str | Path, out: str | Path, checkpoint: str = "last", base: str = "nf4",
                       gguf: Sequence[str] = (), push_to_hub: Optional[str] = None, private: bool = False,
                       overwrite: bool = False, dtype: Optional[str] = None) -> PolicyExport:
    """Every check the export can make without loading a weight, in one-line ``UserError``s."""
    from homerlhf.models.registry import resolve_model_dir
    from homerlhf.ppo.resuming import saved_config
    from homerlhf.workers.gguf.merge import BASES
    from homerlhf.workers.gguf.policy import check_policy_gguf, parse_types

    if base not in BASES:
        raise UserError(f"--base {base!r} is not known; use nf4 (the weights the actor trained on) or original")
    types = parse_types(gguf)
    export_dtype(dtype, "float32")  # refuses an unknown --dtype before the run is read
    _check_hub(push_to_hub, private)
    run_dir = Path(run_dir)
    out = _check_out(Path(out), run_dir, overwrite)
    ckpt = resolve_checkpoint(run_dir, checkpoint)
    verify_policy_files(ckpt)  # before its config or a weight is read
    if not (ckpt / ACTOR / "adapter_model.safetensors").is_file() or not (ckpt / ACTOR / "adapter_config.json").is_file():
        raise UserError(f"checkpoint {ckpt} has no actor adapter ({ACTOR}/adapter_model.safetensors); "
                        "export a checkpoint of a `homerlhf train` run")
    cfg = saved_config(ckpt)
    base_dir = resolve_model_dir(cfg.model.name_or_path)
    config = json.loads((base_dir / "config.json").read_text()) if (base_dir / "config.json").is_file() else {}
    if config.get("quantization_config"):
        raise UserError(f"{base_dir} is a pre-quantized checkpoint; export needs the unquantized base the run loaded")
    if types:
        check_policy_gguf(base_dir)
    compute = compute_dtype_name(cfg)
    return PolicyExport(run_dir, ckpt, int(ckpt.name.split("_")[1]), cfg, base_dir, out, base, types,
                        push_to_hub, private, overwrite, export_dtype(dtype, compute), compute)
