"""``homerlhf check``: the GPU code paths on the card it finds, each run and measured, in a few minutes.

On a CUDA machine it sizes its cases to the card (:mod:`homerlhf.check.cases`: the preset matching it,
or ``--preset``), runs them one by one (:mod:`homerlhf.check.run`), prints one line per case (``ok``
with its figures, or ``FAIL`` and the error's last line: a failed case never stops the others) and
writes one JSON report (``--out``, :func:`run_cases` lists its fields), rewritten before and after every
case, always through :func:`homerlhf.memory.check_report.scrub_report`: no path, host or user name,
token or model contents. Without CUDA (and without ``--cpu-smoke``) it prints what it would run and
exits 0; ``--cpu-smoke`` runs every case's code path on the CPU with tiny models.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from homerlhf.errors import UserError


@dataclass(frozen=True)
class Options:
    out: Path
    preset: Optional[str] = None
    cpu_smoke: bool = False
    largest: bool = False
    only: str = ""


@dataclass
class Sizing:
    """What a check runs: the preset and why, the card's figures the estimates use, the cases, what was left out."""

    preset: str
    why: str
    spec: object
    todo: list
    left: list[str]


def checked_preset(preset: Optional[str]) -> None:
    """A ``--preset`` that names no GPU preset is a one-line error."""
    from homerlhf.check.cases import gpu_presets

    names = sorted(gpu_presets())
    if preset is not None and preset not in names:
        raise UserError(f"--preset {preset!r} is not a GPU preset; choose one of: {', '.join(names)}")


def sizing(options: Options, device: Optional[str], device_gib: Optional[float]) -> Sizing:
    """The preset, the card's figures and the cases for ``device`` (None: no GPU, the preset's card)."""
    from homerlhf.check.cases import REFERENCE, card_preset, device_spec, gpu_presets, largest_case, sized_cases
    from homerlhf.check.runs import REPORTED_SHORT

    if options.preset is not None:
        preset, why = options.preset, "--preset"
    elif device is not None:
        preset, why = card_preset(device, device_gib)
    else:
        preset, why = REFERENCE, "no GPU here: the preset of our own GPU session's cases"
    gib = float(gpu_presets()[preset].card.gpu_gib)
    if device is not None and gib > device_gib / (1 - REPORTED_SHORT):
        raise UserError(f"--preset {preset}: its card's {gib:g} GiB is more than this GPU's {device_gib:g} GiB; "
                        "choose this card's preset or a smaller one")
    spec = device_spec(device, gpu_presets()[preset].card.name)
    todo, left = ([largest_case(preset, spec)], []) if options.largest else sized_cases(preset, spec)
    wanted = [n.strip() for n in options.only.split(",") if n.strip()]
    unknown = sorted(set(wanted) - {c.name for c in todo})
    if unknown:
        raise UserError(f"--only: no case {', '.join(unknown)} (cases: {', '.join(c.name for c in todo)})")
    return Sizing(preset, why, spec, [c for c in todo if not wanted or c.name in wanted], left)


def plan_lines(sized: Sizing) -> list[str]:
    """What a check of ``sized`` runs, one line a case, and its estimate."""
    from homerlhf.check.cases import PREFERENCE, estimated_seconds

    def runs(c) -> str:
        return f"{c.iterations} {'optimizer step' if c.kind in PREFERENCE else 'iteration'}{'s' * (c.iterations > 1)}"

    lines = [f"preset {sized.preset} ({sized.why}); estimates for the {sized.spec.name} (the planner's time "
             "model: the H200's measured rates scaled by published specs; not measured on that card)"]
    lines += [f"  {c.name:<20} {c.model:<18} {runs(c)}, preset {c.preset}, est. {c.estimate_s} s" for c in sized.todo]
    lines += [f"  left out: {why}" for why in sized.left]
    lines.append(f"about {estimated_seconds(sized.todo)} s in all, with this process's start and the models' builds")
    return lines


def write_report(out: Path, report: dict) -> None:
    """``report`` at ``out``, scrubbed (:func:`homerlhf.memory.check_report.scrub_report`)."""
    from homerlhf.memory.check_report import scrub_report

    out.write_text(json.dumps(scrub_report(report), indent=1))


def run_cases(sized: Sizing, smoke: bool, out: Path, echo: Callable[[str], None]) -> dict:
    """Every case of ``sized``, the report written before and after each (``running`` names the case under
    way); returns the report.

    The report: ``mode`` (``gpu`` or ``cpu-smoke``), ``date``, the versions (python, torch, CUDA,
    transformers, peft, bitsandbytes, accelerate, trl, datasets), the card (``device``, ``device_gib``,
    ``compute_capability``, ``driver``; none in a CPU smoke), the ``preset`` and why, the estimates
    (``estimate_s`` on the card, ``estimate_h200_s``), ``left_out`` (cases the planner fits nowhere on the
    card), ``wall_s``, and per case: ``case``, ``kind``, ``preset``, ``model``, ``cap_gib``, ``estimate_s``,
    ``iterations``, ``overrides``, ``settings``, ``plan`` (``phases``: the planned allocated GiB of the
    iteration measured; ``steady_state``), ``plan_assumptions``, ``measured_gib`` (the last iteration's
    allocated peak per phase), ``comparison``, ``max_reserved_gib``, ``rows`` (every iteration's metrics),
    ``seconds``, ``tokens_per_s``, ``optimizer_steps``, ``decoder``, ``graphs_captured``, ``captured_replays``,
    ``kernel_settings``, ``activation_checkpointing`` (per model, ``policy`` and with a critic of its own
    ``critic``: its ``layers``, the indices ``recomputed`` in backward and ``offloaded``, the ``path`` that
    set them), ``sampled_vs_scored``, ``absent`` (the packages missing while it ran), ``wall_s``; a failed
    case: ``error`` and ``traceback``. A preference case (``dpo-1.5b``, ``kto-1.5b``) has its own figures
    (:mod:`homerlhf.check.preference_case`)."""
    from homerlhf.check.cases import estimated_seconds
    from homerlhf.check.cli_case import absent_now
    from homerlhf.check.lines import line
    from homerlhf.check.run import Run, guarded, write_files
    from homerlhf.check.runs import environment, models_dir

    started = time.perf_counter()
    scratch = None if smoke else models_dir() / "scratch"  # run dirs and checkpoints: a disk, not /tmp
    if scratch is not None:
        scratch.mkdir(parents=True, exist_ok=True)
    report = {**environment(smoke), "preset": sized.preset, "preset_reason": sized.why,
              "estimate_s": estimated_seconds(sized.todo), "estimate_h200_s": estimated_seconds(sized.todo, h200=True),
              "left_out": sized.left, "cases": []}
    echo(" ".join(f"{k} {v}" for k, v in report.items() if k not in ("cases", "left_out", "preset_reason")))
    with tempfile.TemporaryDirectory(prefix="homerlhf-check-", dir=scratch) as tmp:
        run = Run(smoke=smoke, tmp=Path(tmp))
        write_files(run)
        for case in sized.todo:
            report["running"] = case.name
            write_report(out, report)  # what ran survives a timeout or a crash
            report["cases"].append({**guarded(case, run), "absent": absent_now()})  # what it ran without
            report["wall_s"] = round(time.perf_counter() - started, 1)
            del report["running"]
            write_report(out, report)
            echo(line(report["cases"][-1]))
    return report


def run_check(options: Options, echo: Callable[[str], None] = print) -> int:
    """``homerlhf check``: 0 when every case passed (or, without CUDA, once the plan is printed), 1 if not."""
    checked_preset(options.preset)
    import torch

    on_gpu = not options.cpu_smoke and torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if on_gpu else None
    sized = sizing(options, props.name if props else None, props.total_memory / 2**30 if props else None)
    if not on_gpu and not options.cpu_smoke:
        echo("no CUDA GPU here: nothing run, nothing written. On a GPU, `homerlhf check` runs:")
        for text in plan_lines(sized):
            echo(text)
        echo("(--cpu-smoke runs these code paths on this CPU with tiny models)")
        return 0
    for text in plan_lines(sized):
        echo(text)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")  # nothing is downloaded
    from homerlhf.check.cli_case import without_absent_packages

    without_absent_packages()
    started = time.perf_counter()
    report = run_cases(sized, options.cpu_smoke, options.out, echo)
    passed = sum("error" not in entry for entry in report["cases"])
    echo(f"{passed}/{len(sized.todo)} ok in {time.perf_counter() - started:.0f} s; wrote {options.out} "
         "(no paths, names or tokens: attach it to a bug report, or plan with `homerlhf plan --calibration`)")
    return 0 if passed == len(sized.todo) else 1
