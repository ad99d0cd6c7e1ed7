"""The Train tab's controls besides Start: *Stop* and *Force stop*, *Resume* (a stopped run continued from its
last checkpoint, as its own process again) and the *Iterations* field (the run length, written into the Plan
tab's overrides)."""

from __future__ import annotations

from pathlib import Path

from homerlhf.app import feedback_runs, runs
from homerlhf.app.common import md_text
from homerlhf.errors import UserError


def with_iterations(iterations, preset, model, overrides, preset_model) -> str:
    """The overrides with the *Iterations* field's value when it is not what they give already."""
    from homerlhf.app.page_settings import iterations_of, set_iterations

    return overrides if iterations == iterations_of(preset, model, overrides, preset_model) else \
        set_iterations(iterations, overrides)


def resume_argv(run_dir: str, argv: list[str]) -> list[str]:
    """The command that continues ``run_dir`` from its last checkpoint: ``homerlhf train --resume`` (or
    ``dpo`` / ``kto`` for a feedback run)."""
    if feedback_runs.is_preference_run(run_dir, argv):
        method = argv[0] if argv[:1] and argv[0] in ("dpo", "kto") else (feedback_runs.info_of(run_dir) or {}).get("method", "dpo")
        return [method, "--resume", str(run_dir)]
    return ["train", "--resume", str(run_dir)]


def on_stop(run_dir) -> str:
    """Ask the attached run to save a checkpoint and exit."""
    if not run_dir:
        raise UserError("no run attached")
    return runs.stop_run(run_dir)


def on_kill(run_dir) -> str:
    """Stop the attached run at once."""
    if not run_dir:
        raise UserError("no run attached")
    return runs.stop_run(run_dir, force=True)


def on_resume(run_dir: str, runs_root: str = "runs") -> tuple:
    """Continue the attached stopped (or crashed) run from its last checkpoint, as its own process again:
    (message, attached, shared run dir, rows drawn, state)."""
    if not run_dir:
        raise UserError("attach the stopped run first (pick it in 'Existing runs', then Attach)")
    status = runs.run_status(run_dir)
    if status.running:
        raise UserError(f"{run_dir} is still running: Resume continues a stopped run")
    if status.state == "finished":
        raise UserError(f"{run_dir} finished all its iterations: nothing to resume; Start a new run (or, in a shell, "
                        f"homerlhf train --resume {run_dir} --set ppo.iterations=MORE)")
    found = runs.list_checkpoints(run_dir)
    if not found:
        raise UserError(f"{run_dir} wrote no checkpoint before it stopped, so there is nothing to resume: Start a new run")
    feedback_runs.refuse_if_running([runs_root, Path(run_dir).parent])
    argv = resume_argv(run_dir, status.argv)
    if argv[0] == "train":
        from homerlhf.ppo.resuming import find_resume_checkpoint

        find_resume_checkpoint(run_dir)  # a damaged checkpoint: said here, not as a crashed run
    started = runs.start_run(run_dir, argv)
    return (f"Resumed `{run_dir}` from `{found[0].name}`: {md_text(started.message())}", run_dir, run_dir, -1,
            "running")
