"""``homerlhf train`` (PPO, GRPO, RLOO on your prompts) and ``homerlhf config`` (every setting, its type,
value and description): parse, call, print. The work is :mod:`homerlhf.stages.ppo`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

PresetOpt = typer.Option("cpu-tiny", "--preset", "-p", help="Preset name (see `homerlhf presets`).")
ConfigOpt = typer.Option(None, "--config", "-c", help="A YAML file merged over the preset.")
SetOpt = typer.Option([], "--set", "-s", help="Dotted override, e.g. ppo.kl_coef=0.05 (repeatable; "
                      "`homerlhf config` lists every key).")


VerboseOpt = typer.Option(False, "--verbose", help="llama.cpp's own warnings on the terminal too (by default they go "
                          "to RUN_DIR/llama.log; its errors show either way).")


def _load(preset: str, config: Optional[Path], overrides: List[str]):
    from homerlhf.config import load_config

    return load_config(preset, config, overrides)


def print_settings(cfg, prefix: str = "") -> None:
    """Every setting of ``cfg`` under ``prefix``: key, type, value, description, one line each."""
    from homerlhf.config.listing import render, settings
    from homerlhf.errors import UserError

    rows = [r for r in settings(cfg) if r.key == prefix or r.key.startswith(prefix.rstrip(".") + ".") or not prefix]
    if not rows:
        raise UserError(f"no setting is named {prefix!r} or starts with it; `homerlhf config` lists them all")
    typer.echo(f"# preset {cfg.preset}: key, type, value, description ({len(rows)} setting{'s' * (len(rows) != 1)}; "
               "change one with --set KEY=VALUE or a --config YAML)")
    for line in render(rows):
        typer.echo(line)


def config_cmd(
    prefix: str = typer.Argument("", help="Only the keys under this section or key, e.g. ppo or rollout.engine."),
    preset: str = PresetOpt,
    config: Optional[Path] = ConfigOpt,
    set_: List[str] = SetOpt,
) -> None:
    """Every setting: its key, type, value in the preset (after --config and --set) and what it does."""
    print_settings(_load(preset, config, set_), prefix)


def _ask_redacted_tokens(cfg):
    """A resumed run's worker tokens are not saved: read from the environment or asked for here."""
    import getpass

    from homerlhf.workers.tokens import restore_redacted_tokens

    return restore_redacted_tokens(cfg, ask=getpass.getpass if sys.stdin.isatty() else None)


def _train_args(preset, config, set_, out, resume, overwrite, gpus) -> list[str]:
    """The ``train`` command line of these options, for each launched process."""
    args = ["train", "--gpus", str(gpus)] + ([] if resume else ["--preset", preset])
    args += [x for o in set_ for x in ("--set", o)]
    for flag, value in (("--config", config), ("--out", out), ("--resume", resume)):
        args += [flag, str(value)] if value is not None else []
    return args + (["--overwrite"] if overwrite else [])


def _named(data: Optional[str], model: Optional[str], reward_model: Optional[str]) -> list[str]:
    """``--data``, ``--model`` and ``--reward`` as the overrides they stand for, each value a string as given."""
    import json

    pairs = (("data.prompts", data), ("model.name_or_path", model), ("reward.model", reward_model))
    return [f"{key}={json.dumps(value)}" for key, value in pairs if value is not None]


def train(
    ctx: typer.Context,
    preset: str = PresetOpt,
    data: Optional[str] = typer.Option(None, "--data", "-d", help="Prompts: a .jsonl/.json/.csv/.parquet file, a "
                                       "folder of them or a hub id (data.prompts; docs/data.md)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="The policy: your SFT run's model dir, a local HF "
                                        "model or a hub id (model.name_or_path)."),
    reward_model: Optional[str] = typer.Option(None, "--reward", help="The reward model: a `homerlhf reward` run dir, "
                                               "an HF dir or a hub id (reward.model)."),
    config: Optional[Path] = ConfigOpt,
    set_: List[str] = SetOpt,
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Run directory (default: output_dir)."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run in this directory."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a run already in the output dir."),
    gpus: Optional[int] = typer.Option(None, "--gpus", min=1, help="Data-parallel processes, one per GPU "
                                       "(sets distributed.gpus; launched through accelerate)."),
    help_config: bool = typer.Option(False, "--help-config", help="List every setting of this run (key, type, "
                                     "value, description) and exit: `homerlhf config` for this command line."),
    verbose: bool = VerboseOpt,
) -> None:
    """PPO (or GRPO, RLOO) on your prompts: LoRA actor + critic on a shared 4-bit base, the reference and
    reward models as llama.cpp CPU workers or on that base."""
    from homerlhf.config import check_train

    set_ = list(set_) + _named(data, model, reward_model)  # after --set: the named flags win
    if resume is not None:
        from homerlhf.ppo.resuming import resume_config

        # --resume alone continues with the run's own config; --config/--set go on top of it.
        explicit_preset = ctx.get_parameter_source("preset").name == "COMMANDLINE"
        cfg, _ = resume_config(resume, preset=preset if explicit_preset else None, config_file=config,
                               overrides=set_)
        cfg = _ask_redacted_tokens(cfg)
    else:
        cfg = _load(preset, config, set_)
    if help_config:
        print_settings(cfg)
        return
    if gpus is not None:
        cfg = cfg.model_copy(update={"distributed": cfg.distributed.model_copy(update={"gpus": gpus})})
    check_train(cfg)  # its prompts and its device, before torch loads
    from homerlhf.stages.data_parallel import launched, relaunch
    from homerlhf.stages.ppo import run_ppo  # torch and the trainer: only once the config checked out
    from homerlhf.workers.llama_log import set_verbose

    set_verbose(verbose)

    if cfg.distributed.gpus > 1 and not launched():
        relaunch(cfg, _train_args(preset, config, set_, out, resume, overwrite, cfg.distributed.gpus))
    result = run_ppo(cfg, out_dir=out, resume=resume, overwrite=overwrite)
    if not int(os.environ.get("RANK", "0")):  # data parallel: process 0 speaks for the run
        _say_result(result)


def _say_result(result: dict) -> None:
    rows = result["metrics"]
    if result.get("stopped"):
        if result["checkpoint"] is None:
            typer.echo("stopped before the first iteration finished: nothing to resume; "
                       "start again with --overwrite")
        else:
            typer.echo(f"stopped at iteration {result['iteration']}; checkpoint {result['checkpoint']}; "
                       f"continue with: homerlhf train --resume {result['run_dir']}")
    elif rows:
        first, last = rows[0], rows[-1]
        typer.echo(
            f"PPO done: {len(rows)} iterations, score {first['score_mean']:.3f} -> {last['score_mean']:.3f}, "
            f"kl {last['kl_mean']:.3f}; run dir {result['run_dir']}"
        )


