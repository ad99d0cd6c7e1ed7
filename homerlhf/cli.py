"""The `homerlhf` command: parse, call, print. Work lives in the packages it calls."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

try:  # typer >= 0.20 vendors click
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover - older typer uses click itself
    import click.exceptions as click_exc

import homerlhf.stages  # noqa: F401 - registers builtin:demo-sft / demo-rm, which any command may name
from homerlhf.cli_check import check
from homerlhf.cli_export import export_app
from homerlhf.cli_preference import dpo, kto
from homerlhf.cli_train import VerboseOpt, config_cmd, train
from homerlhf.errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="RLHF (SFT, reward model, PPO) on one consumer GPU.",
)
app.add_typer(export_app, name="export")
app.command("check")(check)
app.command("dpo")(dpo)
app.command("kto")(kto)
app.command("train")(train)
app.command("config")(config_cmd)

PresetOpt = typer.Option("cpu-tiny", "--preset", "-p", help="Preset name (see `homerlhf presets`).")
ConfigOpt = typer.Option(None, "--config", "-c", help="A YAML file merged over the preset.")
SetOpt = typer.Option([], "--set", "-s", help="Dotted override, e.g. ppo.kl_coef=0.05 (repeatable).")
OverwriteOpt = typer.Option(False, "--overwrite", help="Replace a run already in --out.")


def not_built(what: str, issue: int) -> None:
    raise UserError(f"{what} is not built yet (tracked in issue {issue})")


def _load(preset: str, config: Optional[Path], overrides: List[str]):
    from homerlhf.config import load_config

    return load_config(preset, config, overrides)


@app.command()
def presets() -> None:
    """List the presets: card, GPU memory, default model."""
    from homerlhf.config import load_config, preset_names

    for name in preset_names():
        cfg = load_config(name)
        mem = f"{cfg.card.gpu_gib:g} GiB" if cfg.card.gpu_gib else "CPU only"
        typer.echo(f"{name:<12} {cfg.card.name:<18} {mem:<9} {cfg.model.name_or_path}")


@app.command()
def plan(
    preset: str = PresetOpt,
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Hub id, local dir or builtin table name."),
    gpu_gib: Optional[float] = typer.Option(None, "--gpu-gib", help="Plan for this much GPU memory."),
    config: Optional[Path] = ConfigOpt,
    set_: List[str] = SetOpt,
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a stacked bar chart (PNG)."),
    gpus: Optional[int] = typer.Option(None, "--gpus", min=1, help="Plan one GPU of a run on N GPUs "
                                       "(sets distributed.gpus; rollout.batch_size stays the global batch)."),
    calibration: Optional[Path] = typer.Option(None, "--calibration", help="A `homerlhf check` report (JSON): the "
                                               "trainer's rates and phase peaks measured on that card, instead of "
                                               "the H200's scaled figures."),
    algorithm: Optional[str] = typer.Option(None, "--algorithm", help="dpo or kto: plan that stage (reference "
                                            "forward and train step); ppo, grpo or rloo: as --set algorithm=..."),
) -> None:
    """Memory and time plan: bytes per component per PPO phase, verdict and suggestions; seconds per
    phase from `homerlhf bench` figures (or defaults, or a check report) and the fastest placement (offline)."""
    import json

    from homerlhf.config.learning_rates import auto_lr_line
    from homerlhf.memory.check_report import calibrated_plan, read_report
    from homerlhf.memory.critic_compare import critic_sides
    from homerlhf.memory.render import print_plan, save_plan_figure, shape_for

    if gpu_gib is not None and gpu_gib <= 0:
        raise UserError(f"--gpu-gib must be > 0, got {gpu_gib:g}")
    report = read_report(calibration) if calibration is not None else None  # before anything loads
    rl = [f"algorithm={algorithm}"] if algorithm in ("ppo", "grpo", "rloo") else []
    if algorithm is not None and not rl and algorithm not in ("dpo", "kto"):
        raise UserError(f"--algorithm {algorithm!r}: choose one of ppo, grpo, rloo, dpo, kto")
    cfg = _load(preset, config, rl + set_ + ([f"distributed.gpus={gpus}"] if gpus else []))
    if algorithm in ("dpo", "kto"):
        from homerlhf.memory.preference import preference_plan, print_preference_plan

        result = preference_plan(cfg, shape_for(cfg, model), algorithm, gpu_gib)
        save_plan_figure(result, plot) if plot is not None else None
        typer.echo(json.dumps(result.to_dict(), indent=2)) if as_json else print_preference_plan(result)
        return
    from homerlhf.models.reward_kinds import assumed_note, named_backend_note, possible_reward_backends
    from homerlhf.ppo.distributed import check_data_parallel
    from homerlhf.workers.bench import cached_throughputs

    check_data_parallel(cfg.rollout.batch_size, cfg.group.size, cfg.distributed.gpus)
    shape = shape_for(cfg, model)
    rewards = possible_reward_backends(cfg.reward.model, model or cfg.model.name_or_path)
    rates = cached_throughputs(cfg, shape)
    result = calibrated_plan(cfg, shape, rates, gpu_gib, rewards, report, str(calibration))
    result.critic = critic_sides(cfg, shape, rates, gpu_gib, rewards)  # critic.model: both placements
    if result.timing is not None and result.timing.best.time.placement.reward == "adapter" and assumed_note(cfg.reward.model):
        result.notes.append(assumed_note(cfg.reward.model))
    result.notes += [n for n in [named_backend_note(cfg.reward.backend, cfg.reward.model, rewards)] if n]
    result.notes += [auto_lr_line(shape.total_params)] if cfg.actor.lr == "auto" else []  # the rate for this size
    save_plan_figure(result, plot) if plot is not None else None
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        print_plan(result)
        if plot is not None:
            typer.echo(f"chart: {plot}")


@app.command()
def bench(
    preset: str = PresetOpt,
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Model to measure (default: the config's)."),
    config: Optional[Path] = ConfigOpt,
    set_: List[str] = SetOpt,
    quick: bool = typer.Option(False, "--quick", help="Tiny token counts (under a minute for tiny models)."),
    force: bool = typer.Option(False, "--force", help="Measure again even when figures are cached."),
    standin: bool = typer.Option(False, "--standin", help="Time a random-init model of the same shape."),
) -> None:
    """Measure tokens/s on this machine (llama.cpp workers, rollout engine, policy) for `homerlhf plan`."""
    from homerlhf.memory.render import shape_for
    from homerlhf.workers.bench import bench as run_bench, describe

    cfg = _load(preset, config, set_)
    if model:
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name_or_path": model})})
    rates, path, measured = run_bench(cfg, shape_for(cfg, model), quick=quick, force=force, standin=standin)
    typer.echo(("measured" if measured else f"cached (--force to measure again): {path}") + f"; {rates.source}")
    for line in describe(rates):
        typer.echo(f"  {line}")


@app.command()
def demo(
    out: Path = typer.Option(Path("runs/demo"), "--out", "-o", help="Output directory."),
    fast: bool = typer.Option(False, "--fast", help="With --algorithm: 40 RL iterations instead of 80. The builtin demo runs its 16 either way (fewer miss its verdict)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier demo in --out."),
    seed: int = typer.Option(0, "--seed", help="Seed of the RL run and of the held-out samples."),
    algorithm: Optional[str] = typer.Option(
        None, "--algorithm",
        help="grpo, rloo or ppo: RL on the builtin digit-reversal task with its checker as the reward "
        "(held-out accuracy before/after) instead of the default PPO demo with a reward model."),
    method: Optional[str] = typer.Option(
        None, "--method", help="dpo or kto: train the SFT model on the builtin preference pairs directly (TRL, no "
        "reward model) instead of RL, with the same held-out evaluation and verdict."),
    verbose: bool = VerboseOpt,
) -> None:
    """The whole pipeline offline on CPU: tiny model, SFT, reward model, PPO with llama.cpp workers.

    Measured on a quiet 2-core machine: 82 s the first time (models built), 60 s once cached."""
    from homerlhf.workers.llama_log import set_verbose

    set_verbose(verbose)
    if method is not None:
        if algorithm is not None:
            raise UserError("--method (dpo, kto) and --algorithm (RL on the verifiable task) are two demos; give one")
        from homerlhf.stages.demo_preference import run_preference_demo

        run_preference_demo(out, method, overwrite=overwrite, seed=seed)
        return
    if algorithm is not None:
        from homerlhf.stages.demo_verifiable import run_verifiable_demo

        run_verifiable_demo(out, algorithm, fast=fast, overwrite=overwrite, seed=seed)
        return
    from homerlhf.stages.demo import run_demo

    run_demo(out, fast=fast, overwrite=overwrite, seed=seed)


@app.command()
def sft(
    preset: str = PresetOpt,
    config: Optional[Path] = ConfigOpt,
    set_: List[str] = SetOpt,
    data: Optional[str] = typer.Option(None, "--data", help="Dataset: builtin:<name>, hub id or file."),
    out: Path = typer.Option(Path("runs/sft"), "--out", "-o", help="Output directory."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Base model (default: sft.base or model.name_or_path)."),
    overwrite: bool = OverwriteOpt,
) -> None:
    """Supervised fine-tuning (TRL SFTTrainer, QLoRA); writes OUT/adapter, OUT/model, OUT/sft_run.json."""
    from homerlhf.config import check_device

    cfg = _load(preset, config, set_)
    check_device(cfg)
    from homerlhf.stages.sft import run_sft  # torch, transformers, TRL: only once the config checked out

    summary = run_sft(cfg, out, data=data, base=model, overwrite=overwrite)
    typer.echo(f"sft done: {summary['n_train']} examples, {summary['steps']} steps, "
               f"loss {summary['train_loss']:.3f}, model in {summary['model_dir']}")


@app.command()
def reward(
    preset: str = PresetOpt,
    config: Optional[Path] = ConfigOpt,
    set_: List[str] = SetOpt,
    data: Optional[str] = typer.Option(None, "--data", help="Preference dataset: builtin:<name>, hub id or file."),
    out: Path = typer.Option(Path("runs/reward"), "--out", "-o", help="Output directory."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Base model (default: rm.base or model.name_or_path)."),
    eval_data: Optional[str] = typer.Option(None, "--eval-data", help="Held-out pairs (default: a data.eval_fraction split of --data by prompt)."),
    overwrite: bool = OverwriteOpt,
) -> None:
    """Reward model (TRL RewardTrainer, QLoRA, Bradley-Terry), exported for the llama.cpp worker.

    Writes OUT/adapter, OUT/model, OUT/gguf and OUT/reward_run.json; train with reward.model=OUT."""
    from homerlhf.config import check_device

    cfg = _load(preset, config, set_)
    check_device(cfg)
    from homerlhf.stages.reward import done_line, run_reward  # torch, transformers, TRL: once the config checked out

    summary = run_reward(cfg, out, data=data, base=model, eval_data=eval_data, overwrite=overwrite)
    typer.echo(done_line(summary, out))


@app.command()
def worker(
    role: str = typer.Option(..., "--role", help="ref or reward."),
    model: Path = typer.Option(..., "--model", "-m", help="GGUF file (ref) or exported reward dir."),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address (non-loopback needs a token)."),
    port: int = typer.Option(0, "--port", help="Port (0: pick a free one and print it)."),
    threads: int = typer.Option(0, "--threads", help="llama.cpp threads (0: all physical cores)."),
    ctx: int = typer.Option(2048, "--ctx", help="Context length."),
    token_file: Optional[Path] = typer.Option(
        None, "--token-file", help="File (mode 0600) holding the bearer token required on every request "
        "(else HOMERLHF_WORKER_TOKEN, else none)."),
    token: Optional[str] = typer.Option(None, "--token", hidden=True),
    f32_kv_cache: bool = typer.Option(False, "--f32-kv-cache", help="F32 KV cache (HF-exact) instead of F16."),
    batch_tokens: int = typer.Option(0, "--batch-tokens", help="Tokens per llama.cpp decode (0: max(ctx, 1024))."),
    parent_pid: Optional[int] = typer.Option(None, "--parent-pid", help="Exit when this process is gone."),
) -> None:
    """Serve a reference or reward model from llama.cpp over HTTP (token ids in and out)."""
    from homerlhf.workers.engine import ROLES
    from homerlhf.workers.server import serve

    from homerlhf.workers.tokens import worker_token

    if token is not None:
        raise UserError("--token puts the secret in the process list; set HOMERLHF_WORKER_TOKEN or pass "
                        "--token-file (a 0600 file) instead")
    if role not in ROLES:
        raise UserError(f"--role {role!r} is not known; use ref or reward")
    serve(role, model, host=host, port=port, threads=threads, ctx=ctx, token=worker_token(token_file),
          f32_kv_cache=f32_kv_cache, parent_pid=parent_pid, batch_tokens=batch_tokens)


@app.command()
def doctor() -> None:
    """Check this machine for a run: packages, llama.cpp build and decodes, NF4, GPU, RAM, cache dir."""
    from homerlhf.doctor import run_doctor

    raise typer.Exit(run_doctor())


@app.command()
def audit(
    run_dir: Path = typer.Argument(..., help="A run directory (finished, running or killed)."),
    as_json: bool = typer.Option(False, "--json", help="Print the audit as JSON."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also write a PNG of the signals here."),
) -> None:
    """What the reward-hacking signals did over a run, the flags raised and samples that show them;
    exit 1 when a flag is up, 0 when clean (docs/audit.md)."""
    import json

    from homerlhf.ppo.audit import audit_run

    result = audit_run(run_dir)
    typer.echo(json.dumps(result.to_dict(), indent=1) if as_json else "\n".join(result.lines()))
    if plot is not None:
        written = result.plot(plot)
        if not as_json:
            typer.echo(f"plot: {written}")
    if not result.ok:
        raise typer.Exit(1)


@app.command("app")
def app_cmd(
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address."),
    port: int = typer.Option(7860, "--port", help="Port."),
    share: bool = typer.Option(False, "--share", help="Gradio share link (public; off by default)."),
    preset: str = typer.Option("cpu-tiny", "--preset", "-p", help="Preset selected when the page opens."),
    runs_root: Path = typer.Option(Path("runs"), "--runs", help="Folder where new runs go and old ones are listed."),
) -> None:
    """Open the Gradio app: data, plan, train, evaluate."""
    from homerlhf.app.ui import launch

    if host not in ("127.0.0.1", "localhost", "::1") or share:
        typer.echo("warning: the app can start training runs and write files; anyone who reaches it can too",
                   err=True)
    launch(host=host, port=port, share=share, default_preset=preset, runs_root=str(runs_root))


LIBRARY_DEPRECATIONS = ("is_gradient_checkpointing", "gradient_checkpointing_enable", "gradient_checkpointing_disable")


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point: every user error is one line on stderr and a non-zero exit, never a traceback."""
    import logging
    import warnings

    # bitsandbytes warns at import on every CPU without the optional hub kernel; its fallback is
    # correct (DESIGN.md), and the line would precede every one-line error of sft/reward/train.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # peft and TRL still read transformers' old checkpointing names (`is_gradient_checkpointing`, ...), which
    # transformers 5.24+ warns about once per process; our own calls use the current names
    # (tests/models/test_activations.py, tests/stages/test_stage_precision.py).
    for name in LIBRARY_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=f"`{name}` is deprecated", category=FutureWarning)
    command = typer.main.get_command(app)
    try:
        result = command.main(args=argv, prog_name="homerlhf", standalone_mode=False)
        # Non-standalone typer turns a KeyboardInterrupt into a *returned* exit code (130).
        if isinstance(result, int) and result:
            if result == 130:
                typer.echo("interrupted", err=True)
            sys.exit(result)
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click_exc.NoArgsIsHelpError as exc:
        typer.echo(exc.ctx.get_help() if exc.ctx else "", err=False)
        sys.exit(0)
    except click_exc.UsageError as exc:
        hint = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx else ""
        typer.echo(f"error: {exc.format_message()}{hint}", err=True)
        sys.exit(2)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(getattr(exc, "exit_code", 0))
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
