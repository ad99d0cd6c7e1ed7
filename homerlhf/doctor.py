"""``homerlhf doctor``: does this machine have what a run needs? One screen, and what to do about each miss.

Each check is a function returning :class:`Check` rows. Whatever runs native code (llama.cpp's
system info, a llama.cpp decode per export type, bitsandbytes NF4) runs in another process, so a
build for another CPU (SIGILL) or any other crash is a reported miss, not the end of the doctor.
A ``fail`` is something ``homerlhf demo`` (CPU, preset cpu-tiny) needs; what only GPU runs need
fails only on a machine with a CUDA device, and is a warning elsewhere.

Layer: above ``workers`` (it exports and decodes through a real worker), below ``cli``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import io
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from homerlhf.errors import UserError
from homerlhf.workers.process import SignalDeath, WorkerProcess, portable_reinstall_command, signal_death

OK, WARN, FAIL = "ok", "warn", "FAIL"
DEMO_PRESET = "cpu-tiny"
# The packages a run imports, by distribution name; their ranges come from homerlhf's own metadata.
PACKAGES = ["torch", "transformers", "peft", "trl", "bitsandbytes", "accelerate", "gguf", "llama-cpp-python"]
# Largest |log p(llama.cpp) - log p(HF)| accepted per export type on the doctor's tiny model; about
# 8x what a good build gives (measured: f32 1.3e-4, f16 1.0e-4, bf16 6.1e-4, q8_0 2.3e-3).
DECODE_TOLERANCE = {"f32": 1e-3, "f16": 1e-3, "bf16": 5e-3, "q8_0": 2e-2}
PROMPT_IDS, RESPONSE_IDS = [2, 4, 17, 30, 41, 50, 51], [52, 60, 61, 62, 63, 64, 65, 1]
# llama.cpp's feature names -> the /proc/cpuinfo flag the CPU needs for them (x86).
CPU_FLAGS = {"SSE3": "pni", "SSSE3": "ssse3", "AVX": "avx", "AVX2": "avx2", "F16C": "f16c", "FMA": "fma",
             "BMI2": "bmi2", "AVX_VNNI": "avx_vnni", "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi",
             "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16", "AMX_INT8": "amx_int8"}


@dataclass
class Check:
    """One row of the doctor's table."""

    name: str
    status: str  # OK, WARN or FAIL
    detail: str
    fix: str = ""


class ChildFailed(Exception):
    """A check's child process crashed, timed out or raised; ``detail`` and ``fix`` say how and what to
    do (worded for llama.cpp), ``death`` is the signal that killed it, if one did."""

    def __init__(self, detail: str, fix: str, death: Optional[SignalDeath] = None):
        super().__init__(detail)
        self.detail, self.fix, self.death = detail, fix, death


def run_child(code: str, *args: str, timeout: float = 300.0) -> dict:
    """Runs ``code`` in a fresh interpreter; returns the JSON object it prints last, or raises ChildFailed."""
    try:
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ChildFailed(f"no answer after {timeout:.0f} s", "the machine is overloaded or the check hangs") from None
    death = signal_death(proc.returncode)
    if death is not None:
        raise ChildFailed(f"died by {death.name} ({death.meaning})", death.fix, death)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        errors = [line for line in proc.stderr.splitlines() if line.strip()]
        raise ChildFailed(errors[-1] if errors else f"exit code {proc.returncode}", "see the error; reinstall the package it names")
    return json.loads(lines[-1])


# --------------------------------------------------------------------------- versions


def check_python() -> list[Check]:
    version = platform.python_version()
    if sys.version_info < (3, 10):
        return [Check("python", FAIL, version, "use Python 3.10 or newer")]
    return [Check("python", OK, f"{version} ({sys.executable})")]


def _requirements() -> dict[str, str]:
    """``{distribution: specifier}`` of homerlhf's dependencies, from its installed metadata."""
    from packaging.requirements import Requirement

    try:
        lines = md.requires("homerlhf") or []
    except md.PackageNotFoundError:
        return {}
    reqs = (Requirement(line) for line in lines)
    return {r.name.lower(): str(r.specifier) for r in reqs if r.marker is None}


def _torch_build() -> str:
    import torch

    return f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"


def check_packages() -> list[Check]:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    wanted, rows = _requirements(), []
    for name in PACKAGES:
        spec = wanted.get(name, "")
        try:
            version = md.version(name)
        except md.PackageNotFoundError:
            rows.append(Check(name, FAIL, "not installed", f"pip install '{name}{spec}'"))
            continue
        if spec and not SpecifierSet(spec).contains(Version(version), prereleases=True):
            rows.append(Check(name, FAIL, f"{version}, homerlhf needs {spec}", f"pip install '{name}{spec}'"))
            continue
        detail = f"{version} ({_torch_build()})" if name == "torch" else version
        rows.append(Check(name, OK, detail))
    return rows


# --------------------------------------------------------------------------- llama.cpp


SYSTEM_INFO = "import json, llama_cpp; print(json.dumps({'info': llama_cpp.llama_print_system_info().decode()}))"


def _cpu_flags() -> Optional[set[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


def build_features(info: str) -> list[str]:
    """The instruction sets a llama.cpp build uses, from its system info (``AVX2 = 1 | ...``)."""
    features = []
    for part in info.replace("\n", "|").split("|"):
        name, _, value = part.rpartition("=")
        name = name.split(":")[-1].strip()
        if name and value.strip() == "1":
            features.append(name)
    return features


def check_llama_build() -> list[Check]:
    try:
        info = run_child(SYSTEM_INFO, timeout=120)["info"]
    except ChildFailed as exc:
        return [Check("llama.cpp build", FAIL, f"import llama_cpp: {exc.detail}", exc.fix)]
    features = build_features(info)
    flags = _cpu_flags()
    missing = [f for f in features if flags is not None and f in CPU_FLAGS and CPU_FLAGS[f] not in flags]
    wide = [f for f in features if f.startswith(("AVX512", "AMX"))]
    kind = f"native build ({', '.join(wide)})" if wide else "portable build (no AVX-512)"
    detail = f"{kind}: {' '.join(features)}"
    if missing:
        return [Check("llama.cpp build", FAIL, f"{detail}; this CPU lacks {', '.join(missing)}",
                      f"reinstall the portable build: {portable_reinstall_command()}")]
    hint = "" if not wide else "fast here; if a decode below fails, reinstall the portable build"
    return [Check("llama.cpp build", OK, detail, hint)]


def preset_export_types() -> dict[str, list[str]]:
    """``{outtype: [preset, ...]}`` over the ref and reward exports of every preset."""
    from homerlhf.config import load_config, preset_names

    used: dict[str, list[str]] = {}
    for name in preset_names():
        cfg = load_config(name)
        for outtype in {cfg.ref.outtype, cfg.reward.outtype}:
            used.setdefault(outtype, []).append(name)
    return dict(sorted(used.items()))


def _hf_logprobs(model_dir: Path) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT_IDS + RESPONSE_IDS])).logits[0].double()  # (T, V)
    logp = torch.log_softmax(logits, dim=-1)
    rows = torch.arange(len(PROMPT_IDS) - 1, len(PROMPT_IDS) + len(RESPONSE_IDS) - 1)
    return logp[rows, torch.tensor(RESPONSE_IDS)].tolist()


def _worker_logprobs(gguf: Path, log: Path) -> list[float]:
    """Log-probs from a real ref worker process: a crash there is reported, never ours."""
    from homerlhf.workers.backends import connect

    process = WorkerProcess("ref", gguf, ctx=64, f32_kv_cache=True, log_path=log, startup_timeout=120)
    try:
        backend = connect("ref", process=process)
    except UserError as exc:
        raise _death_or(process, exc) from None
    try:
        return backend.logprobs([PROMPT_IDS], [RESPONSE_IDS])[0]
    except UserError as exc:
        raise _death_or(process, exc) from None
    finally:
        backend.close()


def _death_or(process: WorkerProcess, exc: UserError) -> ChildFailed:
    death = process.death()
    if death is not None:
        return ChildFailed(f"the worker died by {death.name} ({death.meaning})", death.fix)
    return ChildFailed(f"{str(exc).splitlines()[0]} {process.tail(1).strip()}",
                       f"if llama_cpp is named, reinstall it: {portable_reinstall_command()}")


def check_decodes(on_gpu: bool, progress: Callable[[str], None]) -> list[Check]:
    """A llama.cpp decode of a tiny model for each export type the presets use, against HF."""
    from homerlhf.tiny import build_causal_lm
    from homerlhf.workers.gguf import export_ref

    rows, used = [], preset_export_types()
    with tempfile.TemporaryDirectory(prefix="homerlhf-doctor-") as tmp:
        progress("building a tiny model")
        with contextlib.redirect_stderr(io.StringIO()):  # progress bars of transformers and the export
            model_dir = build_causal_lm(Path(tmp) / "tiny", arch="llama", seed=0, hidden=64, layers=2)
            want = _hf_logprobs(model_dir)
            ggufs = {t: export_ref(str(model_dir), Path(tmp) / f"{t}.gguf", outtype=t) for t in used}
        for outtype, presets in used.items():
            progress(f"llama.cpp decode, {outtype} export")
            needed = DEMO_PRESET in presets or on_gpu
            users = f"used by {', '.join(presets)}"
            name = f"llama.cpp decode {outtype}"
            try:
                got = _worker_logprobs(ggufs[outtype], Path(tmp) / f"{outtype}.log")
            except ChildFailed as exc:
                rows.append(Check(name, FAIL if needed else WARN, f"{exc.detail}; {users}", exc.fix))
                continue
            err = max(abs(a - b) for a, b in zip(got, want)) if all(map(math.isfinite, got)) else math.inf
            if err > DECODE_TOLERANCE[outtype]:
                rows.append(Check(name, FAIL if needed else WARN, f"log-probs off by {err:.1e} from HF; {users}",
                                  f"reinstall the portable build: {portable_reinstall_command()}"))
            else:
                rows.append(Check(name, OK, f"matches HF to {err:.1e}; {users}"))
    return rows


# --------------------------------------------------------------------------- bitsandbytes, GPU, host


NF4_CODE = """
import json, sys, torch, bitsandbytes as bnb
from bitsandbytes.functional import dequantize_4bit
torch.manual_seed(0)
layer = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.float32, quant_type="nf4").to(sys.argv[1])
x = torch.randn(4, 64, device=sys.argv[1], requires_grad=True)
y = layer(x)
y.sum().backward()
w = dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()  # (32, 64)
print(json.dumps({"packed": str(layer.weight.dtype), "forward": (y - x.detach() @ w.T).abs().max().item(),
                  "backward": (x.grad - w.sum(0).expand_as(x)).abs().max().item()}))
"""


def check_nf4(device: str) -> Check:
    """bitsandbytes NF4 ``Linear4bit`` forward and backward on ``device``, against its dequantized weight."""
    name = f"bitsandbytes NF4 ({device})"
    fix_install = "pip install --force-reinstall 'bitsandbytes>=0.48'"
    try:
        out = run_child(NF4_CODE, device, timeout=180)
    except ChildFailed as exc:  # its own words: the child's llama.cpp wording does not fit here
        detail = f"died by {exc.death.name}" if exc.death else exc.detail
        return Check(name, FAIL, detail, fix_install)
    err = max(out["forward"], out["backward"])
    if out["packed"] != "torch.uint8" or err > 1e-4:
        return Check(name, FAIL, f"weights {out['packed']}, off by {err:.1e} from the dequantized matmul", fix_install)
    return Check(name, OK, f"forward and backward match the dequantized weight to {err:.1e}")


def check_cuda() -> list[Check]:
    import torch

    if not torch.cuda.is_available():
        fix = "GPU presets need one; the demo and cpu-tiny run on the CPU"
        if shutil.which("nvidia-smi") and not torch.version.cuda:
            fix = "this torch is a CPU build: install the CUDA build of torch for your driver"
        return [Check("CUDA", WARN, f"no CUDA device visible (torch {_torch_build()})", fix)]
    rows = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        rows.append(Check(f"CUDA {i}", OK, f"{torch.cuda.get_device_name(i)}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free"))
    return rows


def check_host() -> list[Check]:
    import psutil

    mem = psutil.virtual_memory()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [Check("host", OK, f"{mem.available / 2**30:.1f} of {mem.total / 2**30:.1f} GiB RAM free, "
                              f"{cores} cores, {platform.machine()}")]


def check_chromium() -> list[Check]:
    path = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if path is None:
        return [Check("chromium", WARN, "not found (only the browser test of the app needs it)",
                      "apt-get install chromium")]
    return [Check("chromium", OK, path)]


def check_cache_dir() -> list[Check]:
    where = os.environ.get("HOMERLHF_CACHE") or str(Path.home() / ".cache" / "homerlhf")
    fix = "set HOMERLHF_CACHE to a folder you can write"
    try:
        from homerlhf.paths import cache_dir

        root = cache_dir()
        with tempfile.NamedTemporaryFile(dir=root, prefix=".doctor-"):
            pass
    except OSError as exc:
        return [Check("cache dir", FAIL, f"{where}: not writable ({exc.strerror or exc})", fix)]
    free = shutil.disk_usage(root).free / 2**30
    return [Check("cache dir", OK, f"{root} writable, {free:.1f} GiB free on its disk")]


# --------------------------------------------------------------------------- the screen


def run_checks(progress: Callable[[str], None]) -> list[Check]:
    """Every check, cheap ones first; ``progress(text)`` names the slow one under way."""
    rows = check_python() + check_packages()
    progress("llama.cpp build")
    rows += check_llama_build()
    cuda = check_cuda()
    rows += check_decodes(on_gpu=cuda[0].status == OK, progress=progress)
    for device in ["cpu"] + (["cuda"] if cuda[0].status == OK else []):
        progress(f"bitsandbytes NF4 on {device}")
        rows.append(check_nf4(device))
    return rows + cuda + check_host() + check_chromium() + check_cache_dir()


def render(rows: list[Check], console) -> None:
    from rich.table import Table

    table = Table(title="homerlhf doctor", title_justify="left", show_lines=False)
    for column in ("check", "", "result", "what to do"):
        table.add_column(column, overflow="fold")
    style = {OK: "green", WARN: "yellow", FAIL: "bold red"}
    for row in rows:
        table.add_row(row.name, f"[{style[row.status]}]{row.status}[/]", row.detail, row.fix)
    console.print(table)


def run_doctor() -> int:
    """Checks, prints the table and a verdict; returns the exit code (0: ``homerlhf demo`` would run)."""
    from rich.console import Console

    out, err = Console(), Console(file=sys.stderr)  # the real stderr, also while a check silences it
    with err.status("checking", spinner="dots") as status:
        rows = run_checks(lambda text: status.update(f"checking {text} ..."))
    render(rows, out)
    for line in verdict_lines(rows):
        out.print(line, highlight=False, soft_wrap=True)  # whole lines: the command must not break
    return 1 if any(r.status == FAIL for r in rows) else 0


NEXT_ON_GPU = ("on this GPU: `homerlhf check` (a few minutes: short PPO and GRPO runs sized to this card, each "
               "phase's memory against the plan; its JSON report is what `homerlhf plan --calibration` reads)")


def verdict_lines(rows: list[Check]) -> list[str]:
    """The verdict under the table: ready or not and why; where a CUDA device was found, the next step
    (:data:`NEXT_ON_GPU`), once."""
    failed = [r.name for r in rows if r.status == FAIL]
    warned = [r.name for r in rows if r.status == WARN]
    if failed:
        lines = [f"not ready: {len(failed)} check(s) failed ({', '.join(failed)}); see 'what to do'"]
    else:
        note = f" ({len(warned)} warning(s): {', '.join(warned)})" if warned else ""
        lines = [f"ready: `homerlhf demo` will run{note}"]
    on_gpu = any(r.name.startswith("CUDA ") and r.status == OK for r in rows)  # check_cuda's rows, one per device
    return lines + ([("once they are fixed, next " if failed else "next ") + NEXT_ON_GPU] if on_gpu else [])
