"""Checkpointing every n-th layer and offloading the checkpointed inputs (homerlhf.models.activations) on
a real NF4 base (bitsandbytes) with peft LoRA actor + critic and the value head: the same losses and
gradients as checkpointing every layer, through transformers' own ``activation_checkpointing_enable``
and through the ``save_on_cpu`` wrapping of the same layers (forced here: the GPU machine's transformers
may lack the former); and the bytes the offload moves, counted at its pack and unpack hooks, are the
planner's (homerlhf.memory.recompute.offloaded_bytes)."""

from __future__ import annotations

import pytest
import torch

from homerlhf.config import load_config
from homerlhf.memory.recompute import offloaded_bytes
from homerlhf.memory.shapes import resolve_shape
from homerlhf.models import activations
from homerlhf.models.activations import checkpointed_flags, checkpointing_report, enable_checkpointing, native_supported

M, PROMPT, NEW = 2, 10, 6  # a micro-batch of 2 sequences of 10 + 6 tokens
PATHS = ["transformers", "save_on_cpu"]


class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """``save_on_cpu`` with the bytes through its pack hook (forward, to host) and its unpack hook
    (backward, back to the device) recorded; pinned only where there is an accelerator: transformers'
    offload asks for pinned host memory, which a CPU-only torch cannot allocate (it raises), so on this
    machine its copies are plain host tensors, as homerlhf's own path makes them on a CPU."""

    packed: list[int] = []
    unpacked: list[int] = []

    def __init__(self, pin_memory: bool = False, device_type: str = "cuda"):
        super().__init__(pin_memory=pin_memory and torch.cuda.is_available(), device_type=device_type)
        pack, unpack = self.pack_hook, self.unpack_hook

        def counted_pack(tensor):
            CountingSaveOnCpu.packed.append(tensor.nbytes)
            return pack(tensor)

        def counted_unpack(packed):
            tensor = unpack(packed)
            CountingSaveOnCpu.unpacked.append(tensor.nbytes)
            return tensor

        self.pack_hook, self.unpack_hook = counted_pack, counted_unpack


@pytest.fixture
def counted(monkeypatch):
    """Both paths' ``save_on_cpu`` counted (transformers binds the name at import: patched there too)."""
    import transformers.modeling_utils

    monkeypatch.setattr(activations, "save_on_cpu", CountingSaveOnCpu)
    monkeypatch.setattr(transformers.modeling_utils, "save_on_cpu", CountingSaveOnCpu, raising=False)
    CountingSaveOnCpu.packed, CountingSaveOnCpu.unpacked = [], []
    return CountingSaveOnCpu


def config(upcast: bool, *extra: str):
    """cpu-tiny with checkpointing on: fp32 with peft's upcast (prepare_model_for_kbit_training), or
    bf16 end to end; the micro-batch and lengths of these tests."""
    return load_config("cpu-tiny", None, [
        "training.gradient_checkpointing=true", f"quant.upcast_non_quantized={str(upcast).lower()}",
        *([] if upcast else ["quant.compute_dtype=bf16"]), f"ppo.micro_batch_size={M}",
        f"rollout.max_prompt_len={PROMPT}", f"rollout.max_new_tokens={NEW}", *extra])


@pytest.fixture(scope="module", params=[True, False], ids=["fp32-upcast", "bf16"])
def policy(request, tiny_llama_dir):
    """A PolicyModel (NF4 base, LoRA actor and critic, value head) loaded with ``auto`` checkpointing
    unresolved (as outside a run: every layer, no offload), its adapters and value head moved off their
    zero init so every gradient is non-zero."""
    from homerlhf.models.policy import PolicyModel

    cfg = config(request.param, "training.checkpoint_every_n_layers=auto", "training.activation_offload=auto")
    torch.manual_seed(0)
    built = PolicyModel.from_config(cfg, str(tiny_llama_dir))
    with torch.no_grad():
        for param in built.actor_parameters() + built.critic_parameters():
            param.normal_(0.0, 0.1)
    return built, cfg


def batch(policy_model):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, policy_model.vocab_size, (M, PROMPT + NEW), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding, as in rollouts
    return ids, mask


def losses_and_grads(policy_model):
    """A PPO-like actor loss and a value loss on one micro-batch, and every trainable gradient."""
    params = policy_model.actor_parameters() + policy_model.critic_parameters()
    for param in params:
        param.grad = None
    ids, mask = batch(policy_model)
    policy_model.checkpoint_activations(True)
    logprobs, _ = policy_model.actor_logprobs(ids, mask, NEW)
    actor_loss = -(logprobs * torch.linspace(-1.0, 1.0, NEW)).mean()
    actor_loss.backward()  # each adapter's backward before the other's forward, as the update runs them
    values = policy_model.critic_values(ids, mask, NEW)
    critic_loss = ((values - 0.5) ** 2).mean()
    critic_loss.backward()
    losses = torch.stack([actor_loss, critic_loss])
    policy_model.checkpoint_activations(False)
    return losses.detach(), [param.grad.clone() for param in params]


@pytest.mark.parametrize("path", PATHS)
def test_every_n_and_offload_give_the_losses_and_gradients_of_full_checkpointing(policy, path, counted):
    """Layers 0 and 2 of 4 (every 2), and layers 0 and 3 (every 3) with their inputs offloaded: against
    every layer checkpointed, the losses and each LoRA / value-head gradient equal to rounding (the
    recompute runs the same kernels on the same inputs). fp32 with peft's prepare_model_for_kbit_training
    (bf16 runs forward and backward through both paths in the bytes test below)."""
    policy_model, cfg = policy
    if not cfg.quant.upcast_non_quantized:
        pytest.skip("the losses and gradients are compared in fp32")
    assert checkpointed_flags(policy_model.model.get_base_model()) == [True] * 4  # auto unresolved: every layer
    base = policy_model.model.get_base_model()
    native = path == "transformers"
    if native and not native_supported(base):
        pytest.skip("this transformers has no activation_checkpointing_enable(every_n_layers, offload)")
    enable_checkpointing(base, 1, False, native=native)
    ref_losses, ref_grads = losses_and_grads(policy_model)
    assert all(g.abs().sum() > 0 for g in ref_grads)
    for every_n, offload, flags in ((2, False, [1, 0, 1, 0]), (3, True, [1, 0, 0, 1])):
        assert enable_checkpointing(base, every_n, offload, native=native) == path
        assert checkpointed_flags(base) == [bool(f) for f in flags]
        counted.packed.clear()
        losses, grads = losses_and_grads(policy_model)
        assert bool(counted.packed) == offload  # the offload ran (and only then)
        torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=1e-7)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    enable_checkpointing(base, 1, False)


@pytest.mark.parametrize("path", PATHS)
def test_the_offload_moves_the_bytes_the_planner_counts(policy, path, counted, tiny_llama_dir):
    """One actor forward + backward, every 3rd layer offloaded, moves each checkpointed layer's input
    hidden states to the host and back: k x m x t x h x a bytes each way (k = 2 of 4 layers; a = 4 with
    the upcast, 2 in bf16), what the planner's offloaded_bytes says for the same settings, nothing else."""
    every_n = 3
    policy_model, cfg = policy
    base = policy_model.model.get_base_model()
    native = path == "transformers"
    if native and not native_supported(base):
        pytest.skip("this transformers has no activation_checkpointing_enable(every_n_layers, offload)")
    assert enable_checkpointing(base, every_n, True, native=native) == path
    ids, mask = batch(policy_model)
    policy_model.checkpoint_activations(True)
    logprobs, _ = policy_model.actor_logprobs(ids, mask, NEW)
    packed = sum(counted.packed)
    logprobs.sum().backward()
    policy_model.checkpoint_activations(False)
    enable_checkpointing(base, 1, False)
    planned = offloaded_bytes(config(cfg.quant.upcast_non_quantized, "training.activation_offload=true",
                                     f"training.checkpoint_every_n_layers={every_n}"), resolve_shape(str(tiny_llama_dir)))
    a = 4 if cfg.quant.upcast_non_quantized else 2
    k = 2
    assert packed == planned == k * M * (PROMPT + NEW) * 128 * a
    assert len(counted.packed) == k
    assert sum(counted.unpacked) == planned


def test_the_policy_applies_the_configured_layers_and_offload(tiny_llama_dir):
    """``PolicyModel.from_config`` checkpoints the layers ``training.checkpoint_every_n_layers`` names (an
    unresolved ``auto``, as outside a run, is every layer: the ``policy`` fixture). On a CPU model the
    offload takes homerlhf's path whatever transformers has (its own pins host memory)."""
    from homerlhf.models.policy import PolicyModel

    cfg = config(True, "training.checkpoint_every_n_layers=2", "training.activation_offload=true")
    offloading = PolicyModel.from_config(cfg, str(tiny_llama_dir)).model.get_base_model()
    assert checkpointed_flags(offloading) == [True, False] * 2
    assert checkpointing_report(offloading) == {"layers": 4, "recomputed": [0, 2], "offloaded": [0, 2],
                                                "path": "save_on_cpu"}  # what `homerlhf check` records
    assert enable_checkpointing(offloading, 2, True) == "save_on_cpu"
    assert enable_checkpointing(offloading, 4, False) == ("transformers" if native_supported(offloading) else "save_on_cpu")
    assert checkpointed_flags(offloading) == [True, False, False, False]
    assert checkpointing_report(offloading)["recomputed"] == [0] and checkpointing_report(offloading)["offloaded"] == []
    if native_supported(offloading):  # transformers' own offload, as a GPU run takes it (no forward here: nothing pinned)
        enable_checkpointing(offloading, 2, True, native=True)
        assert checkpointing_report(offloading) == {"layers": 4, "recomputed": [0, 2], "offloaded": [0, 2],
                                                    "path": "transformers"}


@pytest.mark.parametrize("native", [True, False], ids=PATHS)
def test_enabling_uses_transformers_current_names(native, tiny_llama_dir):
    """No FutureWarning from our own calls (transformers 5.24+ deprecates gradient_checkpointing_enable and
    is_gradient_checkpointing): either path, every n-th layer."""
    import warnings

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert enable_checkpointing(model, every_n=2, native=native) == PATHS[not native]
    assert checkpointed_flags(model) == [i % 2 == 0 for i in range(len(checkpointed_flags(model)))]
