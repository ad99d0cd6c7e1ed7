"""The ``rollout`` section of the run config: sampling, the rollout engine, the importance-sampling
correction and the asynchronous mode (re-exported by :mod:`homerlhf.config.schema`)."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import ConfigDict, Field, model_validator

from homerlhf.config.section import Section


class RolloutConfig(Section):
    # ``async`` is a Python keyword: the field is ``async_``, read and written as ``async``.
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=(), populate_by_name=True,
                              serialize_by_alias=True)

    batch_size: int = Field(64, ge=1, description="Prompts per PPO iteration.")
    chunk_size: int = Field(
        16, ge=1, description="Prompts scored at once (old log-probs, values, the reference on the GPU; scoring overlaps "
        "the next chunk's generation), and generated at once unless rollout.generation_chunk says otherwise.",
    )
    generation_chunk: Optional[Union[int, Literal["auto"]]] = Field(
        None, description="Prompts generated at once: a number, 'auto' (the largest the memory plan affords, capped at "
        "rollout.batch_size; resolved when a run starts and shown by `homerlhf plan`), or unset: rollout.chunk_size.",
    )
    max_prompt_len: int = Field(
        256, ge=1,
        description="Longest prompt in tokens; a longer one is cut inside its last user message (BOS, system "
        "turn and generation prompt kept) or dropped, as data.overlong says.",
    )
    max_new_tokens: int = Field(128, ge=1, description="Response length cap.")
    prefill_tokens: Optional[int] = Field(
        4096, ge=0, description="Prompt tokens (rows x columns) one prefill forward takes at most; a larger block is "
        "prefilled in column pieces. 0 or null: one forward (docs/memory.md).",
    )
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature; every log-prob (old, new, reference) is taken at it."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass; must stay 1 (off) for training.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; must stay 0 (off) for training.")
    truncation_penalty: Optional[float] = Field(
        None, description="Score given to responses that hit max_new_tokens without a stop token (None: off)."
    )
    engine: Literal["auto", "hf", "llamacpp"] = Field(
        "hf", description="hf: the actor's own generate; llamacpp: the exported base with the actor's LoRA as a GGUF "
        "adapter; auto: the faster by this machine's bench figures, chosen at start (docs/time.md).",
    )
    decoder: Literal["auto", "hf", "static"] = Field(
        "auto", description="hf engine's sampler: static (our decode loop, a static KV cache, a CUDA graph on CUDA), "
        "hf (HF generate), auto: static on CUDA, hf on CPU (docs/time.md).",
    )
    engine_outtype: Literal["f32", "f16", "bf16", "q8_0"] = Field(
        "f16", description="llamacpp engine: GGUF type of the exported (dequantized NF4) base.")
    engine_threads: int = Field(0, ge=0, description="llamacpp engine: threads (0: all cores).")
    engine_f32_kv_cache: bool = Field(False, description="llamacpp engine: F32 KV cache (exact, slower) instead of F16.")
    engine_gpu_layers: int = Field(
        0, ge=-1, description="llamacpp engine: layers offloaded to the GPU by a CUDA build of llama-cpp-python (0: "
        "none, -1: all); a second copy of the base in GPU memory, counted by the planner.",
    )
    async_: bool = Field(
        False, alias="async",
        description="Sample and score the next batch in a background thread while this one updates (one update "
        "stale, IS-corrected); llamacpp engine only (docs/time.md).",
    )
    is_cap: Optional[float] = Field(
        2.0, ge=1, description="Truncated importance weight min(exp(old - behaviour), is_cap) on each token's "
        "policy loss (None: off, every weight 1).",
    )

    @property
    def generation_chunk_size(self) -> int:
        """Prompts generated at once: ``generation_chunk``, else ``chunk_size``. An ``auto`` one must have
        been resolved (:func:`homerlhf.memory.chunks.resolve_generation_chunk`) before anything samples."""
        if self.generation_chunk == "auto":
            raise ValueError("rollout.generation_chunk 'auto' is resolved by the memory plan when a run starts; "
                             "resolve it first (homerlhf.memory.chunks.resolve_generation_chunk)")
        return self.chunk_size if self.generation_chunk is None else self.generation_chunk

    def prefill_columns(self, rows: int, width: int) -> Optional[int]:
        """Prompt columns per prefill forward of a (rows, width) prompt block: None (one forward) when
        ``prefill_tokens`` is 0/unset or the block holds no more than it, else max(1, prefill_tokens // rows)."""
        tokens = self.prefill_tokens
        if not tokens or rows * width <= tokens:
            return None
        columns = max(1, tokens // rows)
        return columns if columns < width else None

    @model_validator(mode="after")
    def _full_distribution(self) -> "RolloutConfig":
        # PPO's ratios and KL score log_softmax(logits / temperature) over the whole vocabulary; a
        # truncated sampler would make every rollout off-policy.
        if self.top_p < 1 or self.top_k > 0:
            raise ValueError(
                f"rollout.top_p={self.top_p}, rollout.top_k={self.top_k}: training rollouts must sample the "
                "full distribution that PPO scores; set rollout.top_p=1.0 and rollout.top_k=0 "
                "(use rollout.temperature to sharpen it)"
            )
        if isinstance(self.generation_chunk, int) and self.generation_chunk < 1:
            raise ValueError(f"rollout.generation_chunk must be >= 1, 'auto' or unset; got {self.generation_chunk}")
        if self.async_ and self.engine == "hf":
            raise ValueError(
                "rollout.async needs rollout.engine=llamacpp (or auto, which then takes it): the hf engine samples "
                "with the trainer's own module, which the update is changing meanwhile"
            )
        return self
