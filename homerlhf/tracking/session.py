"""A run's trackers as one: started at the first step logged, each step handed to each tracker once,
closed at the end. The run's tracker ids live in ``RUN_DIR/tracking.json``, so ``--resume``
continues the same tracker runs.

Steps once each, across a kill and a resume: at its first step a tracker reports the highest step it
already holds whole (``last_step``) and what it holds of the steps above (``partial``: a kill can land
between the writes of one step); the session gives it the run's own log (``metrics.jsonl``, which the
resume cut back to the checkpoint) from there on, less what ``partial`` holds, then every later step.
So a step a tracker lost in the kill (its writes are asynchronous) is filled in from the log, the
metrics a cut step lacks are added to it, and what it holds from before the kill is not logged again.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from homerlhf.tracking import settings
from homerlhf.tracking.backends import BACKENDS, SAMPLES, RunInfo

log = logging.getLogger(__name__)

STATE_FILE = "tracking.json"
# (step, metrics row, sample records) of the run's own log, from a step on
Backlog = Callable[[int], Iterable[tuple[int, dict[str, Any], list[dict]]]]


def read_state(run_dir: str | Path) -> dict[str, Any]:
    """``RUN_DIR/tracking.json``: ``{"run_name", "project", "ids": {tracker: id}, "places": [line]}``, or {}."""
    try:
        return json.loads((Path(run_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def run_tracking_line(run_dir: str | Path, logging_cfg=None) -> Optional[str]:
    """Where the run in ``run_dir`` is tracked: the places its trackers started with (``tracking.json``),
    else those its config names (``logging_cfg``), else None."""
    places = read_state(run_dir).get("places")
    if places is not None:
        return "tracking: " + ("; ".join(places) if places else "metrics.jsonl only")
    return settings.tracking_line(logging_cfg, Path(run_dir)) if logging_cfg is not None else None


def _write_state(run_dir: Path, state: dict[str, Any]) -> None:
    tmp = run_dir / f"{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(run_dir / STATE_FILE)


def numeric(row: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics row (strings such as ``peak_mem_kind``, None and nan/inf left out)."""
    return {key: float(value) for key, value in row.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}


class TrackerSession:
    """The trackers ``names`` of the run in ``run_dir`` (config ``cfg``); nothing starts before ``log``."""

    def __init__(self, names: Iterable[str], run_dir: str | Path, cfg):
        self.names = tuple(names)
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        self.trackers: Optional[list] = None

    def _start(self, first_step: int) -> None:
        state = read_state(self.run_dir)
        run_name = state.get("run_name") or self.cfg.logging.run_name or \
            f"{self.run_dir.resolve().name}-{time.strftime('%Y%m%d-%H%M%S')}"
        ids = dict(state.get("ids", {}))
        info = RunInfo(self.run_dir, self.cfg.logging.project, run_name, settings.run_params(self.cfg, run_name),
                       first_step, ids)
        self.trackers = []
        try:
            for name in self.names:
                try:
                    self.trackers.append(BACKENDS[name](info))
                except Exception as exc:  # noqa: BLE001 - a tracker's failure must not end the run
                    log.warning("%s did not start (%s: %s); the run goes on without it (metrics.jsonl has "
                                "every step)", name, type(exc).__name__, exc)
        finally:  # the ids of whatever started, so a resume continues those runs
            places = [p.line() for p in settings.places(self.cfg.logging, self.run_dir)
                      if p.name in {t.name for t in self.trackers}]
            _write_state(self.run_dir, {"run_name": run_name, "project": info.project, "ids": info.ids,
                                        "places": places})

    def log(self, step: int, row: dict[str, Any], samples: list[dict], backlog: Backlog) -> None:
        """Step ``step`` (its metrics ``row`` and ``samples``) to every tracker that lacks it; at the
        first call, each tracker first gets ``backlog(its last step)``: the steps after the last one
        it holds, up to and including ``step``, from the run's own log, less what it holds of them."""
        first = self.trackers is None
        if first:
            self._start(step)
        for tracker in list(self.trackers):
            steps = backlog(tracker.last_step) if first else [(step, row, samples)] if step > tracker.last_step else []
            try:
                for each_step, each_row, each_samples in steps:
                    held = tracker.partial.pop(each_step, set())  # what a kill left of the step
                    metrics = {k: v for k, v in numeric(each_row).items() if k not in held}
                    tracker.log(each_step, metrics, [] if SAMPLES in held else each_samples)
            except Exception as exc:  # noqa: BLE001 - a tracker's failure must not end the run
                self._drop(tracker, exc)
                continue
            tracker.last_step = max(tracker.last_step, step)

    def _drop(self, tracker, exc: BaseException) -> None:
        log.warning("%s failed (%s: %s); the run goes on without it (metrics.jsonl has every step)",
                    tracker.name, type(exc).__name__, exc)
        self.trackers.remove(tracker)
        try:
            tracker.close()
        except Exception:  # noqa: BLE001 - it failed already; closing is a courtesy
            pass

    def close(self) -> None:
        """Finish every tracker's run (W&B: also its service process); a failure is a warning."""
        trackers, self.trackers = self.trackers or [], None
        for tracker in trackers:
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001 - the others must still close
                log.warning("%s did not close cleanly (%s: %s)", tracker.name, type(exc).__name__, exc)
