"""Published figures of the cards the presets name: what the planner scales the H200's measured
rates by (:func:`homerlhf.memory.gpu_rates.gpu_trainer_rates`) for a card nobody measured here.

``tflops``: dense tensor-core TFLOP/s in the dtype the preset computes in (BF16; FP16 on a T4, which
has no BF16) with FP32 accumulation, as PyTorch's matmuls accumulate, without sparsity;
``bandwidth_gbs``: memory bandwidth, GB/s; ``pcie_gbs``: the host link one way, GB/s, the link rate of the
PCIe generation and lanes the data sheet names (PCIe 4.0 x16 unless noted; a pinned copy reaches less).
From NVIDIA's data sheets and architecture whitepapers
(Hopper H200 SXM, Ada Lovelace, Ampere GA102 / GA106, A100, Turing T4); where a whitepaper lists no
card, its SM count x boost clock x the architecture's per-SM rate (the same that gives the listed
cards' figures). None of these cards ran homerlhf: the figures are a card's datasheet, not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class CardSpec:
    name: str
    tflops: float  # dense BF16 (FP16 on a T4) tensor TFLOP/s, FP32 accumulate
    bandwidth_gbs: float  # memory bandwidth, GB/s
    pcie_gbs: float = 31.5  # host link, GB/s one way: PCIe 4.0 x16 (16 GT/s x 16 lanes x 128/130 / 8)

    @property
    def flops(self) -> float:
        return self.tflops * 1e12

    @property
    def bandwidth(self) -> float:
        """Bytes per second."""
        return self.bandwidth_gbs * 1e9


# The card the GPU rates were measured on (homerlhf.memory.timing, docs/time.md).
MEASURED = CardSpec("NVIDIA H200", 989.5, 4800.0, 63.0)  # PCIe 5.0 x16

CARDS = {spec.name: spec for spec in (
    MEASURED,
    CardSpec("A100 80GB", 312.0, 2039.0),  # SXM
    CardSpec("RTX 4090", 165.2, 1008.0),
    CardSpec("RTX 4080", 97.5, 716.8),
    CardSpec("RTX 4060 Ti 16GB", 44.1, 288.0, 15.75),  # PCIe 4.0 x8; 34 SMs x 2.535 GHz x 512 (Ada, FP32 accumulate)
    CardSpec("RTX 3090", 71.0, 936.0),
    CardSpec("RTX 3060 12GB", 25.4, 360.0),  # 28 SMs x 1.777 GHz x 511 (GA10x, FP32 accumulate)
    CardSpec("Tesla T4 (Colab)", 65.0, 320.0, 15.75),  # PCIe 3.0 x16; FP16: a T4 has no BF16
)}


def card_spec(name: str) -> Optional[CardSpec]:
    """The published figures of the card named ``name`` (``card.name`` of a preset), None for one not listed."""
    return CARDS.get(name)
