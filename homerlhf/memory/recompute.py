"""Activation checkpointing in the plan: what the update keeps from its forward for its backward when
every n-th decoder layer is checkpointed (``training.checkpoint_every_n_layers``), what waits in pinned
host memory under ``training.activation_offload``, and what recomputing and copying cost in time.

With k of the L layers checkpointed (layers 0, n, 2n, ...: k = ceil(L / n)) the forward keeps each
checkpointed layer's input (tokens x h x a bytes; + one more, the last hidden state, as the plan of full
checkpointing always counted) and every activation of the L - k others (:func:`layer_saved_bytes_per_token`
per token, as without checkpointing). k = L is full checkpointing and k = 0 none, counted exactly as
before these settings. Under offload the checkpointed inputs go to pinned host memory in the forward
and one comes back for each recompute: the device keeps the last hidden state and, at a recompute, that
layer's input. The host side: torch's pinned-memory allocator rounds each block up to a power of two.
"""

from __future__ import annotations

from typing import Optional

from homerlhf.memory.components import Component, dtype_bytes, lengths
from homerlhf.memory.shapes import ModelShape, critic_shape

# PCIe 4.0 x16, one direction: 16 GT/s x 16 lanes x 128/130 / 8 (a card not in homerlhf.memory.cards).
PCIE4_X16_GBS = 31.5


def offloads(cfg) -> bool:
    """Whether the checkpointed inputs leave the device: offload on, on a CUDA card (on a CPU,
    ``save_on_cpu`` keeps a CPU tensor where it is)."""
    return cfg.training.offload and cfg.card.device == "cuda"


def offloaded_bytes(cfg, shape: ModelShape, sequences: Optional[int] = None) -> int:
    """Bytes one forward of ``sequences`` (default a micro-batch) at full length passes through the
    offload's pack hook, and its backward back through the unpack hook: each checkpointed layer's input
    hidden states, tokens x h x the activation dtype's bytes. 0 without offload."""
    if not cfg.training.offload:
        return 0
    _, a, _ = dtype_bytes(cfg)
    _, _, t = lengths(cfg)
    m = cfg.ppo.micro_batch_size if sequences is None else sequences
    return cfg.training.checkpointed_layers(shape.num_layers) * m * t * shape.hidden_size * a


def pinned_block(nbytes: int) -> int:
    """A pinned host block as torch's caching host allocator makes it: the next power of two."""
    return 1 << max(0, int(nbytes) - 1).bit_length()


def update_saved(cfg, shape: ModelShape, m: int, t: int, per_layer: float, a: int, act: str,
                 mixed: str) -> tuple[list[Component], dict[str, list[Component]]]:
    """(what the update keeps from its forward until its backward starts, {layer-backward moment: what
    is alive then of it, with the recomputed layer's activations}), for ``m`` sequences of ``t`` tokens;
    ``per_layer``: one layer's saved bytes per token; ``act``/``mixed``: dtype words for the notes."""
    n_layers, h, tokens = shape.num_layers, shape.hidden_size, m * t
    k = cfg.training.checkpointed_layers(n_layers)
    kept = n_layers - k
    if k == 0:
        saved = Component("saved activations", "activations", int(tokens * per_layer * n_layers + tokens * h * a),
                          note=f"{m} x {t} tokens x {n_layers} layers, no checkpointing ({mixed})")
        return [saved], {"layer backward": [saved]}
    recompute = Component("recomputed layer", "activations", int(tokens * per_layer),
                          note=f"one layer in backward ({mixed})")
    which = f"{k} of {n_layers} layers (every {cfg.training.every_n})" if kept else f"{n_layers} layers"
    if offloads(cfg):
        inputs = Component("last hidden state", "activations", tokens * h * a, dtype=act,
                           note=f"{m} x {t} tokens x h; the inputs of the {which} in pinned host memory")
        at_recompute = [inputs, Component("layer input back from host", "activations", tokens * h * a, dtype=act,
                                          note="the recomputed layer's"), recompute]
    else:
        inputs = Component("checkpointed layer inputs", "activations", tokens * h * a * (k + 1), dtype=act,
                           note=f"{m} x {t} tokens x {k + 1} x h" + (f": {which} + the last" if kept else ""))
        at_recompute = [inputs, recompute]
    if not kept:
        return [inputs], {"layer backward": at_recompute}
    rest = Component("saved activations", "activations", int(tokens * per_layer * kept),
                     note=f"{m} x {t} tokens x the {kept} layers not checkpointed ({mixed})")
    below = (k - 1) * (cfg.training.every_n - 1)  # layers not checkpointed under the last checkpointed one
    moments = {"layer backward": [inputs, rest]}
    moments["recomputed layer backward"] = at_recompute + ([Component(
        "saved activations", "activations", int(tokens * per_layer * below),
        note=f"{m} x {t} tokens x the {below} layers below it not checkpointed ({mixed})")] if below else [])
    return [inputs, rest], moments


def offload_host_components(cfg, shape: ModelShape) -> list[Component]:
    """Pinned host memory the offloaded inputs of one micro-batch's forward take (the blocks are cached
    and reused by the next forward); nothing without offload on a CUDA card. A critic of its own
    (``critic.model``) offloads its checkpointed inputs after the actor's backward freed the actor's
    blocks: torch's host allocator reuses a freed block of the same power of two only, so its blocks
    add to the actor's where their size differs, and only those beyond the actor's count where it does not."""
    if not offloads(cfg):
        return []
    k = cfg.training.checkpointed_layers(shape.num_layers)
    block = offloaded_bytes(cfg, shape) // k
    comps = [Component("offloaded layer inputs (pinned)", "activations", k * pinned_block(block), in_allocator=False,
                       note=f"{k} layers x {block:,} B, each block rounded up to a power of two")]
    own = critic_shape(cfg)
    if own is not None:
        k_own = cfg.training.checkpointed_layers(own.num_layers)
        own_block = offloaded_bytes(cfg, own) // k_own
        extra = k_own if pinned_block(own_block) != pinned_block(block) else max(0, k_own - k)
        if extra:
            comps.append(Component("critic offloaded layer inputs (pinned)", "activations",
                                   extra * pinned_block(own_block), in_allocator=False,
                                   note=f"{extra} of its {k_own} checkpointed layers x {own_block:,} B on {own.name}"))
    return comps


def pcie_gbs(cfg) -> float:
    """The card's host link, GB/s one way (:mod:`homerlhf.memory.cards`; PCIe 4.0 x16 for one not listed)."""
    from homerlhf.memory.cards import card_spec

    spec = card_spec(cfg.card.name)
    return spec.pcie_gbs if spec is not None else PCIE4_X16_GBS


def checkpointing_seconds(cfg, shapes: list[ModelShape], update_s: float, sequences: int) -> float:
    """The update's seconds under the run's checkpointing, from ``update_s`` at every layer checkpointed
    (how the GPU rates were measured: forward + backward + recompute, 4 forwards' work) on a CUDA card:
    x (3 + k / L) / 4, + the offload's copies of ``sequences`` (each model's forward passes, ``shapes``
    the models of one pass: actor, critic) each way at the card's PCIe rate, on the compute stream.
    On a CPU the figure as it is (its rates are measured as the run trains)."""
    if cfg.card.device != "cuda" or not shapes:
        return update_s
    share = sum(cfg.training.checkpointed_layers(s.num_layers) / s.num_layers for s in shapes) / len(shapes)
    copies = sum(2 * offloaded_bytes(cfg, s, sequences) for s in shapes) if offloads(cfg) else 0
    return update_s * (3 + share) / 4 + copies / (pcie_gbs(cfg) * 1e9)
