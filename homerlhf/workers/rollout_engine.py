"""The ``llamacpp`` rollout engine: the actor sampled by llama.cpp, in process.

The base is the KL-consistent export (the dequantized NF4 weights the actor computes with, as the
reference worker's); the actor's LoRA is written as a GGUF LoRA adapter
(:func:`homerlhf.workers.gguf.lora.write_lora_gguf`) and swapped into the context before every
rollout (:meth:`LlamaCppEngine.sync`), so the engine samples with the current adapter. Several
sequences decode in one ``llama_decode`` batch (unified KV cache, one sequence id each). Sampling is
exact, ``softmax(logits / temperature)`` by the Gumbel-max trick, each token's behaviour log-prob
that distribution's (:class:`LlamaCppEngine`). A llama.cpp build for another CPU dies by SIGILL and
takes the process with it: ``homerlhf doctor`` checks the build in a child process first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from homerlhf.config.schema import RolloutConfig
from homerlhf.ppo.devices import to_trainer
from homerlhf.ppo.engines import RolloutEngine
from homerlhf.ppo.rollout import RolloutBatch, check_prompt_lengths, pad_sequences
from homerlhf.workers import llama_log
from homerlhf.workers.gguf.lora import write_lora_gguf


class LlamaCppEngine(RolloutEngine):
    """A llama.cpp model + context sampling up to ``max_seqs`` sequences per decode.

    ``config``: the policy base's parsed config.json (for the adapter's tensor names);
    ``adapter_dir``: where the adapter GGUFs are written (one at a time).

    Sampling: ``softmax(logits / temperature)`` over the whole vocabulary, in float64, by the Gumbel-max
    trick (argmax of ``logits / T + Gumbel noise``), with no other logits processing, the trainer's stop
    set and ``max_new_tokens``. With per-sample ``seeds`` each sample draws its noise from a numpy
    generator of its own, so its response depends neither on the other prompts of the decode batch nor
    on torch's global RNG (the asynchronous mode samples in a background thread); without them one
    generator seeded from torch's global RNG serves the whole call, so a seeded run repeats.
    """

    name = "llamacpp"

    def __init__(self, base_gguf: Path, config: dict, *, stop_ids: Sequence[int], pad_id: int, max_seqs: int,
                 max_prompt_len: int, max_new_tokens: int, adapter_dir: Path, threads: int = 0,
                 f32_kv_cache: bool = False, device="cpu", adapter: str = "actor", gpu_layers: int = 0):
        import llama_cpp
        from llama_cpp import _internals

        self.config, self.adapter, self.device = config, adapter, device
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self.pad_id = int(pad_id)
        self.max_seqs = max(1, min(int(max_seqs), llama_cpp.llama_max_parallel_sequences()))
        self.max_new_tokens = int(max_new_tokens)
        self.adapter_dir = Path(adapter_dir)
        self.version = 0  # adapters written so far
        prefill = self.max_seqs * int(max_prompt_len)
        threads = threads or max(1, os.cpu_count() or 1)

        llama_log.install()
        llama_cpp.llama_backend_init()
        self._llama = llama_cpp
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = 2**31 - 1 if gpu_layers < 0 else int(gpu_layers)  # ignored by a CPU build
        self._model = _internals.LlamaModel(path_model=str(base_gguf), params=model_params, verbose=False)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = prefill + self.max_seqs * self.max_new_tokens
        params.n_batch = params.n_ubatch = max(prefill, self.max_seqs)
        params.n_seq_max = self.max_seqs
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = threads
        if f32_kv_cache:
            params.type_k = params.type_v = 0  # GGML_TYPE_F32: the default F16 costs ~1e-3 in logits
        self._ctx = _internals.LlamaContext(model=self._model, params=params, verbose=False)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._model.vocab)
        self._batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)
        self._lora = None
        self._lora_path: Optional[Path] = None

    # -- the adapter ---------------------------------------------------------------------------
    def sync(self, policy) -> None:
        """Write the actor's LoRA as a GGUF adapter, load it, make it the context's only adapter and
        free the previous one."""
        import ctypes

        llama = self._llama
        self.version += 1
        path = write_lora_gguf(policy.model, self.adapter, self.config, self.adapter_dir / f"actor-{self.version}.gguf")
        lora = llama.llama_adapter_lora_init(self._model.model, str(path).encode())
        if not lora:
            raise RuntimeError(f"llama.cpp could not load the LoRA adapter {path}")
        adapters = (llama.llama_adapter_lora_p_ctypes * 1)(lora)
        scales = (ctypes.c_float * 1)(1.0)
        if llama.llama_set_adapters_lora(self._ctx.ctx, adapters, 1, scales) != 0:
            raise RuntimeError(f"llama.cpp could not apply the LoRA adapter {path}")
        self._release_adapter()
        self._lora, self._lora_path = lora, path

    def _release_adapter(self) -> None:
        if self._lora is not None:
            self._llama.llama_adapter_lora_free(self._lora)
            self._lora = None
        if self._lora_path is not None:
            self._lora_path.unlink(missing_ok=True)
            self._lora_path = None

    # -- sampling ------------------------------------------------------------------------------
    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of ``(token, position, seq_id, wants_logits)`` entries."""
        batch = self._batch
        for j, (token, pos, seq, out) in enumerate(entries):
            batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = token, pos, 1, out
            batch.seq_id[j][0] = seq
        batch.n_tokens = len(entries)
        rc = self._llama.llama_decode(self._ctx.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _logprobs(self, rows: list[int], temperature: float) -> np.ndarray:
        """(len(rows), V) float64 ``log_softmax(logits / temperature)`` at those batch positions."""
        logits = np.stack([np.ctypeslib.as_array(self._llama.llama_get_logits_ith(self._ctx.ctx, r),
                                                 shape=(self.n_vocab,)) for r in rows]).astype(np.float64)
        logits /= temperature
        peak = logits.max(axis=1, keepdims=True)
        return logits - (peak + np.log(np.exp(logits - peak).sum(axis=1, keepdims=True)))

    def _sample(self, prompts: list[list[int]], max_new: int, temperature: float, rngs) -> tuple[list, list]:
        """Responses (each ending at its first stop token or at ``max_new``) and their log-probs;
        ``rngs[s]``: the numpy generator of sequence s's Gumbel noise."""
        llama = self._llama
        llama.llama_memory_clear(llama.llama_get_memory(self._ctx.ctx), True)
        entries, at = [], {}
        for seq, prompt in enumerate(prompts):
            for pos, token in enumerate(prompt):
                entries.append((token, pos, seq, pos == len(prompt) - 1))
            at[seq] = len(entries) - 1
        self._decode(entries)
        responses: list[list[int]] = [[] for _ in prompts]
        logps: list[list[float]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        for step in range(max_new):
            logp = self._logprobs([at[s] for s in active], temperature)  # (A, V)
            noise = np.stack([rngs[s].gumbel(size=logp.shape[1]) for s in active])
            tokens = np.argmax(logp + noise, axis=1)  # exact softmax sampling
            for row, (seq, token) in enumerate(zip(active, tokens.tolist())):
                responses[seq].append(token)
                logps[seq].append(float(logp[row, token]))
            active = [s for s in active if responses[s][-1] not in self.stop_ids]
            if not active or step == max_new - 1:
                break
            # Sequence s keeps id s; its new token sits right after the tokens before it.
            self._decode([(responses[s][-1], len(prompts[s]) + step, s, True) for s in active])
            at = {s: j for j, s in enumerate(active)}
        return responses, logps

    def generate(self, prompts: Sequence[Sequence[int]], rollout: RolloutConfig,
                 seeds: Optional[Sequence[int]] = None) -> RolloutBatch:
        """``seeds``: one per prompt (see the module docstring)."""
        if rollout.max_new_tokens > self.max_new_tokens:
            raise ValueError(f"max_new_tokens {rollout.max_new_tokens} exceeds the engine's {self.max_new_tokens}")
        check_prompt_lengths(prompts, rollout.max_prompt_len)
        prompts = [list(p) for p in prompts]
        if seeds is not None:
            rngs = [np.random.default_rng(int(seed)) for seed in seeds]
        else:
            rngs = [np.random.default_rng(int(torch.randint(0, 2**62, (1,))))] * len(prompts)
        responses, logps = [], []
        for start in range(0, len(prompts), self.max_seqs):
            end = start + self.max_seqs
            r, lp = self._sample(prompts[start:end], rollout.max_new_tokens, rollout.temperature, rngs[start:end])
            responses += r
            logps += lp
        prompt_ids, prompt_mask = pad_sequences(prompts, self.pad_id, device=self.device)
        response_ids, response_mask = pad_sequences(responses, self.pad_id, side="right", device=self.device)
        behaviour = to_trainer(logps, self.device, width=response_ids.shape[1])
        truncated = torch.tensor([r[-1] not in self.stop_ids for r in responses], device=self.device)
        return RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask, truncated, behaviour)

    def close(self) -> None:
        if getattr(self, "_ctx", None) is None:
            return
        self._release_adapter()
        self._llama.llama_batch_free(self._batch)
        self._ctx.close()
        self._model.close()
        self._ctx = None


def llamacpp_engine(cfg, policy, model_path: str, run_dir: Optional[Path]) -> LlamaCppEngine:
    """The run's llama.cpp engine: the policy base exported KL-consistently (dequantized NF4, cached,
    ``rollout.engine_outtype``), adapters written under ``RUN_DIR/engine``."""
    import tempfile

    from homerlhf.models.registry import resolve_model_dir
    from homerlhf.workers.backends import cached_ref_gguf
    from homerlhf.workers.gguf.tensors import read_config

    rollout = cfg.rollout
    base = cached_ref_gguf(model_path, rollout.engine_outtype, True, cfg.quant, cfg.card.device)
    adapter_dir = Path(run_dir) / "engine" if run_dir is not None else Path(tempfile.mkdtemp(prefix="homerlhf-engine-"))
    return LlamaCppEngine(base, read_config(resolve_model_dir(model_path)), stop_ids=policy.stop_ids,
                          pad_id=policy.tokenizer.pad_token_id, max_seqs=rollout.chunk_size,
                          max_prompt_len=rollout.max_prompt_len, max_new_tokens=rollout.max_new_tokens,
                          adapter_dir=adapter_dir, threads=rollout.engine_threads,
                          f32_kv_cache=rollout.engine_f32_kv_cache, device=policy.device,
                          gpu_layers=rollout.engine_gpu_layers)
