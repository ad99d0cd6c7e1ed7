"""``homerlhf dpo`` and ``homerlhf kto``: parse, call, print (the work is :mod:`homerlhf.stages.preference`)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from homerlhf.errors import UserError

PresetOpt = typer.Option("cpu-tiny", "--preset", "-p", help="Preset name (see `homerlhf presets`).")
ConfigOpt = typer.Option(None, "--config", "-c", help="A YAML file merged over the preset.")
SetOpt = typer.Option([], "--set", "-s", help="Dotted override, e.g. dpo.beta=0.2 (repeatable).")
DataOpt = typer.Option([], "--data", help="Dataset: builtin:<name>, hub id or file; repeat to join several "
                       "(e.g. a run's preferences.jsonl and ratings.jsonl).")
ModelOpt = typer.Option(None, "--model", "-m", help="Start from: a model or SFT run dir, hub id, builtin:<name>, "
                        "or a PPO/GRPO/RLOO/DPO/KTO run dir or checkpoint (its actor; default: the section's base "
                        "or model.name_or_path).")
EvalOpt = typer.Option(None, "--eval-data", help="Held-out data (default: a data.eval_fraction split).")
ResumeOpt = typer.Option(None, "--resume", help="Continue the dpo/kto run in this directory exactly.")
OverwriteOpt = typer.Option(False, "--overwrite", help="Replace a run already in --out.")


def _run(method: str, preset: str, config: Optional[Path], set_: List[str], data: List[str], out: Optional[Path],
         model: Optional[str], eval_data: Optional[str], resume: Optional[Path], overwrite: bool) -> None:
    from homerlhf.config import check_device, load_config

    if resume is not None:
        if data or model or eval_data or set_ or config or overwrite or out:
            raise UserError("--resume continues the run as it was started; drop --data, --model, --eval-data, "
                            "--set, --config, --out and --overwrite")
        from homerlhf.stages.preference import resume_preference

        summary = resume_preference(resume, method)
    else:
        cfg = load_config(preset, config, set_)
        check_device(cfg)
        from homerlhf.stages.preference import run_preference  # torch, TRL: only once the config checked out

        summary = run_preference(method, cfg, out or Path(f"runs/{method}"), data=data, base=model,
                                 eval_data=eval_data, overwrite=overwrite)
    held = summary["held_out"]
    margin = (f", held-out margin {held['margin_before']:+.3f} -> {held['margin_after']:+.3f} on "
              f"{held['eval_pairs']} pairs" if "margin_before" in held else "")
    typer.echo(f"{summary['stage']} done: {summary['n_train']} rows, {summary['steps']} steps, "
               f"loss {summary['train_loss']:.3f}{margin}; checkpoint {summary['checkpoint']}")


def dpo(preset: str = PresetOpt, config: Optional[Path] = ConfigOpt, set_: List[str] = SetOpt,
        data: List[str] = DataOpt, out: Optional[Path] = typer.Option(None, "--out", "-o", help="Run dir (default runs/dpo)."),
        model: Optional[str] = ModelOpt, eval_data: Optional[str] = EvalOpt, resume: Optional[Path] = ResumeOpt,
        overwrite: bool = OverwriteOpt) -> None:
    """DPO on preference pairs (TRL DPOTrainer) on the policy's 4-bit base; the reference is the starting policy.

    Writes OUT/checkpoints (export with `homerlhf export policy OUT`), OUT/metrics.jsonl, OUT/preference_run.json."""
    _run("dpo", preset, config, set_, data, out, model, eval_data, resume, overwrite)


def kto(preset: str = PresetOpt, config: Optional[Path] = ConfigOpt, set_: List[str] = SetOpt,
        data: List[str] = DataOpt, out: Optional[Path] = typer.Option(None, "--out", "-o", help="Run dir (default runs/kto)."),
        model: Optional[str] = ModelOpt, eval_data: Optional[str] = EvalOpt, resume: Optional[Path] = ResumeOpt,
        overwrite: bool = OverwriteOpt) -> None:
    """KTO on answers rated good or bad (TRL KTOTrainer); a preference pair counts as one good and one bad answer.

    Writes OUT/checkpoints (export with `homerlhf export policy OUT`), OUT/metrics.jsonl, OUT/preference_run.json."""
    _run("kto", preset, config, set_, data, out, model, eval_data, resume, overwrite)
