"""Reference and reward backends served by llama.cpp workers, and the factories the trainer calls.

``llamacpp_reference`` / ``llamacpp_reward`` export the GGUF a run needs into a cache (keyed by the
model files and the export options), spawn a local worker (or use ``url`` for a remote one), and
check that the worker's vocabulary is the actor tokenizer's, id for id. ``submit_*`` runs requests
in threads, so CPU scoring overlaps GPU work in the trainer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from homerlhf.errors import UserError
from homerlhf.memory.threads import run_thread_shares
from homerlhf.ppo.backends import ReferenceBackend, RewardBackend, TokenIds
from homerlhf.workers.client import WorkerClient, WorkerError, sequences_body
from homerlhf.workers.process import WorkerProcess
from homerlhf.workers.tokens import client_token
from homerlhf.workers.vocab import tokenizer_fingerprint

if TYPE_CHECKING:  # pragma: no cover
    from homerlhf.config.schema import BackendConfig, RunConfig

# Sequences per HTTP request: bounds what a dying worker makes us re-send.
REQUEST_SEQUENCES = 16
# Concurrent submits per backend; the worker serves one at a time, so more only queue there.
SUBMIT_THREADS = 2


class _WorkerBackend:
    client: WorkerClient
    _executor: Optional[ThreadPoolExecutor] = None

    def _post_all(self, path: str, key: str, prompt_ids: TokenIds, response_ids: TokenIds, **extra) -> list:
        out: list = []
        for body in self._chunks(prompt_ids, response_ids):
            body.update(extra)
            answer = self.client.post(path, body)[key]
            if len(answer) != len(body["sequences"]):  # one result per sample, or none at all
                raise WorkerError(f"{path}: {len(answer)} results for {len(body['sequences'])} sequences")
            out.extend(answer)
        return out

    def _submit(self, fn, *args) -> Future:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=SUBMIT_THREADS, thread_name_prefix=type(self).__name__)
        return self._executor.submit(fn, *args)

    def _chunks(self, prompt_ids: TokenIds, response_ids: TokenIds):
        for start in range(0, len(prompt_ids), REQUEST_SEQUENCES):
            end = start + REQUEST_SEQUENCES
            yield sequences_body(prompt_ids[start:end], response_ids[start:end])

    def health(self) -> dict:
        return self.client.health()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self.client.close()


class LlamaCppReference(_WorkerBackend, ReferenceBackend):
    """Reference log-probs from a ref worker (``POST /logprobs``), at the actor's sampling
    ``temperature``: the worker scores ``log_softmax(logits / temperature)`` as the actor does."""

    def __init__(self, client: WorkerClient, temperature: float = 1.0):
        self.client = client
        self.temperature = float(temperature)

    def logprobs(self, prompt_ids: TokenIds, response_ids: TokenIds) -> list[list[float]]:
        if len(prompt_ids) == 0:
            return []
        return self._post_all("/logprobs", "logprobs", prompt_ids, response_ids, temperature=self.temperature)


class LlamaCppReward(_WorkerBackend, RewardBackend):
    """Scalar scores from a reward worker (``POST /score``)."""

    def __init__(self, client: WorkerClient):
        self.client = client

    def score(self, prompt_ids: TokenIds, response_ids: TokenIds) -> list[float]:
        if len(prompt_ids) == 0:
            return []
        return self._post_all("/score", "scores", prompt_ids, response_ids)


# --------------------------------------------------------------------------- connecting


def check_worker(health: dict, role: str, fingerprint: Optional[str], where: str) -> None:
    """The worker serves ``role`` and the actor's vocabulary, or a UserError says which is wrong."""
    if health.get("role") != role:
        raise UserError(f"the worker at {where} serves role {health.get('role')!r}, not {role!r}; point {role}.url at a {role} worker")
    if fingerprint is not None and health.get("vocab_fingerprint") != fingerprint:
        raise UserError(
            f"the {role} worker at {where} ({health.get('model')}) has a different vocabulary from the actor's tokenizer; "
            f"the {role} model must share the policy's tokenizer (same tokens in the same order)"
        )


def connect(role: str, *, url: Optional[str] = None, token: Optional[str] = None,
            process: Optional[WorkerProcess] = None, fingerprint: Optional[str] = None,
            temperature: float = 1.0):
    """A started, checked backend for ``role`` (``ref`` or ``reward``); a ref backend asks for
    log-probs at ``temperature``."""
    client = WorkerClient(url=url, token=token, process=process)
    try:
        health = client.start()
        check_worker(health, role, fingerprint, client.where)
    except WorkerError as exc:
        client.close()
        hint = f"check {role}.url (is the worker running?)" if process is None else f"see {process.log_path}"
        raise UserError(f"cannot use the {role} worker: {exc}; {hint}") from None
    except BaseException:
        client.close()
        raise
    return LlamaCppReference(client, temperature) if role == "ref" else LlamaCppReward(client)


# --------------------------------------------------------------------------- GGUF cache


def _files_signature(model_dir: Path) -> list:
    return sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns)
        for p in model_dir.iterdir()
        if p.is_file() and (p.suffix in (".json", ".safetensors", ".bin", ".model", ".txt", ".jinja"))
    )


def cache_key(kind: str, model_dir: Path, **options) -> str:
    """Hash of the model files (name, size, mtime) and the export options."""
    from homerlhf.workers.gguf import FORMAT_VERSION

    blob = json.dumps({"kind": kind, "format": FORMAT_VERSION, "model": str(model_dir.resolve()),
                       "files": _files_signature(model_dir), "options": options}, sort_keys=True, default=str)
    return f"{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:20]}"


def cached_ref_gguf(model: str, outtype: str, from_nf4: bool, quant=None, device: str = "cpu") -> Path:
    """The reference GGUF for ``model``, exported once into the cache."""
    from homerlhf.models.registry import resolve_model_dir
    from homerlhf.paths import cache_dir
    from homerlhf.workers.gguf import export_ref

    model_dir = resolve_model_dir(model)
    options = {"outtype": outtype, "from_nf4": from_nf4,
               "quant": quant.model_dump() if (from_nf4 and quant) else None, "device": device if from_nf4 else None}
    path = cache_dir("gguf", cache_key("ref", model_dir, **options)) / "ref.gguf"
    if not path.exists():
        export_ref(str(model_dir), path, outtype=outtype, from_nf4=from_nf4, quant=quant, device=device)  # atomic
    return path


def cached_reward_dir(model: str, outtype: str) -> Path:
    """An exported reward dir for ``model``: the run's own ``gguf/`` if it has one, else a cached export."""
    from homerlhf.models.registry import resolve_model_dir
    from homerlhf.paths import cache_dir
    from homerlhf.workers.gguf import export_reward, reward_model_dir

    root = resolve_model_dir(model)
    if (root / "gguf" / "manifest.json").exists():
        return root / "gguf"
    if (root / "manifest.json").exists() and (root / "backbone.gguf").exists():
        return root
    model_dir = reward_model_dir(str(root))
    final = cache_dir("gguf") / cache_key("reward", model_dir, outtype=outtype)
    if (final / "manifest.json").exists():
        return final
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    export_reward(str(model_dir), tmp, outtype=outtype)
    if final.exists():  # a half-written dir from an interrupted run (no manifest)
        shutil.rmtree(final, ignore_errors=True)
    try:
        os.replace(tmp, final)
    except OSError:  # another process won the race; its export is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# --------------------------------------------------------------------------- factories (trainer API)


def _process(role: str, model: Path, rc: "BackendConfig", cfg: "RunConfig", run_dir) -> WorkerProcess:
    ctx = rc.ctx or (cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens)
    log = Path(run_dir) / "workers" / f"{role}.log" if run_dir else None
    threads = rc.threads or run_thread_shares(cfg).worker  # never every core for each worker
    return WorkerProcess(role, model, threads=threads, ctx=ctx, f32_kv_cache=rc.f32_kv_cache, log_path=log)


def gguf_as_reference(path: Path, tokenizer, vocab_rows: int) -> Path:
    """A ``ref.model`` .gguf served as it is, after its vocabulary is checked against the policy's."""
    from homerlhf.workers.engine import read_gguf_info
    from homerlhf.workers.vocab import check_same_vocabulary

    if not path.is_file():
        raise UserError(f"ref.model {path} does not exist; give an existing .gguf file")
    check_same_vocabulary(read_gguf_info(path, all_tokens=True).tokens, tokenizer, vocab_rows, f"ref.model {path}")
    print(f"[homerlhf] warning: ref.model {path.name} is served as it is, not exported from the policy's weights: "
          "the step-0 KL will not be ~0 (iteration 1's kl_mean measures it)", file=sys.stderr, flush=True)
    return path


def llamacpp_reference(cfg: "RunConfig", policy_model_path: str, tokenizer, run_dir,
                       vocab_rows: Optional[int] = None) -> LlamaCppReference:
    """The ref backend of a run: ``cfg.ref.url`` if set, else a local worker on ``cfg.ref.model``
    as it is when that is a .gguf file (``vocab_rows``: the policy's embedding rows), else on its
    exported GGUF (default: the policy base, dequantized NF4 when ``cfg.ref.from_nf4``).
    Log-probs are asked for at ``cfg.rollout.temperature``, the actor's."""
    rc = cfg.ref
    fingerprint = tokenizer_fingerprint(tokenizer)
    temperature = cfg.rollout.temperature
    if rc.url:
        return connect("ref", url=rc.url, token=client_token("ref", rc.token, rc.token_file), fingerprint=fingerprint,
                       temperature=temperature)
    if rc.model and rc.model.endswith(".gguf"):
        gguf = gguf_as_reference(Path(rc.model).expanduser(), tokenizer, vocab_rows or len(tokenizer))
        return connect("ref", process=_process("ref", gguf, rc, cfg, run_dir), fingerprint=None, temperature=temperature)
    gguf = cached_ref_gguf(rc.model or policy_model_path, rc.outtype, rc.from_nf4, cfg.quant, cfg.card.device)
    return connect("ref", process=_process("ref", gguf, rc, cfg, run_dir), fingerprint=fingerprint, temperature=temperature)


def llamacpp_reward(cfg: "RunConfig", tokenizer, run_dir) -> LlamaCppReward:
    """The reward backend of a run: ``cfg.reward.url`` if set, else a local worker on the exported
    ``cfg.reward.model`` (a reward run dir, an exported dir, or a seqcls checkpoint)."""
    rc = cfg.reward
    fingerprint = tokenizer_fingerprint(tokenizer)
    if rc.url:
        return connect("reward", url=rc.url, token=client_token("reward", rc.token, rc.token_file), fingerprint=fingerprint)
    if not rc.model:
        raise UserError("reward.model is required for the llamacpp reward backend (a reward run dir or HF dir), or set reward.url")
    export_dir = cached_reward_dir(rc.model, rc.outtype)
    return connect("reward", process=_process("reward", export_dir, rc, cfg, run_dir), fingerprint=fingerprint)
