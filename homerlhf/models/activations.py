"""Activation checkpointing of the decoder layers: which ones recompute in backward, and where the
inputs they keep for the recompute wait.

``every_n``: layers 0, n, 2n, ... are checkpointed (their forward runs again in backward; only their
input is kept), the others keep every activation their backward needs. ``offload``: the checkpointed
layers' inputs go to pinned host memory in the forward and come back for the recompute, through
``torch.autograd.graph.save_on_cpu``. Under non-reentrant checkpointing a checkpointed layer saves
nothing else, so the bytes moved are its hidden states, each way
(:func:`homerlhf.memory.recompute.offloaded_bytes`). Two paths to the same layers and bytes:
transformers' own ``activation_checkpointing_enable`` where the installed version has it, else this
module's (:func:`enable_checkpointing`).
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch.autograd.graph import save_on_cpu

CHECKPOINT_KWARGS = {"use_reentrant": False}


def native_supported(model) -> bool:
    """Whether ``model``'s transformers has ``activation_checkpointing_enable(every_n_layers, offload)``."""
    enable = getattr(type(model), "activation_checkpointing_enable", None)
    return enable is not None and {"every_n_layers", "offload"} <= set(inspect.signature(enable).parameters)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated decoder layers that can checkpoint, in forward order (transformers'
    ``GradientCheckpointingLayer`` instances, which ``every_n_layers`` counts)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def checkpointed_flags(model) -> list[bool]:
    """Which decoder layers of ``model`` recompute in backward, in forward order."""
    return [getattr(layer, "gradient_checkpointing", False) is True for layer in decoder_layers(model)]


def enable_checkpointing(model, every_n: int = 1, offload: bool = False, *, native: Optional[bool] = None) -> str:
    """Checkpoint every ``every_n``-th decoder layer of ``model`` (a transformers ``PreTrainedModel``),
    non-reentrant, their inputs in host memory with ``offload``. ``native``: transformers' own method
    (default: where it has one) or this module's wrapping of the same layers. Returns the path taken:
    ``transformers`` or ``save_on_cpu``. Calling it again replaces the earlier settings. On a CPU model
    the offload is this module's (transformers' pins host memory, which needs an accelerator: on a
    CPU-only torch it raises), unless ``native`` asks for transformers'.

    Transformers' ``PreTrainedModel.activation_checkpointing_enable(every_n_layers=..., offload=...)`` is
    in 5.24 (:func:`native_supported`); without it (5.17) every layer's checkpointing is enabled the old
    way and each layer's flag and checkpoint function are set here, the latter wrapped in ``save_on_cpu``
    as transformers wraps it. On a CPU ``save_on_cpu`` without pinning keeps a CPU tensor where it is."""
    if every_n < 1:
        raise ValueError(f"every_n must be >= 1, got {every_n}")
    device_type = next(model.parameters()).device.type
    if native is None:  # transformers' offload pins host memory: no pinned allocator without an accelerator
        native = native_supported(model) and not (offload and device_type == "cpu")
    if native:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=dict(CHECKPOINT_KWARGS),
                                              every_n_layers=every_n, offload=offload)
    elif hasattr(model, "activation_checkpointing_enable"):  # every layer here; ours are chosen below
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=dict(CHECKPOINT_KWARGS))
    else:  # transformers before 5.24: the method's name then (a deprecated alias since)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(CHECKPOINT_KWARGS))
    if not native:
        for index, layer in enumerate(decoder_layers(model)):
            layer.gradient_checkpointing = index % every_n == 0
            if offload and layer.gradient_checkpointing:
                layer._gradient_checkpointing_func = _offloaded(layer._gradient_checkpointing_func, device_type)
    path = "transformers" if native else "save_on_cpu"
    model._homerlhf_checkpointing = {"every_n": every_n, "offload": offload, "path": path}  # for reports
    return path


def checkpointing_report(model) -> dict:
    """What ``model``'s decoder layers do in backward, for reports (``homerlhf check``): ``layers``, the
    indices ``recomputed`` (read from the layers themselves) and ``offloaded`` (those whose inputs go to
    host memory: this module's wrapping read from the layer, transformers' from the setting
    :func:`enable_checkpointing` gave it), and ``path`` (None: never enabled here)."""
    setting = getattr(model, "_homerlhf_checkpointing", None) or {}
    native_offload = setting.get("path") == "transformers" and setting.get("offload", False)
    recomputed, offloaded = [], []
    for index, layer in enumerate(decoder_layers(model)):
        if getattr(layer, "gradient_checkpointing", False) is True:
            recomputed.append(index)
            if native_offload or getattr(getattr(layer, "_gradient_checkpointing_func", None), "offloads", False):
                offloaded.append(index)
    return {"layers": len(decoder_layers(model)), "recomputed": recomputed, "offloaded": offloaded,
            "path": setting.get("path")}


def _offloaded(checkpoint_func, device_type: str):
    """``checkpoint_func`` whose saved inputs go to host memory: pinned where there is a device to
    copy from (transformers' ``checkpoint_func`` under ``offload=True``)."""

    def run(function, *args, **kwargs):
        with save_on_cpu(pin_memory=device_type != "cpu", device_type=device_type):
            return checkpoint_func(function, *args, **kwargs)

    run.offloads = True  # read by checkpointing_report
    return run
