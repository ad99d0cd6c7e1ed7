"""`homerlhf export policy`: what a PPO run trained, as a model anyone can run elsewhere.

From one checkpoint's ``actor`` adapter (``--checkpoint N|last|best``) it writes ``OUT/``: a merged
HF model (safetensors, config, tokenizer with its chat template, a generation config stopping
where the run's rollouts stopped) in the dtype the policy computed in (``--dtype`` for another),
``OUT/gguf/`` with the GGUFs asked for and an Ollama Modelfile per GGUF, ``README.md`` (the model
card) and ``export.json`` (what was exported and the measured log-prob gap), and optionally uploads
``OUT`` to the Hub.

:func:`plan_policy_export` (:mod:`homerlhf.stages.export_plan`) checks everything it can from files
alone before :func:`run_policy_export` loads a weight. ``OUT`` is written as a temporary sibling and
renamed into place at the end: a failed export leaves no half-written directory and replaces nothing.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence

from homerlhf.errors import UserError
from homerlhf.stages.export_plan import (ACTOR, EXPORT_FILE, PolicyExport, Progress,  # noqa: F401 - the API
                                         plan_policy_export, resolve_checkpoint, rounding_note, verify_policy_files)


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
    """The merged HF model in ``tmp`` (in ``plan.dtype``) and its log-prob gap to the trained policy on
    held sequences."""
    import torch
    from transformers import AutoModelForCausalLM

    from homerlhf.models.generation import stop_token_ids
    from homerlhf.models.policy import load_tokenizer
    from homerlhf.workers.gguf.merge import (load_trained_policy, logprob_gap, policy_tensors, sequence_logprobs,
                                             write_model_files, write_safetensors)
    from homerlhf.workers.gguf.policy import stop_tokens

    policy = load_trained_policy(plan.base_dir, plan.checkpoint / ACTOR, plan.cfg.quant, plan.cfg.card.device)
    tokenizer = load_tokenizer(str(plan.base_dir))
    stop_ids = stop_token_ids(tokenizer, policy.model.get_base_model().generation_config)
    write_safetensors(policy_tensors(policy, plan.base_dir, plan.base), tmp, getattr(torch, plan.dtype))
    write_model_files(plan.base_dir, tmp, plan.dtype, stop_ids)
    sequences = probe_sequences(plan.run_dir, tokenizer)
    trained = sequence_logprobs(policy.model, sequences)
    del policy
    gc.collect()  # bitsandbytes' Params4bit <-> Linear4bit cycle: the 4-bit model goes only now
    merged = AutoModelForCausalLM.from_pretrained(tmp, device_map="cpu")  # as a user loads it
    gap = logprob_gap(trained, sequence_logprobs(merged, sequences))
    del merged
    return {"dtype": plan.dtype, "compute_dtype": plan.compute, "gap": {**gap, "sequences": len(sequences)},
            "stop_ids": stop_ids, "stop_tokens": stop_tokens(tokenizer, stop_ids)}


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
        result["rounding"] = rounding_note(result)  # None when saved in the dtype the policy computed in
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
