"""Sampling with a static KV cache, one decode step replayed as a CUDA graph: the ``hf`` engine's fast
path on CUDA (``rollout.decoder``).

HF ``generate`` on an NF4 + LoRA model is bound by kernel launches and Python, not by the GPU: every
decode step runs ~200 linears, each a bitsandbytes 4-bit matmul and two LoRA matmuls, launched one by
one from Python. Capturing that step once as a ``torch.cuda.CUDAGraph`` and replaying it turns it
into one launch (``torch.compile(mode="reduce-overhead")`` had not finished compiling the peft /
bitsandbytes forward after ~140 s on an H200: DESIGN.md). The loop is HF's sampling loop, step for
step, so the samples are the same: :func:`prefill`, then :func:`decode_step` and :func:`sample`.

:class:`StaticDecoder` keeps the captured step with its buffers (the cache included) and replays it
for every later call of the same rows and no longer a cache (:mod:`homerlhf.models.decode_graphs`).
A step that would break a capture is declined before capturing, a capture that fails raises
:class:`CaptureFailed`; :class:`StaticDecoder` then says why in one log line and the caller samples
with HF ``generate``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Sequence

import torch
from torch import Tensor

from homerlhf.models.decode_attention import folded_decode_attention
from homerlhf.models.decode_graphs import CaptureFailed, StepGraphs
from homerlhf.models.logprobs import position_ids_from_mask
from homerlhf.models.static_refusal import cache_keyword, refusal

log = logging.getLogger(__name__)

__all__ = ["CaptureFailed", "DecodeBuffers", "StaticDecoder", "cache_keyword", "decode_step", "prefill", "refusal",
           "resolve_decoder", "sample"]

Decoder = Literal["hf", "static"]  # ``rollout.decoder`` after "auto" is resolved
# Steps between host reads of "has every row stopped?": up to this many - 1 steps run past the end.
STOP_CHECK_EVERY = 8


def resolve_decoder(setting: str, device: torch.device | str) -> Decoder:
    """``rollout.decoder`` -> "hf" or "static": "auto" is the captured loop on CUDA and HF ``generate``
    elsewhere (on a CPU the per-step launch cost the graph removes is not what is slow)."""
    if setting == "auto":
        return "static" if torch.device(device).type == "cuda" else "hf"
    return setting


class DecodeBuffers:
    """The static inputs and output of one decode step, and the cache, for a batch of ``batch`` rows
    and ``cache_len`` positions. Their storage never moves: a captured graph reads and writes it."""

    def __init__(self, causal_lm, batch: int, cache_len: int, device: torch.device):
        from transformers.cache_utils import Cache, StaticLayer

        config = causal_lm.config.get_text_config()
        self.cache_len = cache_len
        self.tokens = torch.zeros((batch, 1), dtype=torch.long, device=device)  # the token fed at this step
        self.positions = torch.zeros((batch, 1), dtype=torch.long, device=device)  # its position id
        self.attention_mask = torch.zeros((batch, cache_len), dtype=torch.bool, device=device)  # slots to attend
        self.logits = torch.zeros((batch, config.vocab_size), dtype=torch.float32, device=device)  # the step's output
        self.cache = Cache(layers=[StaticLayer(max_cache_len=cache_len) for _ in range(config.num_hidden_layers)])

    def rewind(self, length: int) -> None:
        """Set every layer's write offset to ``length`` (undoes the warm-up steps' advances)."""
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(length)

    def reset(self) -> None:
        """As new, in place, for the next prefill: nothing visible, the cache zeroed, offsets at 0."""
        self.attention_mask.zero_()
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.keys.zero_()
                layer.values.zero_()
        self.rewind(0)

    def feed(self, tokens: Tensor, slot: int) -> None:
        """Next step's input: ``tokens`` (B,) written at cache slot ``slot``, which becomes visible."""
        self.tokens.copy_(tokens[:, None])
        self.attention_mask[:, slot] = True


def prefill(causal_lm, bufs: DecodeBuffers, prompt_ids: Tensor, prompt_mask: Tensor,
            columns: Optional[int] = None) -> Tensor:
    """The left-padded prompts (B, P) into ``bufs.cache``, positions as ``generate`` assigns them: one
    forward, or (``columns``) forwards of that many prompt columns each, every one with the attention
    mask up to its last column and its columns' position ids, as one forward has them (the cache's own
    write offset places each piece); only the last piece runs the LM head. Sets ``bufs.positions``
    for the first decode step; returns the fp32 logits (B, V) of the last prompt position."""
    width = prompt_ids.shape[1]
    bufs.attention_mask[:, :width] = prompt_mask.bool()
    positions = position_ids_from_mask(prompt_mask)
    cache = {cache_keyword(causal_lm): bufs.cache}
    last = 0 if not columns or columns >= width else (width - 1) // columns * columns  # the last piece's start
    for start in range(0, last, columns or width):
        end = start + columns
        causal_lm.get_decoder()(input_ids=prompt_ids[:, start:end], attention_mask=prompt_mask[:, :end],
                                position_ids=positions[:, start:end], use_cache=True, **cache)
    out = causal_lm(input_ids=prompt_ids[:, last:], attention_mask=prompt_mask, position_ids=positions[:, last:],
                    use_cache=True, logits_to_keep=1, **cache)
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


def next_tokens(logits: Tensor, last: Tensor, processors: Sequence, temperature: float) -> Tensor:
    """What ``generate`` samples from fp32 logits (B, V): the logits processors in order (each gets
    ``last``, the last token of each row (B, 1), as its ``input_ids``), then the temperature (HF's
    warper, after custom processors), softmax and one ``multinomial`` draw per row. A last processor
    with a ``draw`` method (:class:`homerlhf.models.sampling.PerSampleSampler`) picks the tokens
    itself: the one-hot it would hand HF samples the same token. Returns (B,)."""
    draw = getattr(processors[-1], "draw", None) if processors else None
    scores = logits
    for processor in processors[:-1] if draw is not None else processors:
        scores = processor(last, scores)
    if draw is not None:
        return draw(scores)
    if temperature != 1.0:
        scores = scores / temperature
    return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)


def _steps_taken(alive: list[Tensor]) -> int:
    """Steps ``generate`` would have run: up to the first after which no row is unfinished. ``alive``:
    per step, a device bool "some row is unfinished after it" (one host read for all)."""
    flags = torch.stack(alive).tolist()
    return flags.index(False) + 1 if False in flags else len(flags)


def sample(run_step: Callable[[], None], bufs: DecodeBuffers, first_logits: Tensor, prompt_ids: Tensor, *,
           max_new_tokens: int, stop_ids: Sequence[int], pad_id: int, temperature: float,
           processors: Sequence = ()) -> Tensor:
    """The sampling loop after the prefill; ``run_step``: the step, eager or a graph's replay.
    Returns the generated ids (B, T), T <= ``max_new_tokens``, pad after each row's stop token.
    Processors with a ``keep_steps`` method are told T when the loop ran past it.

    1. Prefill (:func:`prefill`): one forward over the left-padded prompts (the actor adapter active)
       into a preallocated cache: one HF ``StaticLayer`` per decoder layer, at least ``P + max_new_tokens``
       slots (sliding-window layers too: their window is HF's mask's). A block of more than
       ``rollout.prefill_tokens`` prompt tokens is forwarded in column pieces, as ``generate``'s chunked
       prefill does.
    2. Decode step (:func:`decode_step`): the model's forward for one token per row, reading only static
       buffers (the token, its position, the 2D mask with one more column set per step, the cache whose
       write offset is a device tensor HF advances) and writing the fp32 logits (B, V). HF builds the 4D
       mask from device tensors alone when the cache is static and the query one token, so the same
       callable runs eagerly (CPU) or captured (CUDA). Attention on sdpa folds each KV head's query group
       (:mod:`homerlhf.models.decode_attention`).
    3. Sampling outside the step, as ``generate`` does it: the logits processors (the behaviour log-prob
       recorder, then the per-sample sampler, whose token is taken directly; without one, temperature,
       softmax and ``multinomial``); rows that have produced a stop token get the pad id from then on.
       Whether every row has stopped is read on the host every :data:`STOP_CHECK_EVERY` steps (each read
       waits for the device); the steps run past the last stop are cut off."""
    width = prompt_ids.shape[1]
    stops = torch.as_tensor(sorted(set(int(i) for i in stop_ids)), dtype=torch.long, device=prompt_ids.device)
    unfinished = torch.ones(prompt_ids.shape[0], dtype=torch.bool, device=prompt_ids.device)
    logits, last, columns, alive = first_logits, prompt_ids[:, -1:], [], []
    for t in range(max_new_tokens):
        tokens = torch.where(unfinished, next_tokens(logits, last, processors, temperature), pad_id)
        columns.append(tokens)
        unfinished &= ~torch.isin(tokens, stops)
        alive.append(unfinished.any())
        # A host read waits for the device: only every STOP_CHECK_EVERY steps.
        if t + 1 == max_new_tokens or ((t + 1) % STOP_CHECK_EVERY == 0 and not bool(alive[-1])):
            break
        bufs.feed(tokens, width + t)
        run_step()
        bufs.positions.add_(1)
        logits, last = bufs.logits.clone(), tokens[:, None]  # a copy, as generate hands its processors
    steps = _steps_taken(alive)
    for processor in processors:
        if steps < len(columns) and hasattr(processor, "keep_steps"):
            processor.keep_steps(steps)
    return torch.stack(columns[:steps], dim=1)


def _adapter_state(causal_lm) -> tuple:
    """What a captured step bakes in beyond its buffers: train/eval mode and, for a peft model, the
    active adapters and whether they are disabled (Python branches a graph freezes)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return (causal_lm.training,)
    layer = next((m for m in causal_lm.modules() if isinstance(m, BaseTunerLayer)), None)
    if layer is None:
        return (causal_lm.training,)
    return causal_lm.training, tuple(layer.active_adapters), bool(layer.disable_adapters)


@dataclass
class DecodeSession:
    """A decode step for ``rows`` rows and a cache of ``bufs.cache_len`` slots, ready to run: its
    buffers, the step (a graph's replay when captured) and the graph."""

    rows: int
    state: tuple  # :func:`_adapter_state` when it was built
    bufs: DecodeBuffers
    run_step: Optional[Callable[[], None]] = None  # None until the first prefill (a capture needs one)
    graph: object = None

    def fits(self, rows: int, cache_len: int, state: tuple) -> bool:
        return self.rows == rows and self.bufs.cache_len >= cache_len and self.state == state


class StaticDecoder:
    """The static loop for one model, with what it keeps: the decode session of the last shape (its
    buffers and captured step), replayed by every later call that fits until the model runs any
    other forward (scoring, an update, HF ``generate``), which frees it first: the cache is held only
    while the model does nothing but sample, as the memory plan's generation phase counts it. After a
    refusal or a failed capture it declines for good (each reason logged once; the caller samples
    with HF ``generate``). ``graphs``: what captures (default: :class:`StepGraphs` on a CUDA device;
    none, the step run eagerly, elsewhere)."""

    def __init__(self, causal_lm, graphs: Optional[StepGraphs] = None):
        self.causal_lm = causal_lm
        self.graphs = graphs
        self.off_reason: Optional[str] = None  # set once the model is refused or a capture failed
        self.sessions_made = 0
        self.replays = 0  # captured steps replayed (a graph's ``replay``; 0 when the step runs eagerly)
        self._session: Optional[DecodeSession] = None
        self._decoding = False  # the loop's own forwards (prefill, warm-up, eager steps) keep the session
        self._hook = None
        self._checked = False
        self._logged: set[str] = set()

    def release(self) -> None:
        """Free the kept session (its cache and graph); the next call builds (and captures) anew."""
        self._session = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.graphs is not None:
            self.graphs.release_pool()

    def _before_forward(self, module, args) -> None:
        if not self._decoding:
            self.release()

    def _hold(self, session: DecodeSession) -> None:
        """Keep ``session``, freed by the next forward of the decoder stack that is not the loop's."""
        self._session = session
        if self._hook is None:
            stack = getattr(self.causal_lm, getattr(self.causal_lm, "base_model_prefix", ""), None)
            target = stack if isinstance(stack, torch.nn.Module) else self.causal_lm
            self._hook = target.register_forward_pre_hook(self._before_forward)

    def _graphs_for(self, device: torch.device) -> Optional[StepGraphs]:
        if self.graphs is None and device.type == "cuda":
            self.graphs = StepGraphs(device)
        return self.graphs

    def _session_for(self, rows: int, cache_len: int, device: torch.device) -> DecodeSession:
        """The kept session if it fits, else a new one (the old one's cache freed first; its graph,
        which holds the shared pool, only once the new capture is done)."""
        state = _adapter_state(self.causal_lm)
        if self._session is not None and self._session.fits(rows, cache_len, state):
            self._session.bufs.reset()
            return self._session
        old, self._session = self._session, None
        if old is not None:
            old.bufs, old.run_step = None, None
        self.sessions_made += 1
        session = DecodeSession(rows, state, DecodeBuffers(self.causal_lm, rows, cache_len, device))
        session.graph = old.graph if old is not None else None  # kept alive until replaced
        self._hold(session)
        return session

    def _ready(self, session: DecodeSession, width: int, multi_step: bool) -> Callable[[], None]:
        """The session's step, captured after its first prefill when there are graphs."""
        if session.run_step is None:
            step = decode_step(self.causal_lm, session.bufs)
            graphs = self._graphs_for(session.bufs.logits.device)
            if graphs is None:
                session.run_step = step
                return step
            if not multi_step:
                return step  # (a one-token call: nothing to capture yet)
            session.bufs.attention_mask[:, width] = True  # the slot the warm-up steps write
            session.graph = graphs.capture(step, lambda: session.bufs.rewind(width))
            session.run_step = self._counted(session.graph.replay)
        return session.run_step

    def _counted(self, replay: Callable[[], None]) -> Callable[[], None]:
        """``replay``, counted in :attr:`replays`: what says a captured graph ran, not just was made."""
        def counted() -> None:
            replay()
            self.replays += 1

        return counted

    @property
    def graphs_captured(self) -> int:
        """Captures begun for this model (:attr:`StepGraphs.graphs_made`; 0 without graphs)."""
        return self.graphs.graphs_made if self.graphs is not None else 0

    @torch.no_grad()
    def decode(self, prompt_ids: Tensor, prompt_mask: Tensor, *, max_new_tokens: int, stop_ids: Sequence[int],
               pad_id: int, temperature: float, processors: Sequence = (),
               prefill_columns: Optional[int] = None) -> Tensor:
        """Sample up to ``max_new_tokens`` per row of the left-padded prompts (B, P) with the model (its
        active adapter) and the static cache, prefilled in pieces of ``prefill_columns`` (None: one
        forward). Returns (B, T) generated ids, as ``generate(...)[:, P:]`` returns them. Raises
        :class:`CaptureFailed`."""
        rows, width = prompt_ids.shape
        self._decoding = True
        try:
            session = self._session_for(rows, width + max_new_tokens, prompt_ids.device)
            with folded_decode_attention(self.causal_lm):
                first = prefill(self.causal_lm, session.bufs, prompt_ids, prompt_mask, prefill_columns)
                run_step = self._ready(session, width, max_new_tokens > 1)
                return sample(run_step, session.bufs, first, prompt_ids, max_new_tokens=max_new_tokens,
                              stop_ids=stop_ids, pad_id=pad_id, temperature=temperature, processors=processors)
        except BaseException:
            self.release()  # (an out-of-memory error: the halved retry starts from nothing held)
            raise
        finally:
            self._decoding = False

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
                return self.decode(prompt_ids, prompt_mask, max_new_tokens=generation_config.max_new_tokens,
                                   stop_ids=generation_config.eos_token_id, pad_id=generation_config.pad_token_id,
                                   temperature=generation_config.temperature, processors=processors,
                                   prefill_columns=getattr(generation_config, "prefill_chunk_size", None))
            except CaptureFailed as exc:
                self.release()
                reason = self.off_reason = f"the decode step cannot be captured as a CUDA graph ({exc})"
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("rollout.decoder static: %s; sampling with HF generate instead", reason)
        return None
