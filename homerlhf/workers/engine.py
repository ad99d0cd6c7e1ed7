"""The llama.cpp engine of a worker: one model and context, decoding packed batches of token ids.

llama.cpp runs in-process through llama-cpp-python's low-level API, so several sequences share one
``llama_decode`` batch (the high-level ``Llama`` class decodes one sequence at a time). Token ids
come in and go out; the engine never tokenizes text.

- ref role, :meth:`Engine.logprobs`: per-token ``log p(response[t] | prompt, response[:t])`` at the
  request's sampling temperature: log-softmax of ``logits / temperature``, done here in float32
  row chunks (:mod:`homerlhf.workers.logsoftmax`): no (n x vocab) copy of the logits.
- reward role, :meth:`Engine.score`: ``score_head · h_last (+ bias)`` where ``h_last`` is the last
  token's post-norm hidden state (LAST pooling) of the sequence as sent, unpadded: the last
  position where the attention mask would be 1, the rule of :mod:`homerlhf.models.scores`.

Serving it over HTTP is :mod:`homerlhf.workers.server`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from homerlhf.errors import UserError
from homerlhf.workers import llama_log
from homerlhf.memory.threads import physical_cores
from homerlhf.workers.logsoftmax import token_logprobs
from homerlhf.workers.vocab import vocab_fingerprint

ROLES = ("ref", "reward")


class BadRequest(Exception):
    """A request the worker refuses with 400 and a message."""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: str
    tokens: list[str]
    tokenizer_size: int
    fingerprint: str  # of the exporting tokenizer (all its tokens), else of ``tokens``


def read_gguf_info(path: Path, all_tokens: bool = False) -> ModelInfo:
    """Name, architecture and vocabulary of a GGUF (vocabulary cut to the tokenizer's own size
    unless ``all_tokens``: then every row's token, padding included)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as exc:  # wrong magic, truncated file, unreadable
        raise UserError(f"{path} is not a readable GGUF file ({exc}); export it again with homerlhf export") from None
    fields = reader.fields

    def value(key, default=None):
        field = fields.get(key)
        return field.contents() if field is not None else default

    tokens = list(value("tokenizer.ggml.tokens", []))
    size = int(value("homerlhf.tokenizer_size", len(tokens)))
    return ModelInfo(
        name=Path(str(value("homerlhf.source", ""))).name or str(value("general.name", path.stem)),
        architecture=str(value("general.architecture", "?")),
        tokens=tokens if all_tokens else tokens[:size],
        tokenizer_size=size,
        fingerprint=str(value("homerlhf.vocab_fingerprint", "") or vocab_fingerprint(tokens[:size])),
    )


class Engine:
    """A llama.cpp model + context, decoding packed batches of sequences."""

    def __init__(self, role: str, model: Path, threads: int = 0, ctx: int = 2048,
                 f32_kv_cache: bool = False, batch_tokens: int = 0, max_seqs: int = 64):
        import llama_cpp
        from llama_cpp import _internals

        if role not in ROLES:
            raise UserError(f"role {role!r} is not known; use ref or reward")
        self.role = role
        self.ctx_len = int(ctx)
        if self.ctx_len < 2:
            raise UserError(f"--ctx {ctx} is too small; use at least 2")
        gguf_path, self.head_weight, self.head_bias = self._resolve(role, Path(model))
        self.info = read_gguf_info(gguf_path)
        self.fingerprint = self.info.fingerprint
        self.kv_size = max(self.ctx_len, batch_tokens or 1024)
        self.max_seqs = max(1, min(max_seqs, llama_cpp.llama_max_parallel_sequences()))
        self.threads = threads or physical_cores()
        self.f32_kv_cache = f32_kv_cache

        llama_log.install()
        llama_cpp.llama_backend_init()
        self._model = _internals.LlamaModel(
            path_model=str(gguf_path), params=llama_cpp.llama_model_default_params(), verbose=False
        )
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = self.kv_size
        params.n_batch = self.kv_size
        params.n_ubatch = self.kv_size
        params.n_seq_max = self.max_seqs
        # Unified KV: packed sequences share the cells, each may use up to ctx of them.
        params.kv_unified = True
        params.n_threads = self.threads
        params.n_threads_batch = self.threads
        if f32_kv_cache:
            params.type_k = 0  # GGML_TYPE_F32: HF-exact; the default F16 costs ~1e-3 in logits
            params.type_v = 0
        if role == "reward":
            params.embeddings = True
            params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_LAST
        self._ctx = _internals.LlamaContext(model=self._model, params=params, verbose=False)
        self._llama = llama_cpp
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._model.vocab)
        self.n_embd = llama_cpp.llama_model_n_embd(self._model.model)
        if self.head_weight is not None and self.head_weight.shape[-1] != self.n_embd:
            raise UserError(f"{model}: score head has {self.head_weight.shape[-1]} inputs, backbone hidden size {self.n_embd}")
        self._batch = llama_cpp.llama_batch_init(self.kv_size, 0, 1)
        self.lock = threading.Lock()
        # Served totals, for throughput and the CPU-side busy time of the overlap figure.
        self.busy_s = 0.0
        self.sequences_served = 0
        self.tokens_served = 0

    @staticmethod
    def _resolve(role: str, model: Path):
        if not model.exists():
            raise UserError(f"model {model} does not exist; export it first (homerlhf export {role})")
        if role == "ref":
            if model.is_dir():
                raise UserError(f"{model} is a directory; the ref worker takes a .gguf file (homerlhf export ref)")
            return model, None, None
        from safetensors.numpy import load_file

        manifest_path = model / "manifest.json" if model.is_dir() else None
        if manifest_path is None or not manifest_path.exists():
            raise UserError(f"{model} is not an exported reward dir (no manifest.json); run `homerlhf export reward`")
        manifest = json.loads(manifest_path.read_text())
        head = load_file(str(model / manifest.get("score_head", "score_head.safetensors")))
        weight = head["weight"].astype(np.float64).reshape(-1)
        bias = float(head["bias"].reshape(-1)[0]) if "bias" in head else 0.0
        return model / manifest.get("backbone", "backbone.gguf"), weight, bias

    def health(self) -> dict:
        return {
            "role": self.role,
            "model": self.info.name,
            "architecture": self.info.architecture,
            "vocab_size": self.n_vocab,
            "tokenizer_size": self.info.tokenizer_size,
            "n_ctx": self.ctx_len,
            "vocab_fingerprint": self.fingerprint,
            "f32_kv_cache": self.f32_kv_cache,
            "threads": self._llama.llama_n_threads(self._ctx.ctx),  # what the context really uses
            "pid": os.getpid(),
            "busy_s": self.busy_s,
            "sequences_served": self.sequences_served,
            "tokens_served": self.tokens_served,
        }

    def _account(self, sequences, started: float) -> None:
        self.busy_s += time.perf_counter() - started
        self.sequences_served += len(sequences)
        self.tokens_served += sum(len(p) + len(r) for p, r in sequences)

    # ----------------------------------------------------------------------- validation + packing

    def validate(self, sequences: list[tuple[list[int], list[int]]]) -> None:
        if not sequences:
            raise BadRequest("no sequences; send at least one {prompt_ids, response_ids}")
        for i, (prompt, response) in enumerate(sequences):
            if not prompt:
                raise BadRequest(f"sequence {i}: prompt_ids is empty; the first response token needs a context")
            n = len(prompt) + len(response)
            if n > self.ctx_len:
                raise BadRequest(f"sequence {i}: {n} tokens exceed the worker context ({self.ctx_len}); start it with a larger --ctx")
            bad = [t for t in (*prompt, *response) if not 0 <= t < self.n_vocab]
            if bad:
                raise BadRequest(f"sequence {i}: token id {bad[0]} is outside the vocabulary [0, {self.n_vocab})")

    def _packs(self, lengths: list[int]) -> list[list[int]]:
        """Greedy packing of sequence indices: <= kv_size tokens and <= max_seqs sequences per decode."""
        packs, current, used = [], [], 0
        for i, n in enumerate(lengths):
            if current and (used + n > self.kv_size or len(current) >= self.max_seqs):
                packs.append(current)
                current, used = [], 0
            current.append(i)
            used += n
        if current:
            packs.append(current)
        return packs

    def _decode(self, seqs: list[list[int]], outputs: list[list[bool]]) -> None:
        llama, batch = self._llama, self._batch
        llama.llama_memory_clear(llama.llama_get_memory(self._ctx.ctx), True)
        j = 0
        for seq_id, (tokens, flags) in enumerate(zip(seqs, outputs)):
            for pos, (token, out) in enumerate(zip(tokens, flags)):
                batch.token[j] = token
                batch.pos[j] = pos
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = seq_id
                batch.logits[j] = out
                j += 1
        batch.n_tokens = j
        rc = llama.llama_decode(self._ctx.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    # ----------------------------------------------------------------------- the two computations

    def logprobs(self, sequences: list[tuple[list[int], list[int]]], temperature: float = 1.0) -> list[list[float]]:
        """Per response token ``log softmax(logits / temperature)[r_t]``, the distribution the actor
        sampled from; row ``i`` of the logits predicts token ``i+1``."""
        if self.role != "ref":
            raise BadRequest("this worker serves the reward role; POST /score")
        if not temperature > 0:
            raise BadRequest(f"temperature {temperature} must be > 0")
        self.validate(sequences)
        started = time.perf_counter()
        result: list[list[float]] = [[] for _ in sequences]
        full = [list(p) + list(r) for p, r in sequences]
        for pack in self._packs([len(s) for s in full]):
            flags = []
            for i in pack:
                p, r = len(sequences[i][0]), len(sequences[i][1])
                # Outputs at positions p-1 .. p+r-2 predict the r response tokens.
                flags.append([p - 1 <= pos <= p + r - 2 for pos in range(p + r)])
            n_out = sum(sum(f) for f in flags)
            if n_out == 0:
                continue
            self._decode([full[i] for i in pack], flags)
            ptr = self._llama.llama_get_logits(self._ctx.ctx)
            logits = np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))  # (n_out, V) float32, llama.cpp's buffer
            targets = [t for i in pack for t in sequences[i][1]]  # (n_out,): row order is pack order
            logps = token_logprobs(logits, np.asarray(targets), temperature)  # float32 row chunks, no copy of the block
            row = 0
            for i in pack:
                n = len(sequences[i][1])
                result[i] = logps[row:row + n].tolist()
                row += n
        self._account(sequences, started)
        return result

    def score(self, sequences: list[tuple[list[int], list[int]]]) -> list[float]:
        """``w · h_last + b`` per sequence, ``h_last``: (n_embd,) post-norm state of the last token."""
        if self.role != "reward":
            raise BadRequest("this worker serves the ref role; POST /logprobs")
        self.validate(sequences)
        started = time.perf_counter()
        scores = [0.0] * len(sequences)
        # Unpadded, as sent: the last token is the last real one (the client never pads; a pad id
        # at the end is a real token, e.g. Llama-3's pad == eos == the end-of-turn token).
        full = [list(p) + list(r) for p, r in sequences]
        for pack in self._packs([len(s) for s in full]):
            # Pooled embeddings need every token marked as an output.
            self._decode([full[i] for i in pack], [[True] * len(full[i]) for i in pack])
            for seq_id, i in enumerate(pack):
                ptr = self._llama.llama_get_embeddings_seq(self._ctx.ctx, seq_id)
                hidden = np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).astype(np.float64)
                scores[i] = float(hidden @ self.head_weight + self.head_bias)
        self._account(sequences, started)
        return scores
