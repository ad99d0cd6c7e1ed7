"""`homerlhf export policy`: what a PPO run trained, as a model anyone can run elsewhere.

From one checkpoint's ``actor`` adapter (``--checkpoint N|last|best``) it writes ``OUT/``: a merged
HF model (safetensors, config, tokenizer with its chat template, a generation config stopping
where the run's rollouts stopped) in bf16 (fp16 for an fp16 base), ``OUT/gguf/`` with the GGUFs
asked for and an Ollama Modelfile per GGUF, ``README.md`` (the model card) and ``export.json``
(what was exported and the measured log-prob gap), and optionally uploads ``OUT`` to the Hub.

:func:`plan_policy_export` checks everything it can from files alone (the run, the checkpoint and that
its actor is what its manifest recorded, the adapter, the output dir, the architecture and tokenizer
for GGUF, the Hub login) before :func:`run_policy_export` loads a weight. ``OUT`` is written as a
temporary sibling and renamed into place at the end: a failed export leaves no half-written
directory and replaces nothing.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from homerlhf.config import RunConfig
from homerlhf.errors import UserError

ACTOR = "actor"
EXPORT_FILE = "export.json"
Progress = Callable[[float, str], None]


@dataclass
class PolicyExport:
    """An export checked and ready to run: nothing here has loaded a weight."""

    run_dir: Path
    checkpoint: Path
    iteration: int
    cfg: RunConfig
    base_dir: Path
    out: Path
    base: str = "nf4"
    gguf: list[str] = field(default_factory=list)
    hub_repo: Optional[str] = None
    private: bool = False
    overwrite: bool = False

    @property
    def name(self) -> str:
        """The file stem of the GGUFs and the Ollama model name: the output dir's name, tidied."""
        return re.sub(r"[^a-z0-9._-]+", "-", self.out.resolve().name.lower()).strip("-.") or "policy"


def resolve_checkpoint(run_dir: Path, which: str) -> Path:
    """The checkpoint ``--checkpoint`` names: an iteration number, ``last`` or ``best`` (the one whose
    iteration logged the highest ``score_mean``, the mean reward of its rollouts), among those whose
    manifest was written (whether their files still match it is :func:`verify_policy_files`'s)."""
    from homerlhf.ppo.checkpoint import checkpoint_dirs, checkpoint_name, sealed_checkpoints

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory; give the --out of a `homerlhf train` run")
    found, dirs = sealed_checkpoints(run_dir), checkpoint_dirs(run_dir)
    which = str(which).strip().lower()
    if dirs and which == "last":
        return dirs[-1]  # sealed or not: verify_policy_files refuses an unsealed one, never passes it over
    if not found:
        raise UserError(f"{run_dir} has no complete checkpoint: nothing trained to export yet "
                        "(checkpoints are written every checkpoint.every iterations and at the end)")
    if which == "best":
        return _best_checkpoint(run_dir, found)
    iterations = ", ".join(str(int(p.name.split("_")[1])) for p in found)
    if not which.isdigit():
        raise UserError(f"--checkpoint {which!r}: give an iteration number ({iterations}), last or best")
    wanted = run_dir / "checkpoints" / checkpoint_name(int(which))
    if wanted not in found:
        raise UserError(f"--checkpoint {int(which)}: {run_dir} has no complete checkpoint of that iteration; "
                        f"it has {iterations} (or pass last or best)")
    return wanted


def verify_policy_files(ckpt: Path) -> None:
    """Refuse a checkpoint whose actor adapter or config is not what its manifest recorded, naming
    the file and the newest earlier checkpoint to export instead."""
    from homerlhf.ppo.checkpoint import POLICY_FILES, verify_checkpoint

    def fix(fallback: Optional[Path]) -> str:
        if fallback is None:
            return "no earlier checkpoint's actor is intact: restore the file from a backup, or train again"
        return f"export {fallback.name} instead with --checkpoint {int(fallback.name.split('_')[1])}"

    verify_checkpoint(ckpt, POLICY_FILES, fix)


def _best_checkpoint(run_dir: Path, found: list[Path]) -> Path:
    from homerlhf.ppo.metrics import read_metrics

    scores = {int(r["iteration"]): r["score_mean"] for r in read_metrics(run_dir)
              if isinstance(r.get("score_mean"), (int, float))}
    scored = [(scores[int(p.name.split("_")[1])], i, p) for i, p in enumerate(found) if int(p.name.split("_")[1]) in scores]
    if not scored:
        raise UserError(f"--checkpoint best: {run_dir}/metrics.jsonl has no score_mean for any kept checkpoint; "
                        "pass last or an iteration number")
    return max(scored)[2]  # a tie goes to the later checkpoint


def _check_out(out: Path, run_dir: Path, overwrite: bool) -> Path:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; choose a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out {out} already exists and is not empty; pass --overwrite to replace it or choose another --out")
    if out.exists() and (out.resolve() == run_dir.resolve() or out.resolve() in run_dir.resolve().parents):
        raise UserError(f"--out {out} holds the run {run_dir} itself; choose another --out")
    return out


def _check_hub(repo: Optional[str], private: bool) -> None:
    if repo is None:
        if private:
            raise UserError("--private makes sense only with --push-to-hub REPO")
        return
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", repo):
        raise UserError(f"--push-to-hub {repo!r} is not a Hub repo id; use NAME or USER/NAME")
    import huggingface_hub

    if huggingface_hub.get_token() is None:  # read from HF_TOKEN or the saved login, never shown
        raise UserError("--push-to-hub: no Hugging Face login; run `hf auth login` or set HF_TOKEN, then export again")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        raise UserError("--push-to-hub: HF_HUB_OFFLINE is set, so nothing can be uploaded; unset it or drop --push-to-hub")


def plan_policy_export(run_dir: str | Path, out: str | Path, checkpoint: str = "last", base: str = "nf4",
                       gguf: Sequence[str] = (), push_to_hub: Optional[str] = None, private: bool = False,
                       overwrite: bool = False) -> PolicyExport:
    """Every check the export can make without loading a weight, in one-line ``UserError``s."""
    from homerlhf.models.registry import resolve_model_dir
    from homerlhf.ppo.resuming import saved_config
    from homerlhf.workers.gguf.merge import BASES
    from homerlhf.workers.gguf.policy import check_policy_gguf, parse_types

    if base not in BASES:
        raise UserError(f"--base {base!r} is not known; use nf4 (the weights the actor trained on) or original")
    types = parse_types(gguf)
    _check_hub(push_to_hub, private)
    run_dir = Path(run_dir)
    out = _check_out(Path(out), run_dir, overwrite)
    ckpt = resolve_checkpoint(run_dir, checkpoint)
    verify_policy_files(ckpt)  # before its config or a weight is read
    if not (ckpt / ACTOR / "adapter_model.safetensors").is_file() or not (ckpt / ACTOR / "adapter_config.json").is_file():
        raise UserError(f"checkpoint {ckpt} has no actor adapter ({ACTOR}/adapter_model.safetensors); "
                        "export a checkpoint of a `homerlhf train` run")
    cfg = saved_config(ckpt)
    base_dir = resolve_model_dir(cfg.model.name_or_path)
    config = json.loads((base_dir / "config.json").read_text()) if (base_dir / "config.json").is_file() else {}
    if config.get("quantization_config"):
        raise UserError(f"{base_dir} is a pre-quantized checkpoint; export needs the unquantized base the run loaded")
    if types:
        check_policy_gguf(base_dir)
    return PolicyExport(run_dir, ckpt, int(ckpt.name.split("_")[1]), cfg, base_dir, out, base, types,
                        push_to_hub, private, overwrite)


def probe_sequences(run_dir: Path, tokenizer, n_samples: int = 4, max_len: int = 128) -> list[list[int]]:
    """The held sequences the export is checked on: the run's last logged samples (prompt + response
    as it scored them) and two chats through the chat template, at most ``max_len`` tokens each."""
    rows = []
    samples = Path(run_dir) / "samples.jsonl"
    if samples.is_file():
        rows = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()][-n_samples:]
    texts = [r.get("prompt", "") + r.get("response", "") for r in rows]
    sequences = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts if t]
    chats = [[{"role": "user", "content": "Tell me about tea."}, {"role": "assistant", "content": "Tea is made from leaves."}],
             [{"role": "user", "content": "Can you help me with my garden?"}, {"role": "assistant", "content": "Gladly: water it."}]]
    if getattr(tokenizer, "chat_template", None):
        sequences += [list(tokenizer.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"]) for c in chats]
    else:
        sequences += [tokenizer(c[0]["content"] + " " + c[1]["content"])["input_ids"] for c in chats]
    return [s[:max_len] for s in sequences if len(s) >= 2]


class _Steps:
    """The export's coarse progress (0..1 and what runs now) for a caller's bar, e.g. the app's."""

    def __init__(self, progress: Optional[Progress], names: list[str]):
        self.progress, self.names, self.done = progress, names, 0

    def __call__(self, name: str) -> None:
        if self.progress is not None:
            self.progress(self.done / len(self.names), name)
        self.done += 1

    def finish(self) -> None:
        if self.progress is not None:
            self.progress(1.0, "done")


def _move_into_place(tmp: Path, out: Path) -> None:
    """``tmp`` becomes ``out``; an earlier ``out`` (``--overwrite``) is removed only once it has."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _merge_and_check(plan: PolicyExport, tmp: Path) -> dict[str, Any]:
    """The merged HF model in ``tmp`` and its log-prob gap to the trained policy on held sequences."""
    import torch
    from transformers import AutoModelForCausalLM

    from homerlhf.models.generation import stop_token_ids
    from homerlhf.models.policy import load_tokenizer
    from homerlhf.workers.gguf.merge import (load_trained_policy, logprob_gap, output_dtype, policy_tensors,
                                             sequence_logprobs, write_model_files, write_safetensors)
    from homerlhf.workers.gguf.policy import stop_tokens

    policy = load_trained_policy(plan.base_dir, plan.checkpoint / ACTOR, plan.cfg.quant, plan.cfg.card.device)
    tokenizer = load_tokenizer(str(plan.base_dir))
    stop_ids = stop_token_ids(tokenizer, policy.model.get_base_model().generation_config)
    dtype = output_dtype(plan.base_dir)
    write_safetensors(policy_tensors(policy, plan.base_dir, plan.base), tmp, getattr(torch, dtype))
    write_model_files(plan.base_dir, tmp, dtype, stop_ids)
    sequences = probe_sequences(plan.run_dir, tokenizer)
    trained = sequence_logprobs(policy.model, sequences)
    del policy
    gc.collect()  # bitsandbytes' Params4bit <-> Linear4bit cycle: the 4-bit model goes only now
    merged = AutoModelForCausalLM.from_pretrained(tmp, device_map="cpu")  # as a user loads it
    gap = logprob_gap(trained, sequence_logprobs(merged, sequences))
    del merged
    return {"dtype": dtype, "gap": {**gap, "sequences": len(sequences)}, "stop_ids": stop_ids,
            "stop_tokens": stop_tokens(tokenizer, stop_ids)}


def commands(out: Path, name: str, ggufs: Sequence[dict]) -> list[str]:
    """How to run what was written: transformers, and llama.cpp / Ollama for the first GGUF."""
    lines = [f"python -c \"from transformers import pipeline; print(pipeline('text-generation', '{out}')"
             "([{'role': 'user', 'content': 'Hello!'}]))\""]
    if ggufs:
        first = ggufs[0]
        lines += [f"llama-cli -m {out / first['path']} --jinja -cnv",
                  f"ollama create {name} -f {out / first['modelfile']} && ollama run {name}"]
    return lines


def run_policy_export(plan: PolicyExport, progress: Optional[Progress] = None) -> dict[str, Any]:
    """Runs a checked export; returns what ``export.json`` holds (files, gap, GGUFs, commands)."""
    from homerlhf.stages.model_card import model_card
    from homerlhf.workers.gguf.policy import export_policy_gguf

    steps = _Steps(progress, ["merge the actor into its base", *[f"GGUF {t}" for t in plan.gguf], "model card"]
                   + (["upload to the Hub"] if plan.hub_repo else []))
    tmp = plan.out.with_name(f".{plan.out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        steps("merge the actor into its base")
        result: dict[str, Any] = {"run_dir": str(plan.run_dir), "checkpoint": str(plan.checkpoint),
                                  "iteration": plan.iteration, "base": plan.base, **_merge_and_check(plan, tmp)}
        ggufs = export_policy_gguf(tmp, tmp / "gguf", plan.gguf, plan.name, result["stop_tokens"],
                                   on_type=lambda t: steps(f"GGUF {t}"))
        result["gguf"] = [{"type": g.outtype, "path": str(g.path.relative_to(tmp)),
                           "modelfile": str(g.modelfile.relative_to(tmp)), "tensors": g.summary} for g in ggufs]
        result["commands"] = commands(plan.out, plan.name, result["gguf"])
        steps("model card")
        (tmp / "README.md").write_text(model_card(plan, result))
        result["files"] = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file()) + [EXPORT_FILE]
        (tmp / EXPORT_FILE).write_text(json.dumps(result, indent=2) + "\n")
        _move_into_place(tmp, plan.out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if plan.hub_repo:
        steps("upload to the Hub")
        result["hub_url"] = push_to_hub(plan.out, plan.hub_repo, plan.private)
    steps.finish()
    return {**result, "out": str(plan.out)}


def push_to_hub(out: Path, repo: str, private: bool) -> str:
    """Uploads ``out`` to the Hub repo ``repo`` (created if missing) with the token of the environment
    or the saved login, which is never written or shown. Untested here: no machine of ours reaches the Hub."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        url = api.create_repo(repo, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(folder_path=str(out), repo_id=url.repo_id, repo_type="model",
                          commit_message="homerlhf export policy")
    except Exception as exc:  # noqa: BLE001 - any hub failure: the export itself is done
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise UserError(f"the export is in {out}, but the upload to {repo} failed ({type(exc).__name__}: {first}); "
                        f"upload it again with `hf upload {repo} {out}`", exit_code=1) from None
    return str(url)


def export_policy(run_dir: str | Path, out: str | Path, progress: Optional[Progress] = None, **options) -> dict[str, Any]:
    """:func:`plan_policy_export` then :func:`run_policy_export` (``options``: the plan's keywords)."""
    return run_policy_export(plan_policy_export(run_dir, out, **options), progress)
