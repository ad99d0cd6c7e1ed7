"""The ``cli`` case of ``homerlhf check``: ``homerlhf train`` in a subprocess as a user runs it,
then ``train --resume``, with what the GPU machine lacks made absent (:data:`ABSENT`, as in the check's
own process for every PPO case; the preference cases have ``datasets`` and ``trl``).

    python -m homerlhf.check.cli_case CAP_GIB|smoke homerlhf-arguments...   # the child the check starts

On a GPU the child is capped at the preset's card (``runs.cap_memory``); in the CPU smoke it
decides its ``auto`` settings as on the GPU machine (:func:`decide_as_on_cuda`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import homerlhf
from homerlhf.check.runs import cap_memory

ABSENT = ("llama_cpp", "gradio", "datasets", "trl", "matplotlib")  # what the GPU machine lacks, or may
# What the preference cases need of them (our GPU session carries them): absent for every PPO case, which
# run first (homerlhf.check.cases.sized_cases), then present for the preference ones.
PREFERENCE_PACKAGES = ("datasets", "trl")


def without_absent_packages() -> None:
    """Make :data:`ABSENT` missing, as on the GPU machine: importing one raises ModuleNotFoundError and
    ``importlib.util.find_spec`` finds nothing (no PPO case may need them). Those already imported stay."""
    for name in ABSENT:
        sys.modules.setdefault(name, None)


def absent_now() -> list[str]:
    """The names of :data:`ABSENT` missing in this process now (:func:`without_absent_packages`)."""
    return [name for name in ABSENT if name in sys.modules and sys.modules[name] is None]


def with_preference_packages() -> None:
    """:data:`PREFERENCE_PACKAGES` importable again, and transformers told so: it caches whether
    ``datasets`` is installed (``is_datasets_available``, which its Trainer reads to drop a dataset's
    unused columns). Refused when ``transformers.trainer`` was imported while ``datasets`` was missing:
    it imports ``datasets`` at its own import only, so a preference run would go unlike a user's."""
    for name in PREFERENCE_PACKAGES:
        if name in sys.modules and sys.modules[name] is None:
            del sys.modules[name]
    from transformers.utils import import_utils

    clear = getattr(import_utils.is_datasets_available, "cache_clear", None)
    if clear is not None:
        clear()
    trainer = sys.modules.get("transformers.trainer")
    if trainer is not None and not hasattr(trainer, "datasets"):
        raise RuntimeError("transformers.trainer was imported while datasets was absent; run the preference "
                           "cases alone (--only dpo-1.5b,kto-1.5b)")


def run_cli(args: list[str], cap_gib: float, run) -> str:
    """``homerlhf <args>`` in a subprocess (this process's homerlhf; :data:`ABSENT` missing), capped at
    ``cap_gib`` on a GPU (the CPU smoke: deciding as on CUDA, :func:`decide_as_on_cuda`). Returns its
    output; its error's last line is raised on failure."""
    root = str(Path(homerlhf.__file__).resolve().parents[1])  # the child imports the homerlhf this one runs
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    cap = "smoke" if run.smoke else str(cap_gib)
    done = subprocess.run([sys.executable, "-m", "homerlhf.check.cli_case", cap, *args], capture_output=True,
                          text=True, env=env, timeout=600)
    if done.returncode:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["(no output)"]
        raise RuntimeError(f"`homerlhf {args[0]}` exited {done.returncode}: {lines[-1]}")
    return done.stdout


def cli_case(case, overrides: list[str], cap_gib: float, run) -> dict:
    """``homerlhf train`` for ``case.iterations``, then ``train --resume`` for one more (``case``, ``run``:
    ``cases.Case``, ``run.Run``)."""
    run_dir = run.tmp / case.name
    n = run.iterations(case)
    sets = [arg for o in overrides + [f"ppo.iterations={n}"] for arg in ("--set", o)]
    said = run_cli(["train", "--preset", case.preset, *sets, "--out", str(run_dir)], cap_gib, run)
    run_cli(["train", "--resume", str(run_dir), "--set", f"ppo.iterations={n + 1}"], cap_gib, run)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if [r["iteration"] for r in rows] != list(range(1, n + 2)):
        raise AssertionError(f"metrics.jsonl holds iterations {[r['iteration'] for r in rows]}")
    last = rows[-1]
    measured = {k[len("peak_mem_"):-len("_gib")]: v for k, v in last.items()
                if k.startswith("peak_mem_") and k.endswith("_gib")}
    return {"rows": rows, "measured_gib": measured, "max_reserved_gib": None,
            "placement": [ln for ln in said.splitlines() if ln.startswith("[homerlhf] placement")],
            "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").iterdir())}


def main(argv: list[str]) -> None:
    """The CLI case's child: ``homerlhf <argv[1:]>`` without :data:`ABSENT`, capped at ``argv[0]`` GiB
    (``smoke``: on the CPU, deciding as on CUDA)."""
    import runpy

    without_absent_packages()
    if argv[0] == "smoke":
        decide_as_on_cuda()
    else:
        cap_memory(float(argv[0]))  # a 4090's 24 GiB on a card that reports 23.99: the whole card
    sys.argv = ["homerlhf", *argv[1:]]
    runpy.run_module("homerlhf.cli", run_name="__main__")


def decide_as_on_cuda() -> None:
    """The CPU smoke's ``homerlhf train`` decides its ``auto`` settings as on the GPU machine: the
    config's card device ``cuda`` and CUDA reported while it decides (then it trains on the CPU
    with what was decided). A decision that measured (a worker, an export) fails here as it would
    there: llama_cpp is absent."""
    from unittest import mock

    import bitsandbytes  # noqa: F401 - imported while the real device shows: its import reads it
    import torch

    import homerlhf.stages.autoplan as autoplan

    decide = autoplan.resolve_for_run

    def on_cuda(cfg, resume, reward_given):
        card = cfg.card
        with mock.patch.object(torch.cuda, "is_available", return_value=True), \
                mock.patch.object(torch.cuda, "get_device_name", return_value="(CUDA reported to the CPU smoke)"):
            decided = decide(cfg.model_copy(update={"card": card.model_copy(update={"device": "cuda"})}), resume,
                             reward_given)
        return decided.model_copy(update={"card": card})

    autoplan.resolve_for_run = on_cuda  # run_ppo imports it when it runs


if __name__ == "__main__":
    main(sys.argv[1:])
