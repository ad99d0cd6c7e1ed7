"""What the trainer and update tests share: the tiny CPU config and tokenised builtin prompts (the
peaked tiny policy of the learning tests is in the top-level conftest: the engine's uses it too)."""

from __future__ import annotations

import pytest


@pytest.fixture
def ppo_cfg():
    """``ppo_cfg(*overrides)``: the cpu-tiny config with the adapter-off reference and an HF reward.

    The KL, truncation and actor settings are pinned to a fixed ``kl_coef`` 0.02, no truncation
    penalty and ``actor.lr`` 2e-3 (what these tests' figures were measured with), not the demo
    recipe of the preset: the tests cap responses at a few tokens, which the preset's penalty would
    score all alike."""
    from homerlhf.config import load_config

    def make(*extra):
        return load_config("cpu-tiny", overrides=[
            "ref.backend=adapter_off", "reward.backend=hf", "logging.progress=false", "ppo.kl_coef=0.02",
            "ppo.adaptive_kl=false", "rollout.truncation_penalty=null", "actor.lr=2e-3", *extra])

    return make


@pytest.fixture
def prompt_ids():
    """``prompt_ids(tokenizer, n)``: the first ``n`` builtin prompts, chat-templated token ids."""
    from homerlhf.data.builtin import all_examples

    def make(tokenizer, n):
        out = []
        for example in all_examples()[:n]:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": example.prompt}],
                                                add_generation_prompt=True, tokenize=True)
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        return out

    return make


class StrayTensorsOnMeta:
    """While active, a tensor that homerlhf's own code creates without naming a device is made on
    ``meta``; ``sent`` lists those call sites (file:line).

    On a GPU such a tensor lands on the CPU beside the trainer's CUDA tensors, and fails at the first
    op that mixes them (or sits in an experience on the wrong device). On the CPU both are the CPU
    and nothing shows; here the stray ones are on ``meta`` while the trainer's stay on the CPU, so
    the same mistakes fail on the CPU too."""

    FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "full", "empty", "arange", "randperm", "rand", "randn",
                 "randint", "linspace")

    def __init__(self):
        import os
        import sys
        from pathlib import Path

        import torch
        from torch.overrides import TorchFunctionMode

        import homerlhf

        package = str(Path(homerlhf.__file__).resolve().parent) + os.sep
        factories = {getattr(torch, name) for name in self.FACTORIES}
        sent = self.sent = []

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = dict(kwargs or {})
                if func in factories and kwargs.get("device") is None:
                    caller = sys._getframe(1)  # the call site: factories are C functions
                    if caller.f_code.co_filename.startswith(package):
                        kwargs["device"] = "meta"
                        sent.append(f"{caller.f_code.co_filename[len(package):]}:{caller.f_lineno}")
                return func(*args, **kwargs)

        self._mode = Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


@pytest.fixture
def stray_tensors_on_meta():
    """``with stray_tensors_on_meta() as mode: ...``: see :class:`StrayTensorsOnMeta`."""
    return StrayTensorsOnMeta


class HostSyncs:
    """While active, counts what would make the host wait for a GPU, by the homerlhf line that asked
    (``counts``: ``{"ppo/update.py:123": n}``): reading a tensor's value (``.item()``, ``float(t)``,
    ``bool(t)``, ``int(t)``: ``aten._local_scalar_dense``), ``.tolist()``, data-dependent shapes
    (``nonzero``, boolean indexing) and an upload of host data (``torch.tensor(..., device=...)``). On
    the CPU nothing waits, but the same calls run, so their count is the GPU's. Calls made inside other
    libraries (transformers' mask checks, torch's clipping) are counted under ``other``."""

    SYNCS = ("_local_scalar_dense", "nonzero", "masked_select", "equal")

    def __init__(self):
        import os
        from pathlib import Path

        import homerlhf

        self.package = str(Path(homerlhf.__file__).resolve().parent) + os.sep
        self.counts: dict[str, int] = {}
        self.others: list[str] = []  # where the ``other`` ones were asked for

    def _record(self) -> None:
        import sys

        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(self.package):
                key = f"{name[len(self.package):]}:{frame.f_lineno}"
                break
            if "site-packages" in name and "/torch/" not in name:  # another library's own call
                key = "other"
                self.others.append(f"{name.split('site-packages/')[-1]}:{frame.f_lineno}")
                break
            frame = frame.f_back
        else:
            key = "other"
        self.counts[key] = self.counts.get(key, 0) + 1

    def ours(self) -> int:
        return sum(n for key, n in self.counts.items() if key != "other")

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                bool_index = func.overloadpacket in (torch.ops.aten.index, torch.ops.aten.index_put_) and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []))
                if func.overloadpacket.__name__ in HostSyncs.SYNCS or bool_index:
                    counter._record()
                return func(*args, **(kwargs or {}))

        self._tolist, self._tensor = torch.Tensor.tolist, torch.tensor
        tolist, tensor = self._tolist, self._tensor

        def counted_tolist(t, *args, **kwargs):
            counter._record()
            return tolist(t, *args, **kwargs)

        def counted_tensor(data, *args, **kwargs):
            if kwargs.get("device") is not None:
                counter._record()
            return tensor(data, *args, **kwargs)

        torch.Tensor.tolist, torch.tensor = counted_tolist, counted_tensor
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        import torch

        self._mode.__exit__(*exc)
        torch.Tensor.tolist, torch.tensor = self._tolist, self._tensor
        return False


@pytest.fixture
def host_syncs():
    """``with host_syncs() as syncs: ...; syncs.counts``: see :class:`HostSyncs`."""
    return HostSyncs
