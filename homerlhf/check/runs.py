"""What ``homerlhf check`` and the GPU scripts (``scripts/validate_memory_gpu.py``,
``benchmarks/gpu_generation.py``) share: checkpoints with random
weights of a published shape (and a reward adapter on one), a card's memory cap, the measured
iterations of a trainer, and a trainer's state to compare across a resume.

Nothing is downloaded: the architecture is the planner's builtin table entry
(:mod:`homerlhf.memory.shapes`), its weights are initialised on the device it will run on (a 7B in
about 30 s on an H200) and saved with the tiny builtin tokenizer (:func:`homerlhf.tiny.build_tokenizer`),
then loaded in NF4 as a user's model is. Random weights rarely sample the end-of-turn token, so
every response runs to ``rollout.max_new_tokens``: the memory plan's worst case.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any, Optional

GIB = 2**30


def models_dir() -> Path:
    """Where GPU checkpoints are kept across runs: ``$HOMERLHF_GPU_MODELS`` (``scripts/gpu_session.sh``:
    ``.gpu-models`` of the checkout, gitignored), else ``check-models`` in the homerlhf cache
    (:func:`homerlhf.paths.cache_dir`): a disk, not ``/tmp`` (which may be RAM), and a folder the next
    run on the same machine finds (a 7B's random checkpoint is ~15 GB)."""
    import os

    from homerlhf.paths import cache_dir

    return Path(os.environ.get("HOMERLHF_GPU_MODELS") or cache_dir("check-models"))


def checkpoint_dir(shape, out_dir: Path, seed: int = 0, device: str = "cuda") -> Path:
    """Where :func:`build_random_checkpoint` puts ``shape``'s checkpoint: on a GPU, the shared
    :func:`models_dir` by shape and seed; on the CPU (tiny models), ``out_dir``."""
    if device == "cuda":
        return models_dir() / f"{shape.name.replace('/', '--')}-seed{seed}"
    return out_dir


def build_random_checkpoint(shape, out_dir: Path, seed: int = 0, device: str = "cuda") -> Path:
    """``shape``'s architecture with random weights (bf16 on a GPU, fp32 on the CPU), initialised on
    ``device``, saved with the tiny tokenizer (its ids as pad/eos/bos) into :func:`checkpoint_dir`.

    A GPU checkpoint is built once per shape and seed: the next script of the session (or the next
    case) loads it instead of building it again (a 7B: ~30 s saved); it is written under another
    name and renamed, so a killed build is never reused."""
    final = checkpoint_dir(shape, out_dir, seed, device)
    if device != "cuda":
        return _save_random_checkpoint(shape, final, seed, device)
    if (final / "config.json").is_file():
        return final
    partial = final.with_name(final.name + ".partial")
    _save_random_checkpoint(shape, partial, seed, device)
    partial.rename(final)
    return final


def _save_random_checkpoint(shape, out_dir: Path, seed: int, device: str) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from homerlhf.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = shape.to_hf_config()
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    del model
    release_memory()
    return out_dir


def build_reward_adapter(base: Path, out: Path, device: str = "cuda") -> Path:
    """A reward model's LoRA + score head on ``base`` as ``homerlhf reward`` saves one (``adapter/``: peft
    SEQ_CLS, the head in its modules_to_save), its LoRA B and head random so that scores vary. Its
    base is recorded in the adapter config: ``reward.backend=adapter`` checks it by fingerprint."""
    import torch
    import transformers
    from peft import get_peft_model
    from transformers import AutoModelForSequenceClassification

    from homerlhf.config import load_config
    from homerlhf.models.policy import peft_lora_config

    torch.manual_seed(1)
    quiet, level = transformers.logging, transformers.logging.get_verbosity()
    quiet.set_verbosity_error()  # its load report: no score head in a causal LM (as expected), its LM head unused
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            str(base), num_labels=1, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
            device_map={"": torch.cuda.current_device() if device == "cuda" else device})
    finally:
        quiet.set_verbosity(level)
    peft_model = get_peft_model(model, peft_lora_config(load_config("4090").rm.lora, "SEQ_CLS"))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or ".score." in name:
                param.normal_(std=0.02)
    peft_model.save_pretrained(str(out / "adapter"))
    del model, peft_model
    release_memory()
    return out


def random_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random ids of the tokenizer (no special ones): the plan's longest."""
    import torch

    ids = torch.randint(8, len(tokenizer), (n, length), generator=torch.Generator().manual_seed(0), device="cpu")
    return ids.tolist()


def release_memory() -> None:
    """Collect garbage, free every cuBLAS workspace and hand cached CUDA blocks back (between cases).

    PyTorch keeps a workspace per (cuBLAS handle, stream) for the process (32 MiB on an H200): each
    case's model makes a decode side stream of its own (``StepGraphs``), whose workspace would
    otherwise stay allocated and count in every later case's peaks (``torch._C._cuda_clearCublasWorkspaces``,
    as torch's own tests and CUDA-graph trees free them). The next matmul on a stream makes its anew."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()


REPORTED_SHORT = 0.05  # a card reports up to this share less than its size (an RTX 4090: 23.99 of 24 GiB)


def cap_memory(cap_gib: float | None) -> float:
    """Cap this process's CUDA allocations at ``cap_gib`` (a card's size; None: the whole GPU) with
    ``torch.cuda.set_per_process_memory_fraction``. Returns the GPU's GiB.

    A cap at or a little over this GPU's memory (within :data:`REPORTED_SHORT`: a 24 GiB RTX 4090
    reports about 23.99 GiB) is the whole GPU; one well over it is an error: the case was planned
    for a larger card."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory / GIB
    if cap_gib is not None and not 0 < cap_gib <= total / (1 - REPORTED_SHORT):
        raise ValueError(f"a cap of {cap_gib:g} GiB must be in (0, {total:.2f}] (this GPU's memory; a card's "
                         f"nominal size up to {REPORTED_SHORT:.0%} over what it reports is taken as the whole card)")
    torch.cuda.set_per_process_memory_fraction(1.0 if cap_gib is None else min(1.0, cap_gib / total))
    return total


def measured_iterations(trainer, iterations: int) -> dict[str, Any]:
    """Run ``iterations`` trainer steps. Returns every iteration's metrics row (``rows``), the last
    iteration's allocated peak per phase (``measured_gib``, ``trainer.meters.memory.peaks()``: the first
    iteration runs before the optimizer states exist) and the most memory the allocator reserved
    (``max_reserved_gib``; None on the CPU). The meter resets CUDA's peak counters at every phase,
    so reserved memory is read after each iteration as well as the last phase's peak: the
    allocator returns nothing to the driver unless emptied."""
    import torch

    on_cuda = trainer.meters.memory.kind == "cuda_max_allocated"
    rows, reserved = [], 0
    for _ in range(iterations):
        rows.append(trainer.step())
        if on_cuda:
            reserved = max(reserved, torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved())
    decoder = trainer.policy.static_decoder
    sampled = getattr(trainer, "sampled", None)  # measures.recording_trainer's
    return {"rows": rows, "measured_gib": dict(trainer.meters.memory.peaks()),
            "max_reserved_gib": round(reserved / GIB, 4) if on_cuda else None, "decoder": decoder_used(trainer),
            "graphs_captured": decoder.graphs_captured, "captured_replays": decoder.replays,
            "step_skipped": [bool(s.get("skipped")) for s in trainer.updater.state.history],
            "sampled_vs_scored": sampled.summary() if sampled is not None else None}


def optimizer_steps(rows: list[dict]) -> dict:
    """The optimizer steps of ``rows`` (metrics rows): taken and skipped (a loss-scale overflow or a
    non-finite loss), and the fp16 loss scale after the last."""
    steps = sum(int(r.get("optimizer_steps", 0)) for r in rows)
    skipped = sum(int(r.get("nonfinite_skipped_steps", 0)) for r in rows)
    return {"steps": steps, "taken": steps - skipped, "skipped": skipped, "loss_scale": rows[-1].get("loss_scale")}


def decoder_used(trainer) -> str:
    """What sampled the rollouts (``rollout.decoder``): HF ``generate``, the static loop with its step
    captured as a CUDA graph (said only once a graph was made and replayed: ``StaticDecoder.replays``),
    eager on the CPU, or HF ``generate`` after the loop declined, and why."""
    from homerlhf.models.static_decode import resolve_decoder

    policy = trainer.policy
    if resolve_decoder(trainer.cfg.rollout.decoder, policy.device) == "hf":
        return "hf generate"
    decoder = policy.static_decoder
    if decoder.off_reason is not None:
        return f"hf generate (static loop declined: {decoder.off_reason})"
    if policy.device.type != "cuda":
        return "static loop, eager"
    if decoder.graphs_captured and decoder.replays:
        return "static loop, captured"
    return f"static loop, NOT captured ({decoder.graphs_captured} graphs made, {decoder.replays} replays)"


def snapshot(trainer) -> dict:
    """Everything a resume restores, on the CPU: weights, optimizer states, counters, RNG."""
    import torch

    def flat(prefix, value, out):
        if isinstance(value, dict):
            for key, item in value.items():
                flat(f"{prefix}.{key}", item, out)
        elif isinstance(value, (list, tuple)) and not isinstance(value, str):
            for i, item in enumerate(value):
                flat(f"{prefix}.{i}", item, out)
        elif torch.is_tensor(value):
            out[prefix] = value.detach().cpu().clone()
            out[f"{prefix}:paged"] = bool(getattr(value, "is_paged", False))  # bitsandbytes' unified memory
        else:
            out[prefix] = value
        return out

    params = trainer.policy.actor_parameters() + trainer.policy.critic_parameters()
    state = {f"param.{i}": p.detach().cpu().clone() for i, p in enumerate(params)}
    for name, opt in trainer._optimizers().items():
        flat(f"optimizer.{name}", opt.state_dict()["state"], state)
    flat("trainer", trainer.state_dict(), state)
    flat("stateful", {k: v.state_dict() for k, v in trainer._stateful().items()}, state)
    state["generator"] = trainer.updater.generator.get_state()
    return state


def differences(saved: dict, resumed: dict) -> list[str]:
    import torch

    out = [f"{key} missing" for key in saved.keys() ^ resumed.keys()]
    for key in saved.keys() & resumed.keys():
        a, b = saved[key], resumed[key]
        same = torch.equal(a, b) if torch.is_tensor(a) and torch.is_tensor(b) else a == b
        if not same:
            out.append(key)
    return sorted(out)


def driver_version() -> Optional[str]:
    """The NVIDIA driver's version (``nvidia-smi``), None where it cannot be read."""
    import subprocess

    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


def environment(smoke: bool = False) -> dict:
    """The mode, the date (UTC), and the versions and GPU (none in the CPU smoke: ``device`` None) the
    figures were measured with: its name, memory, compute capability and driver; ``trl`` and ``datasets``
    None where not installed."""
    import datetime
    import importlib.metadata

    import accelerate
    import bitsandbytes
    import peft
    import torch
    import transformers

    out = {"mode": "cpu-smoke" if smoke else "gpu", "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
           "python": sys.version.split()[0], "torch": torch.__version__,
           "cuda": torch.version.cuda, "transformers": transformers.__version__, "peft": peft.__version__,
           "bitsandbytes": bitsandbytes.__version__, "accelerate": accelerate.__version__}
    for name in ("trl", "datasets"):  # the preference cases' (read, not imported: the PPO cases run without them)
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    if not smoke:
        props = torch.cuda.get_device_properties(0)
        out.update(device=props.name, device_gib=round(props.total_memory / 2**30, 2),
                   compute_capability=f"{props.major}.{props.minor}", driver=driver_version())
    return out
