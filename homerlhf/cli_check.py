"""`homerlhf check`: the GPU code paths on this machine's card, measured, in one JSON report. Parse,
call, print: the work is in homerlhf.check."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from homerlhf.errors import UserError


def check(
    preset: Optional[str] = typer.Option(None, "--preset", "-p", help="Size the cases for this GPU preset "
                                         "(default: the preset of the card found; see `homerlhf presets`)."),
    out: Path = typer.Option(Path("homerlhf-check.json"), "--out", "-o", help="The JSON report (no paths, names "
                             "or tokens; `homerlhf plan --calibration` reads it)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a report already at --out."),
    cpu_smoke: bool = typer.Option(False, "--cpu-smoke", help="Every case's code path on the CPU with tiny models "
                                   "(4 prompts of 16 tokens, 3 new tokens, fp32; fp16 where the case is)."),
    largest: bool = typer.Option(False, "--largest", help="Run instead the largest table model the planner fits "
                                 "the preset's card, one iteration."),
    only: str = typer.Option("", "--only", help="Comma-separated case names (default: every case)."),
) -> None:
    """Short PPO, GRPO, RLOO, DPO and KTO runs on this GPU (random weights of real shapes, sized to its
    preset): each phase's memory peak against the plan, tokens/s, the captured decode, dtypes and attention
    kernels; a verdict per case and one JSON report. Without CUDA: what it would run."""
    from homerlhf.check.main import Options, run_check

    if out.exists() and not overwrite:
        raise UserError(f"--out {out} already exists; pass --overwrite to replace it or choose another --out")
    if not out.resolve().parent.is_dir():
        raise UserError(f"--out {out}: folder {out.parent} does not exist; create it or pick another path")
    code = run_check(Options(out=out, preset=preset, cpu_smoke=cpu_smoke, largest=largest, only=only), typer.echo)
    raise typer.Exit(code)
