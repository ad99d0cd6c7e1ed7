"""Sampling with a static KV cache, one decode step replayed as a CUDA graph: the ``hf`` engine's fast
path on CUDA (``rollout.decoder``).

HF ``generate`` on an NF4 + LoRA model is bound by kernel launches and Python, not by the GPU: every
decode step runs ~200 linears, each a bitsandbytes 4-bit matmul and two LoRA matmuls, launched one by
one from Python. Capturing that step once as a ``torch.cuda.CUDAGraph`` and replaying it turns it
into one launch. ``torch.compile(mode="reduce-overhead")`` would do the same from the library, but on
the peft/bitsandbytes forward it had not finished compiling after ~140 s on an H200 (DESIGN.md), so
the capture is done by hand here.

The loop is HF's sampling loop, step for step, so the samples are the same:

1. Prefill: one forward over the left-padded prompts (the actor adapter active, as in ``generate``)
   into a preallocated cache: one HF ``StaticLayer`` per decoder layer, ``P + max_new_tokens`` slots.
   Sliding-window layers get a full-length layer too; their window is applied by HF's own mask.
2. Decode step: the model's forward for one token per row, reading only static buffers: the token
   (B, 1), its position (B, 1) (prompt length of the row + step: left padding skipped), the 2D
   attention mask (B, L) with one more column set per step, the cache (whose write offset is a device
   tensor HF advances in place) and writing the fp32 logits (B, V). HF builds the 4D mask inside the
   forward from device tensors alone when the cache is static and the query is one token (no
   ``.item()``, no data-dependent shape), so the same callable runs eagerly (CPU) or captured (CUDA).
3. Sampling outside the step, as ``generate`` does it: the logits processors (the behaviour log-prob
   recorder, the per-sample Gumbel-max sampler), the temperature, softmax and ``multinomial``; rows
   that have produced a token of the stop set get the pad id from then on; the loop ends when every
   row has stopped or after ``max_new_tokens``.

A graph is valid only for the buffers it was captured with, so it is captured once per call (after
the prefill, before any token is drawn) and freed with the cache at the end of the call: nothing is
held between rollouts (the memory plan counts one chunk's cache at the generation peak, none during
the update). Capture that fails (an op that cannot be captured) raises :class:`CaptureFailed`;
:class:`StaticDecoder` then says why in one log line and the caller samples with HF ``generate``.
"""

from __future__ import annotations

import inspect
import logging
from typing import Callable, Literal, Optional, Sequence

import torch
from torch import Tensor

from homerlhf.models.logprobs import position_ids_from_mask

log = logging.getLogger(__name__)

Decoder = Literal["hf", "static"]  # ``rollout.decoder`` after "auto" is resolved
# Eager runs on a side stream before capture: lazy initialisations (cuBLAS workspaces, allocator
# blocks) must not happen inside the graph. PyTorch's examples use a few; each costs one eager step.
WARMUP_STEPS = 2
_ATTENTION = ("sdpa", "eager")  # implementations whose masks HF builds from the 2D mask inside the forward
_LAYER_TYPES = {"full_attention", "sliding_attention"}


class CaptureFailed(RuntimeError):
    """The decode step could not be captured as a CUDA graph (the message says why)."""


def resolve_decoder(setting: str, device: torch.device | str) -> Decoder:
    """``rollout.decoder`` -> "hf" or "static": "auto" is the captured loop on CUDA and HF ``generate``
    elsewhere (on a CPU the per-step launch cost the graph removes is not what is slow)."""
    if setting == "auto":
        return "static" if torch.device(device).type == "cuda" else "hf"
    return setting


def cache_keyword(causal_lm) -> Optional[str]:
    """The name the model's forward takes its cache by (transformers renamed it: ``past_key_values``
    up to 5.2x, ``cache`` after), or None."""
    params = inspect.signature(causal_lm.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def refusal(causal_lm) -> Optional[str]:
    """Why the static loop cannot run this model, or None when it can."""
    import transformers
    from transformers.cache_utils import StaticLayer

    if not hasattr(StaticLayer(max_cache_len=1), "cumulative_length"):
        return f"transformers {transformers.__version__} has no self-positioning static cache layer (needs >= 5.0)"
    config = causal_lm.config.get_text_config()
    if getattr(causal_lm.config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported"
    impl = getattr(causal_lm.config, "_attn_implementation", None)
    if impl not in _ATTENTION:
        return f"attention implementation {impl!r} (the static loop needs one of {', '.join(_ATTENTION)})"
    other = set(getattr(config, "layer_types", None) or ()) - _LAYER_TYPES
    if other:
        return f"layer types {sorted(other)} (the static loop has full and sliding-window attention only)"
    params = inspect.signature(causal_lm.forward).parameters
    if cache_keyword(causal_lm) is None or not {"position_ids", "logits_to_keep"} <= set(params):
        return f"{type(causal_lm).__name__}.forward takes no cache, position_ids or logits_to_keep"
    return None


class DecodeBuffers:
    """The static inputs and output of one decode step, and the cache, for a batch of ``batch`` rows
    and ``cache_len`` positions. Their storage never moves: a captured graph reads and writes it."""

    def __init__(self, causal_lm, batch: int, cache_len: int, device: torch.device):
        from transformers.cache_utils import Cache, StaticLayer

        config = causal_lm.config.get_text_config()
        self.tokens = torch.zeros((batch, 1), dtype=torch.long, device=device)  # the token fed at this step
        self.positions = torch.zeros((batch, 1), dtype=torch.long, device=device)  # its position id
        self.attention_mask = torch.zeros((batch, cache_len), dtype=torch.bool, device=device)  # slots to attend
        self.logits = torch.zeros((batch, config.vocab_size), dtype=torch.float32, device=device)  # the step's output
        self.cache = Cache(layers=[StaticLayer(max_cache_len=cache_len) for _ in range(config.num_hidden_layers)])

    def rewind(self, length: int) -> None:
        """Set every layer's write offset to ``length`` (undoes the warm-up steps' advances)."""
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(length)

    def feed(self, tokens: Tensor, slot: int) -> None:
        """Next step's input: ``tokens`` (B,) written at cache slot ``slot``, which becomes visible."""
        self.tokens.copy_(tokens[:, None])
        self.attention_mask[:, slot] = True


def prefill(causal_lm, bufs: DecodeBuffers, prompt_ids: Tensor, prompt_mask: Tensor) -> Tensor:
    """One forward over the left-padded prompts (B, P) into ``bufs.cache``, positions as ``generate``
    assigns them. Sets ``bufs.positions`` for the first decode step; returns the fp32 logits (B, V) of
    the last prompt position."""
    width = prompt_ids.shape[1]
    bufs.attention_mask[:, :width] = prompt_mask.bool()
    positions = position_ids_from_mask(prompt_mask)
    out = causal_lm(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True,
                    logits_to_keep=1, **{cache_keyword(causal_lm): bufs.cache})
    bufs.positions.copy_(positions[:, -1:] + 1)
    return out.logits[:, -1].to(dtype=torch.float32, copy=True)


def decode_step(causal_lm, bufs: DecodeBuffers) -> Callable[[], None]:
    """The step to run (or capture): a forward of ``bufs.tokens`` against the cache, logits into
    ``bufs.logits``. It reads and writes nothing but ``bufs`` and the model's parameters."""
    keyword = cache_keyword(causal_lm)

    def step() -> None:
        out = causal_lm(input_ids=bufs.tokens, attention_mask=bufs.attention_mask, position_ids=bufs.positions,
                        use_cache=True, logits_to_keep=1, **{keyword: bufs.cache})
        bufs.logits.copy_(out.logits[:, -1])

    return step


def capture(step: Callable[[], None], bufs: DecodeBuffers, prompt_width: int) -> Callable[[], None]:
    """``step`` captured as a CUDA graph (after warm-up runs on a side stream); returns its replay.

    Call after the prefill: the warm-up runs write slots ``prompt_width`` onwards, which the real
    steps overwrite before they become visible, and the write offset is rewound to ``prompt_width``.
    ``thread_local``: CUDA calls of other threads (a reward model scoring on the GPU) stay legal.
    """
    device = bufs.logits.device
    bufs.attention_mask[:, prompt_width] = True
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP_STEPS):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph, current = torch.cuda.CUDAGraph(), torch.cuda.current_stream(device)
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            step()
    except Exception as exc:  # noqa: BLE001 - whatever the op, the answer is HF generate; an OOM is an OOM
        for cause in (exc, exc.__context__):  # (capture_end's own error may hide the OOM that ended the capture)
            if isinstance(cause, torch.OutOfMemoryError):
                raise cause from None
        raise CaptureFailed(f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}") from exc
    finally:
        torch.cuda.set_stream(current)  # torch.cuda.graph leaves its capture stream current when capture_end raises
        bufs.rewind(prompt_width)
    return graph.replay


def next_tokens(logits: Tensor, last: Tensor, processors: Sequence, temperature: float) -> Tensor:
    """What ``generate`` samples from fp32 logits (B, V): the logits processors in order (each gets
    ``last``, the last token of each row (B, 1), as its ``input_ids``), then the temperature (HF's
    warper, after custom processors), softmax and one ``multinomial`` draw per row. Returns (B,)."""
    scores = logits
    for processor in processors:
        scores = processor(last, scores)
    if temperature != 1.0:
        scores = scores / temperature
    return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)


def sample(run_step: Callable[[], None], bufs: DecodeBuffers, first_logits: Tensor, prompt_ids: Tensor, *,
           max_new_tokens: int, stop_ids: Sequence[int], pad_id: int, temperature: float,
           processors: Sequence = ()) -> Tensor:
    """The sampling loop after the prefill; ``run_step``: the step, eager or a graph's replay.
    Returns the generated ids (B, T), T <= ``max_new_tokens``, pad after each row's stop token."""
    width = prompt_ids.shape[1]
    stops = torch.as_tensor(sorted(set(int(i) for i in stop_ids)), dtype=torch.long, device=prompt_ids.device)
    unfinished = torch.ones(prompt_ids.shape[0], dtype=torch.bool, device=prompt_ids.device)
    logits, last, columns = first_logits, prompt_ids[:, -1:], []
    for t in range(max_new_tokens):
        tokens = torch.where(unfinished, next_tokens(logits, last, processors, temperature), pad_id)
        columns.append(tokens)
        unfinished &= ~torch.isin(tokens, stops)
        # One host sync per step, as generate's own stop check on CUDA.
        if t + 1 == max_new_tokens or not bool(unfinished.any()):
            break
        bufs.feed(tokens, width + t)
        run_step()
        bufs.positions.add_(1)
        logits, last = bufs.logits.clone(), tokens[:, None]  # a copy, as generate hands its processors
    return torch.stack(columns, dim=1)


@torch.no_grad()
def static_decode(causal_lm, prompt_ids: Tensor, prompt_mask: Tensor, *, max_new_tokens: int,
                  stop_ids: Sequence[int], pad_id: int, temperature: float, processors: Sequence = (),
                  captured: bool = False) -> Tensor:
    """Sample up to ``max_new_tokens`` per row of the left-padded prompts (B, P) with ``causal_lm`` (its
    active adapter), the static cache, and the step captured as a CUDA graph when ``captured``.
    Returns (B, T) generated ids, as ``generate(...)[:, P:]`` returns them."""
    batch, width = prompt_ids.shape
    bufs = DecodeBuffers(causal_lm, batch, width + max_new_tokens, prompt_ids.device)
    first = prefill(causal_lm, bufs, prompt_ids, prompt_mask)
    step = decode_step(causal_lm, bufs)
    run_step = capture(step, bufs, width) if captured and max_new_tokens > 1 else step
    return sample(run_step, bufs, first, prompt_ids, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                  pad_id=pad_id, temperature=temperature, processors=processors)


class StaticDecoder:
    """The static loop for one model, with what it learnt: after a failed capture it declines for good
    (each reason logged once) and the caller samples with HF ``generate``."""

    def __init__(self, causal_lm):
        self.causal_lm = causal_lm
        self.off_reason: Optional[str] = None  # set once the model is refused or a capture failed
        self._checked = False
        self._logged: set[str] = set()

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, generation_config,
                 processors: Sequence = ()) -> Optional[Tensor]:
        """(B, T) generated ids sampled as ``generate`` would with ``generation_config`` (from
        :func:`homerlhf.models.generation.build_generation_config`), or None when the static loop
        cannot run (the caller then uses HF ``generate``; nothing was drawn from ``processors``)."""
        if not self._checked:
            self.off_reason, self._checked = refusal(self.causal_lm), True
        reason = self.off_reason
        if reason is None:
            try:
                return static_decode(
                    self.causal_lm, prompt_ids, prompt_mask, max_new_tokens=generation_config.max_new_tokens,
                    stop_ids=generation_config.eos_token_id, pad_id=generation_config.pad_token_id,
                    temperature=generation_config.temperature, processors=processors,
                    captured=prompt_ids.device.type == "cuda")
            except CaptureFailed as exc:
                reason = self.off_reason = f"the decode step cannot be captured as a CUDA graph ({exc})"
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("rollout.decoder static: %s; sampling with HF generate instead", reason)
        return None
