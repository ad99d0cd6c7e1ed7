"""A ``homerlhf check`` report read back by the planner: the trainer's measured rates and each phase's
measured peak, for the card the check ran on, in place of the H200's figures scaled by datasheets.

The report is the JSON ``homerlhf check`` writes (:func:`homerlhf.check.main.run_cases` lists its fields).
One case is used, the one nearest the plan (:func:`calibration_for`): its **time** becomes the
:class:`~homerlhf.memory.timing.Throughputs` a bench caches (:func:`calibrated`), so the time model reads
it as it reads a bench; its **memory**, per phase the measured / planned allocated peak, raises a phase
by a factor above 1 and never lowers one (:func:`apply_memory`). :func:`scrub_report` takes out of a
report what identifies a machine or a person before anyone attaches it to a bug report.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from homerlhf.config.schema import RunConfig
from homerlhf.errors import UserError
from homerlhf.memory.components import Component
from homerlhf.memory.shapes import ModelShape, builtin_shape
from homerlhf.memory.timing import Throughputs

PHASES = ("generation", "scoring", "update")
RATE_KEYS = ("tokens_per_s_generation", "tokens_per_s_scoring", "tokens_per_s_update")
SMOKE = "cpu-smoke"
CARD_NOISE = re.compile(r"^(nvidia|geforce|tesla|colab|\d+gb|sxm\d*|pcie|hbm\d*[a-z]?|nvl)$")
REPORTED_SHORT = 0.10  # a card may report up to this share less memory than its name says (24 GB: 23.6 GiB)


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0 else None


def usable(case: Any) -> bool:
    """A case that finished and holds what the planner reads: settings, positive rates, peaks."""
    if not isinstance(case, dict) or "error" in case or not isinstance(case.get("settings"), dict):
        return False
    rates, settings = case.get("tokens_per_s") or {}, case["settings"]
    peaks, planned = case.get("measured_gib") or {}, (case.get("plan") or {}).get("phases") or {}
    chunk = _number(settings.get("rollout.generation_chunk")) or _number(settings.get("rollout.chunk_size"))
    return (isinstance(case.get("model"), str) and chunk is not None and all(_number(rates.get(k)) for k in RATE_KEYS)
            and all(_number(peaks.get(p)) and _number((planned.get(p) or {}).get("allocated_gib")) for p in PHASES))


def read_report(path: Path) -> dict:
    """The report at ``path``, or a one-line :class:`UserError` (exit 2): missing, not JSON, not a
    check report, or no case the planner can use."""
    where = f"--calibration {path}"
    if not path.is_file():
        raise UserError(f"{where}: no such file; give the JSON report `homerlhf check` wrote")
    try:
        report = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{where}: not JSON ({str(exc).splitlines()[0]}); give the report `homerlhf check` wrote") from None
    if not isinstance(report, dict) or not isinstance(report.get("cases"), list) or "mode" not in report:
        raise UserError(f"{where}: not a `homerlhf check` report (no mode and list of cases); give the JSON it wrote")
    if report["mode"] not in ("gpu", SMOKE) or (report["mode"] == "gpu" and not isinstance(report.get("device"), str)):
        raise UserError(f"{where}: not a `homerlhf check` report (mode {report['mode']!r}, card "
                        f"{report.get('device')!r}); give the JSON it wrote")
    if not any(usable(c) for c in report["cases"]):
        failed = [c.get("case", "?") for c in report["cases"] if isinstance(c, dict) and "error" in c]
        why = f"every case failed ({', '.join(failed)})" if failed else "no case holds rates and peaks"
        raise UserError(f"{where}: no usable case: {why}; run `homerlhf check` again and pass its new report")
    return report


def card_tokens(name: str) -> set[str]:
    """The words that tell cards apart: 'NVIDIA GeForce RTX 4090' and 'RTX 4090' -> {'rtx', '4090'}."""
    return {w for w in re.findall(r"[a-z0-9]+", name.lower()) if not CARD_NOISE.match(w)}


def card_matches(card_name: str, card_gib: float, device: str, device_gib: Optional[float]) -> bool:
    """Whether a preset's card (``card.name``, ``card.gpu_gib``) is the GPU a report ran on: the same
    model words and, where both are known, the memory within :data:`REPORTED_SHORT` (an A100 40GB
    is not the 80GB preset's)."""
    if card_tokens(card_name) != card_tokens(device) or not card_tokens(device):
        return False
    return not (device_gib and card_gib) or abs(device_gib - card_gib) <= REPORTED_SHORT * card_gib


def _dims(shape: ModelShape) -> dict[str, Any]:
    return {k: v for k, v in shape.to_dict().items() if k not in ("name", "source", "published_params_b")}


def _case_card(report: dict, case: dict) -> str:
    """The card a case's figures are of: the report's GPU, or in a CPU smoke its preset's card."""
    if report["mode"] != SMOKE:
        return report["device"]
    from homerlhf.config import load_config

    try:
        return load_config(str(case.get("preset"))).card.name
    except UserError:
        return ""


@dataclass
class Calibration:
    """The case of a report a plan uses, and where it came from (file name, card, date)."""

    file: str
    card: str  # the GPU it ran on, or the preset's card of a CPU smoke
    smoke: bool
    date: Optional[str]
    case: dict
    replaced: str = ""  # the source of the figures the case's took the place of (:func:`calibrated`)

    @property
    def label(self) -> str:
        where = (f"a CPU smoke run (tiny models standing in for the {self.card}'s; no card's figures)" if self.smoke
                 else self.card + (f", {self.date}" if self.date else ""))
        return f"`homerlhf check` case {self.case['case']} on {where} ({self.file})"

    def forwards(self) -> tuple[int, int]:
        """(no-grad forwards per sequence in the case's scoring phase, adapters trained in its update)."""
        s = self.case["settings"]
        adapters = 2 if s.get("algorithm", "ppo") == "ppo" and not s.get("critic.shared_adapter") else 1
        return adapters + (s.get("ref.backend") == "adapter_off") + (s.get("reward.backend") == "adapter"), adapters

    def gen_chunk(self) -> int:
        s = self.case["settings"]
        chunk = s.get("rollout.generation_chunk")
        return chunk if isinstance(chunk, int) and not isinstance(chunk, bool) else int(s["rollout.chunk_size"])

    def factors(self) -> dict[str, float]:
        """Measured / planned allocated peak per phase; none for a CPU smoke (process RSS, not the allocator)."""
        if self.smoke:
            return {}
        planned = self.case["plan"]["phases"]
        return {p: self.case["measured_gib"][p] / planned[p]["allocated_gib"] for p in PHASES}

    def rates(self) -> dict[str, float]:
        """The trainer's tokens/s as :class:`~homerlhf.memory.timing.Throughputs` counts them: generated
        tokens at :meth:`gen_chunk`; one no-grad forward (the scoring phase's rate times its forwards);
        one adapter's forward + backward (the update's rate, tokens per epoch, times its adapters)."""
        measured = self.case["tokens_per_s"]
        scoring, adapters = self.forwards()
        return {"trainer_gen": float(measured["tokens_per_s_generation"]),
                "trainer_forward": scoring * float(measured["tokens_per_s_scoring"]),
                "trainer_train": adapters * float(measured["tokens_per_s_update"])}

    def throughputs(self, base: Throughputs) -> Throughputs:
        """``base`` (this machine's bench, else the defaults) with the trainer's rates from the case (a GPU's: threads 0)."""
        workers = base.source.split("; CPU workers: ")[-1]
        return Throughputs(worker_ref=base.worker_ref, worker_reward=base.worker_reward, llama_gen=base.llama_gen,
                           **{kind: {0: rate} for kind, rate in self.rates().items()},
                           source=f"GPU: {self.label}; CPU workers: {workers}", gen_chunk=self.gen_chunk())

    def lines(self, replaced: str) -> list[str]:
        """What the plan took from the report, in words (``replaced``: the figures it took instead of)."""
        r = self.rates()
        time = (f"calibration: time from {self.label}: generation {r['trainer_gen']:,.0f} tokens/s at chunk "
                f"{self.gen_chunk()}" + (f" ({self.case['decoder']})" if self.case.get("decoder") else "")
                + f", forward {r['trainer_forward']:,.0f}, forward + backward {r['trainer_train']:,.0f} tokens/s, "
                f"instead of {replaced}")
        if self.smoke:
            return [time, "calibration: memory as planned: a CPU smoke measures the process's RSS, not the CUDA allocator"]
        said = ", ".join(f"{p} x{f:.3f}" + ("" if f > 1 else " (kept as planned)") for p, f in self.factors().items())
        return [time, f"calibration: memory: measured / planned allocated peak of that case: {said}; the plan's "
                      "phases raised by the factors above 1 (a report never lowers a plan)"]


def _fit(case: dict, cfg: RunConfig) -> tuple:
    s = case["settings"]
    return (s.get("quant.compute_dtype") == cfg.quant.compute_dtype,
            s.get("quant.upcast_non_quantized") == cfg.quant.upcast_non_quantized,
            s.get("algorithm") == cfg.algorithm, case.get("kind") == "train", case.get("iterations", 0))


def calibration_for(report: dict, cfg: RunConfig, shape: ModelShape, file: str) -> Calibration:
    """The report's case for a plan of ``cfg`` on ``shape``: measured on the plan's card
    (:func:`card_matches`) and on the plan's model shape, the nearest in settings (:func:`_fit`: same
    dtype, algorithm, a plain training run).
    A report of another card or model is a one-line :class:`UserError`."""
    cases = [c for c in report["cases"] if usable(c)]
    on_card = [c for c in cases if card_matches(cfg.card.name, cfg.card.gpu_gib, _case_card(report, c),
                                                None if report["mode"] == SMOKE else _number(report.get("device_gib")))]
    if not on_card:
        ran = report["device"] if report["mode"] != SMOKE else "a CPU smoke of the " + " and ".join(
            sorted({_case_card(report, c) or "?" for c in cases}))
        raise UserError(f"--calibration {file}: measured on {ran}, not the plan's {cfg.card.name} "
                        f"({cfg.card.gpu_gib:g} GiB); plan with that card's preset, or run `homerlhf check` on this card")
    same = [c for c in on_card if builtin_shape(c["model"]) is not None and _dims(builtin_shape(c["model"])) == _dims(shape)]
    if not same:
        models = ", ".join(sorted({c["model"] for c in on_card}))
        raise UserError(f"--calibration {file}: it measured {models}, not {shape.name}'s shape; plan one of those "
                        "with --model, or drop --calibration")
    best = max(same, key=lambda c: _fit(c, cfg))
    return Calibration(file, _case_card(report, best), report["mode"] == SMOKE, report.get("date"), best)


def calibrated(report: dict, cfg: RunConfig, shape: ModelShape, file: str,
               base: Optional[Throughputs] = None) -> tuple[Calibration, Throughputs]:
    """The report's case for this plan (:func:`calibration_for`) and the throughputs a plan takes from
    it: ``base`` (this machine's bench figures; default: the documented defaults) with the trainer's
    rates replaced by the case's (:meth:`Calibration.throughputs`), counted as
    :func:`homerlhf.memory.timing.iteration_time` counts: generation at the case's generation chunk; the
    scoring phase's tokens/s times the forwards it ran (actor and critic, the adapter-off reference, a
    reward adapter); the update's tokens/s (tokens per epoch) times the adapters it trained. The CPU
    workers' rates stay this machine's."""
    from homerlhf.memory.threads import physical_cores
    from homerlhf.memory.timing import default_throughputs

    cal = calibration_for(report, cfg, shape, file)
    base = base or default_throughputs(shape, cfg, physical_cores())
    cal.replaced = base.source.split("; CPU workers: ")[0].removeprefix("GPU: ")
    return cal, cal.throughputs(base)


def calibrated_plan(cfg: RunConfig, shape: ModelShape, rates: Optional[Throughputs], gpu_gib: Optional[float],
                    rewards, report: Optional[dict], file: str = ""):
    """:func:`homerlhf.memory.placement.placed_plan` (the CLI's and the app's plan), with ``report`` (read
    by :func:`read_report`; None: none) in place of ``rates``' trainer figures and its memory factors."""
    from homerlhf.memory.placement import placed_plan

    cal = None
    if report is not None:
        cal, rates = calibrated(report, cfg, shape, file, rates)
    result = placed_plan(cfg, shape, rates, gpu_gib, rewards)
    if cal is not None:
        apply_calibration(result, cal, cfg, shape)
    return result


def apply_calibration(plan_, cal: Calibration, cfg: RunConfig, shape: ModelShape) -> None:
    """``plan_`` (planned with :func:`calibrated`'s throughputs) with its memory raised by the case's
    factors above 1 (:func:`apply_memory`) and lines saying what came from the report and what it replaced."""
    apply_memory(plan_, cal, cfg, shape)
    plan_.notes.extend(cal.lines(cal.replaced))


def apply_memory(plan_, cal: Calibration, cfg: RunConfig, shape: ModelShape) -> None:
    """Raise each phase of ``plan_`` by its measured factor above 1 (a component of its own); when that
    takes the plan out of fitting, the suggestion is searched for the card over the largest factor. A
    factor at or below 1 leaves the phase as planned: a report never makes a plan more optimistic, the
    margin stays for what nothing measured. A ``cpu-smoke`` report measures RSS, not the CUDA allocator:
    no factor."""
    factors = cal.factors()
    for phase in plan_.phases:
        factor = factors.get(phase.name, 1.0)
        if factor > 1:
            extra = round((factor - 1) * phase.allocated_bytes)
            phase.components.append(Component("measured on this card beyond the plan", "overhead", extra, True,
                                              f"{cal.case['case']}: allocated peak x{factor:.3f} of its plan", ""))
    worst = max([1.0, *factors.values()])
    if plan_.fits is False and worst > 1 and plan_.gpu_gib > 0:
        from homerlhf.memory.placement import resolve_placement
        from homerlhf.memory.search import suggest

        planned = resolve_placement(cfg, plan_.timing) if plan_.timing is not None else cfg
        plan_.suggestion = suggest(planned, shape, plan_.gpu_gib / worst)
        plan_.notes.append(f"calibration: the suggestion is searched for {plan_.gpu_gib / worst:.2f} GiB, the card "
                           f"over the largest measured factor (x{worst:.3f}); its figures are of that budget")


# ---- scrubbing ------------------------------------------------------------------------------------
PATH = re.compile(r"(?<![\w./~-])~?/[\w.+@%-]+(?:/[\w.+@%-]*)+")
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.I)
HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")


def _short_path(match: re.Match) -> str:
    """A path as a report may keep it: from a package dir on (``site-packages/torch/x.py``), else its
    file name (``<path>/rewards.py``)."""
    path = match.group(0)
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path[path.index(marker) + len(marker):]
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return f"<path>/{name}"


def scrub_text(text: str, secrets: list[str], names: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "<redacted>")
    text = PATH.sub(_short_path, HF_TOKEN.sub("<redacted>", text))
    for name in names:
        text = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w-])", "<name>", text)
    return text


def scrub_report(report: Any, env: Optional[dict] = None, host: Optional[str] = None,
                 user: Optional[str] = None) -> Any:
    """``report`` with every string freed of what identifies a machine or a person: the values of
    environment variables named like secrets (``*TOKEN*``, ``*KEY*``, ...; 8 characters or more) and
    Hugging Face tokens, absolute paths (:func:`_short_path`), and the host and user names (as whole
    words, 4 characters or more: a shorter one is too common a word to tell). Defaults: this process's
    environment, host and user."""
    import getpass
    import os
    import socket

    env = dict(os.environ) if env is None else env
    secrets = sorted((v for k, v in env.items() if SECRET_NAME.search(k) and len(v) >= 8), key=len, reverse=True)
    names = [n for n in (host if host is not None else socket.gethostname(),
                         user if user is not None else getpass.getuser()) if n and len(n) >= 4]

    def walk(value: Any) -> Any:
        if isinstance(value, str):
            return scrub_text(value, secrets, names)
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk(report)
