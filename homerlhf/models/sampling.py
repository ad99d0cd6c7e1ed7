"""Sampling where each row of a batch draws from a random stream of its own.

HF ``generate`` samples every row from the one global generator, so which tokens a sample gets
depends on the batch around it: generate 16 prompts at once or as 8 + 8 and the responses differ.
Then a rollout chunk halved after an out-of-memory error would redo the iteration with other samples.
:class:`PerSampleSampler` makes the draw of row ``i`` depend only on ``seeds[i]`` and the step: it
picks ``argmax(logits / T + Gumbel noise)`` (the Gumbel-max trick: an exact sample of
``softmax(logits / T)``) with noise that is row ``i``'s alone. To HF it hands a one-hot distribution,
whose multinomial draw is that token whatever the global generator holds; the static decode loop
takes the token itself (:meth:`PerSampleSampler.draw`: no softmax, no ``multinomial``, no host sync).
Two noise sources, each a function of (seed, step, token) only: ``counter`` (:func:`counter_uniform`,
the default on CUDA) and ``generator`` (one ``torch.Generator`` per row; the default elsewhere).
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence

import torch

Noise = Literal["counter", "generator"]
# HF applies its temperature warper after custom processors: a one-hot row stays one-hot under it.
_NEG_INF = float("-inf")
_MASK64 = (1 << 64) - 1


def _int64(value: int) -> int:
    """An unsigned 64-bit constant as the int64 torch stores (two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GAMMA = _int64(0x9E3779B97F4A7C15)  # SplitMix64's increment: the golden ratio in 64 bits
_MIX1, _MIX2 = _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)


def _shift_right(z: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """Logical ``z >> bits`` of int64 as unsigned 64-bit (torch shifts signed ints arithmetically)."""
    torch.bitwise_right_shift(z, bits, out=out)
    return out.bitwise_and_((1 << (64 - bits)) - 1)


def mix64_(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function, in place on int64 ``z`` (mod 2^64)."""
    scratch = torch.empty_like(z)
    z.bitwise_xor_(_shift_right(z, 30, scratch)).mul_(_MIX1)
    z.bitwise_xor_(_shift_right(z, 27, scratch)).mul_(_MIX2)
    return z.bitwise_xor_(_shift_right(z, 31, scratch))


def counter_uniform(seeds: torch.Tensor, step: int, vocab: int, columns: Optional[torch.Tensor] = None,
                    mixed: bool = False) -> torch.Tensor:
    """seeds (B,) int64 -> (B, vocab) float32 uniforms in (0, 1): row ``i`` depends on ``seeds[i]``,
    ``step`` and the column only. key_i = mix(mix(seed_i) + (step + 1) G); u = mix(key_i + (v + 1) G).
    ``mixed``: ``seeds`` already hold mix(seed_i); ``columns``: (vocab,) the (v + 1) G (both reusable
    across steps, so a step costs the same few kernels whatever B).

    mix is SplitMix64 (Steele, Lea & Flood, 2014; the generator behind Java's ``SplittableRandom``); the
    top 23 bits of u make the float32 uniform ``(bits + 0.5) / 2^23``, exact and strictly inside (0, 1).
    Integer arithmetic, so a CPU computes the same noise as a GPU."""
    start = seeds.clone() if mixed else mix64_(seeds.clone())
    key = mix64_(start.add_(_int64(((step + 1) * 0x9E3779B97F4A7C15) & _MASK64)))  # (B,)
    if columns is None:
        columns = torch.arange(1, vocab + 1, dtype=torch.int64, device=seeds.device).mul_(_GAMMA)
    z = columns[None, :] + key[:, None]  # (B, vocab)
    bits = _shift_right(mix64_(z), 41, z)  # the top 23 bits, in z's own storage: + 0.5 is exact in float32
    return bits.to(torch.float32).add_(0.5).mul_(2.0**-23)


class PerSampleSampler:
    """A ``LogitsProcessor``: row ``i`` sampled from ``softmax(scores[i] / temperature)`` with noise
    from ``seeds[i]`` and the step alone. ``noise``: "counter" or "generator" (default: "counter" on
    CUDA, "generator" elsewhere). ``counter``: one batch of integer kernels for all rows
    (:func:`counter_uniform`); ``generator``: one ``torch.Generator`` per row, ``torch.rand(V)`` per row
    and step (B launches a step), the one the CPU demo's measured results were drawn from."""

    def __init__(self, seeds: Sequence[int], temperature: float, device, noise: Optional[Noise] = None):
        self.temperature = float(temperature)
        self.noise: Noise = noise or ("counter" if torch.device(device).type == "cuda" else "generator")
        self.rows = len(seeds)
        self.step = 0  # calls so far: the step whose noise comes next
        if self.noise == "counter":
            raw = torch.tensor([_int64(int(s) % 2**64) for s in seeds], dtype=torch.int64, device=device)
            self.mixed_seeds = mix64_(raw)  # mix(seed_i): the first half of every step's key
            self._columns: Optional[torch.Tensor] = None  # (V,) (v + 1) G, made at the first step
        else:
            self.generators = [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]

    def _uniform(self, scores: torch.Tensor) -> torch.Tensor:
        if self.noise == "counter":
            vocab = scores.shape[1]
            if self._columns is None or self._columns.shape[0] != vocab:
                self._columns = torch.arange(1, vocab + 1, dtype=torch.int64, device=scores.device).mul_(_GAMMA)
            return counter_uniform(self.mixed_seeds, self.step, vocab, self._columns, mixed=True)
        uniform = torch.stack([torch.rand(scores.shape[1], generator=g, device=scores.device, dtype=torch.float32)
                               for g in self.generators])  # (B, V)
        return uniform.clamp_min_(torch.finfo(torch.float32).tiny)

    def draw(self, scores: torch.Tensor) -> torch.Tensor:
        """scores: (B, V) next-token logits -> (B,) the sampled tokens; advances the step."""
        if scores.shape[0] != self.rows:
            raise ValueError(f"{scores.shape[0]} rows but {self.rows} seeds")
        gumbel = self._uniform(scores).log_().neg_().log_().neg_()  # -log(-log u)
        self.step += 1
        return gumbel.add_(scores.float() / self.temperature).argmax(dim=-1)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """scores: (B, V) next-token logits -> (B, V), 0 at each row's sampled token, -inf elsewhere."""
        tokens = self.draw(scores)
        out = torch.full_like(scores, _NEG_INF)
        out.scatter_(1, tokens[:, None], 0.0)
        return out
