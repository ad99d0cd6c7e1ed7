"""The reference run the monitor draws beside a run of the demo's task, so a user sees what a healthy run
looks like.

``homerlhf/app/reference/demo_fast.json`` holds a few per-iteration metrics of one measured
``homerlhf demo --fast`` run (``rows``, as metrics.jsonl has them) and a header: the command, seed, CPU and
date, and ``applies_to``: the config values (dotted keys) of the runs it is drawn beside. scripts/demo_reference.py
writes it from a demo's run directory with :func:`build`; :func:`for_run` hands it to the monitor only for
a run whose ``config.yaml`` has every one of those values.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Optional, Sequence

# The per-iteration metrics kept: the lines of the monitor's panels that tell a healthy run (the score
# rises, the KL grows slowly, the entropy holds, answers do not grow with the score).
KEYS = ("score_mean", "kl_mean", "entropy", "signal_length_drift", "signal_length_corr")
# What a run must share with the reference for its curves to be comparable: the same model, prompts and algorithm.
APPLIES_TO = ("model.name_or_path", "data.prompts", "algorithm")
NAME = "healthy demo run (reference)"  # its lines' legend name (monitor_plot draws such lines dashed grey)
FILE = "demo_fast.json"


def value_at(config: dict, dotted: str):
    """``config["a"]["b"]`` for ``"a.b"``; None where a level is missing."""
    for part in dotted.split("."):
        if not isinstance(config, dict):
            return None
        config = config.get(part)
    return config


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def build(rows: Sequence[dict], config: dict, command: str, cpu: str, date: str) -> dict:
    """The reference of a run: its :data:`KEYS` per iteration (a missing or non-finite value left out) and
    the header (``command``, its ``config`` seed and :data:`APPLIES_TO` values, where and when it ran)."""
    kept = [{"iteration": row["iteration"], **{k: row[k] for k in KEYS if _finite(row.get(k))}}
            for row in rows if _finite(row.get("iteration"))]
    header = {"command": command, "seed": config.get("seed"), "cpu": cpu, "date": date, "iterations": len(kept),
              "applies_to": {key: value_at(config, key) for key in APPLIES_TO}}
    return {"header": header, "rows": kept}


def dumps(reference: dict) -> str:
    """The file's text: the header, then one line per iteration."""
    rows = ",\n  ".join(json.dumps(row) for row in reference["rows"])
    return f'{{\n "header": {json.dumps(reference["header"])},\n "rows": [\n  {rows}\n ]\n}}\n'


@lru_cache(maxsize=1)
def load() -> dict:
    """The packaged reference (:data:`FILE`)."""
    from importlib.resources import files

    return json.loads(files("homerlhf.app.reference").joinpath(FILE).read_text(encoding="utf-8"))


def applies(config: Optional[dict], reference: dict) -> bool:
    """Whether a run of ``config`` (its config.yaml as data) is one the reference is drawn beside."""
    wanted = reference["header"]["applies_to"]
    return isinstance(config, dict) and all(value_at(config, key) == value for key, value in wanted.items())


def for_run(run_dir: str | Path) -> Optional[dict]:
    """The reference to draw beside the run in ``run_dir``; None when its config.yaml is missing, unreadable or
    names another task."""
    import yaml

    try:
        config = yaml.safe_load((Path(run_dir) / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return None
    reference = load()
    return reference if applies(config, reference) else None


def note(reference: dict) -> str:
    """The line under the figure: what the dashed grey lines are."""
    head = reference["header"]
    return (f"Dashed grey: a {NAME}, '{head['command']}' (seed {head['seed']}, {head['iterations']} iterations), "
            f"measured on {head['cpu']}, {head['date']}.")
