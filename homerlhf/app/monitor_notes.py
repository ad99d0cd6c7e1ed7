"""What the monitor's panels say beside their lines (:mod:`homerlhf.app.monitor` draws them).

On a CPU run the measured memory peak is the process's resident set (Python, torch, the data and every
model in the trainer process), while the planner counts the trainer's tensors only: the panel names each
line for what it is instead of "measured"/"planned", so the gap does not read as the planner's error.
A k1 KL estimate (``ppo.kl_estimator: k1``, the default) is unbiased, so one batch's mean can fall below
0 while the KL itself cannot: a KL panel drawn below 0 says so.
"""

from __future__ import annotations

from typing import Sequence

MEMORY_PANEL = "Memory (GiB): measured and planned"
CPU_MEMORY_PANEL = "CPU memory (GiB): process RSS and the plan's tensors"
CPU_LINES = {"peak": "process RSS", "predicted": "plan, tensors only"}
CPU_NOTE = "RSS counts the whole process (Python, torch, data); the plan counts tensors only"
NEGATIVE_KL = "k1 is unbiased: one batch's mean can be < 0; the KL itself is >= 0"


def memory_title(title: str, kind) -> str:
    """A panel's title; the memory panel's, when its peaks are a CPU process's RSS (``peak_mem_kind``)."""
    return CPU_MEMORY_PANEL if title == MEMORY_PANEL and kind == "cpu_rss" else title


def panel_label(title: str, key: str, label: str) -> str:
    """A line's name in its panel: ``label``, except in the CPU memory panel (``generation: process RSS``)."""
    if title != CPU_MEMORY_PANEL:
        return label
    kind, _, phase = key.removesuffix("_gib").partition("_mem_")
    return f"{phase}: {CPU_LINES.get(kind, kind)}"


def panel_note(title: str, values: Sequence[float]) -> str:
    """The line under a panel's legend ('' for none): what the CPU memory lines are; why a KL below 0 is no bug."""
    if title == CPU_MEMORY_PANEL:
        return CPU_NOTE
    if title.startswith("KL to the reference") and any(v < 0 for v in values):
        return NEGATIVE_KL
    return ""
