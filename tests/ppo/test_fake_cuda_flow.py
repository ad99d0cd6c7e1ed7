"""A CPU dry run of one PPO step's CUDA path: the tiny policy on a fake ``cuda`` device, where a CPU
tensor meeting a CUDA one fails as it would on a GPU. Also on it: a critic of its own (``critic.model``),
every n-th layer checkpointed with its inputs offloaded (the forward and where saved tensors go), and
the DPO / KTO held-out log-prob pass.

How: torch's ``FakeTensorMode`` makes tensors that carry a device, a dtype and a shape but no data, so a
CPU-only build can "place" a model on ``cuda:0`` and run its forward, raising
``FakeTensorDeviceMismatchError`` where CUDA would refuse to mix devices. Three things it lacks here, and
what :class:`FakeCuda` adds:

- Indexing a fake CUDA tensor (``t[:, 1:]``) takes a CUDA device guard, which a CPU-only build does not
  register (``torch._C._ensureCUDADeviceGuardSet`` only replaces one a CUDA build has): the meta device's
  no-op guard is put in CUDA's slot of c10's registry while the mode is on, and taken out after. Devices
  are named ``cuda:0``: a bare ``cuda`` would take the no-op guard's current device.
- Fake kernels do not check dtypes: ``bf16 @ fp32`` gives a tensor where every real kernel refuses it.
  :class:`DtypeAndIndexChecks` refuses matrix products and attention over mixed floating dtypes.
- Fake indexing lets a CPU tensor take a CUDA index; CUDA refuses it (the first GPU run's crash in
  ``Experience.select``: ``policy_version`` on the CPU, the index moved to the CUDA fields' device).

What cannot run this way, and is tested around:

- **Backward.** torch's autograd engine asks the CUDA runtime for the current stream of every CUDA
  gradient (``InputBuffer::add`` -> ``at::accelerator::getCurrentStream``: "Cannot access accelerator
  device when none is available"). The losses' forward runs on fake CUDA; their backward runs on the
  real CPU policy in bf16 compute (real kernels refuse mixed dtypes), and the fused AdamW step (the
  CUDA-only optimizer) on fake CUDA with gradients of each parameter's device and dtype.
- **Host reads.** ``.item()``, ``.tolist()``, ``bool(t)`` and boolean-mask shapes need values: the static
  loop's "has every row stopped?" (``sample``'s ``_steps_taken``), ``Experience._extents`` (so
  ``minibatches``/``split``), ``host_floats``, the advantages' whitening (``masked_var`` reads the mask's
  count twice: run here without whitening, and with it on the CPU). ``StaticDecoder.generate`` is run
  to its read: every decode step before it ran on fake CUDA. The loop's pieces (``prefill``,
  ``decode_step``, the sampler and the behaviour log-probs) also run one by one; mini-batches are taken
  with ``select``/``rows``.
- **CUDA graphs and streams** (``decode_graphs.StepGraphs``: ``torch.cuda.Stream``, ``CUDAGraph``) need
  the CUDA runtime: :class:`EagerGraphs` replaces those four primitives only, and the "captured" step,
  ``decode_step``, replays eagerly.
- **bitsandbytes' 4-bit linears**: ``Params4bit`` and its quant state are not what ``FakeTensorMode``
  converts, and their kernels need a device: the base here is unquantized bf16, which takes the same
  path through LoRA, the value head and the fp32 LM head. ``GradScaler("cuda")`` disables itself on a
  CPU-only build, so the fp16 scaler is not run either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ctypes
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorDeviceMismatchError, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import homerlhf
from homerlhf.models.decode_graphs import StepGraphs
from homerlhf.ppo.rollout import pad_sequences

CUDA = torch.device("cuda", 0)
# The imported package's own directory: a frame is the package's when its file lies under it (the
# checkout's folder may be named homerlhf too, as `git clone` names it, and holds these tests).
PACKAGE = Path(homerlhf.__file__).resolve().parent
_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "addmv", "mv", "dot"}
_INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}


def _guard_slots():
    """c10's device guard registry (one pointer per device type), or None where it cannot be read."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        registry = ctypes.c_void_p.in_dll(lib, "_ZN3c104impl26device_guard_impl_registryE")
    except (OSError, ValueError):
        return None
    return (ctypes.c_void_p * 15).from_address(ctypes.addressof(registry))  # up to Meta (14)


class DtypeAndIndexChecks(TorchDispatchMode):
    """What CUDA's kernels refuse and fake ones let through: a matrix product or attention over
    floating tensors of different dtypes, and a CPU tensor indexed with a CUDA index."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if name in _MATMULS or "scaled_dot_product" in name:
            operands = tensors if name in _MATMULS else tensors[:3]  # attention: query, key, value
            dtypes = {t.dtype for t in operands if t.is_floating_point()}
            if len(dtypes) > 1:
                got = sorted(map(str, dtypes))
                raise RuntimeError(f"{name}: expected the operands to have the same dtype, got {got}")
        if name in _INDEXING and args[0].device.type == "cpu":
            on_cuda = [i for i in args[1] if isinstance(i, torch.Tensor) and i.device.type == "cuda"]
            if on_cuda:
                raise RuntimeError("indices should be either on cpu or on the same device as the indexed tensor (cpu)")
        return func(*args, **kwargs)


class FakeCuda:
    """``with FakeCuda() as fake:`` tensors made on ``cuda:0`` are fake ones; ``fake.to_cuda(module)``
    moves a real module's parameters and buffers there (see the module docstring)."""

    def __init__(self):
        self.mode = FakeTensorMode(allow_non_fake_inputs=False)
        self.checks = DtypeAndIndexChecks()
        self._slots = _guard_slots()
        self._saved = None

    def __enter__(self) -> "FakeCuda":
        if self._slots is None:
            pytest.fail("c10's device guard registry is not readable in this torch build")
        cuda, meta = self._device_index("cuda"), self._device_index("meta")
        if not (self._slots[0] and self._slots[meta]):  # CPU's and meta's guards: always registered
            pytest.fail("c10's device guard registry does not have the layout this test knows")
        self._saved = self._slots[cuda]
        if self._saved is None:  # a CPU-only build: no CUDA guard at all
            self._slots[cuda] = self._slots[meta]
        self.mode.__enter__()
        self.checks.__enter__()
        return self

    def __exit__(self, *exc):
        self.checks.__exit__(*exc)
        self.mode.__exit__(*exc)
        self._slots[self._device_index("cuda")] = self._saved
        return False

    @staticmethod
    def _device_index(name: str) -> int:
        return {"cuda": 1, "meta": 14}[name]  # c10::DeviceType

    def to_cuda(self, module: torch.nn.Module) -> None:
        module._apply(lambda t: self.mode.from_tensor(t).to(CUDA))


@pytest.fixture(scope="module")
def bf16_policy_dir(tmp_path_factory):
    from homerlhf.tiny import build_causal_lm

    return build_causal_lm(tmp_path_factory.mktemp("fake-cuda-qwen2"), arch="qwen2", seed=3)


def _policy(model_dir, *extra):
    """The tiny Qwen2 (GQA, biased q/k/v) as a PPO policy under bf16 compute: LoRA actor and critic
    adapters, value head, the fp32 LM head; unquantized (see the module docstring)."""
    from homerlhf.config import load_config
    from homerlhf.models.policy import PolicyModel

    cfg = load_config("cpu-tiny", overrides=["quant.load_in_4bit=false", "quant.compute_dtype=bf16",
                                             "critic.shared_adapter=false", "rollout.max_new_tokens=4", *extra])
    return cfg, PolicyModel.from_config(cfg, str(model_dir))


@pytest.fixture(scope="module")
def cuda_policy(bf16_policy_dir):
    """``(cfg, policy, fake)``: the policy moved to fake ``cuda:0``; enter ``fake`` to use it."""
    cfg, policy = _policy(bf16_policy_dir)
    fake = FakeCuda()
    with fake:
        fake.to_cuda(policy.model)
        fake.to_cuda(policy.value_head)
    assert policy.device == CUDA and policy.lm_head.weight.dtype == torch.bfloat16
    return cfg, policy, fake


PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]


def test_the_fake_device_refuses_what_cuda_refuses():
    with FakeCuda():
        x = torch.randn(2, 3, device=CUDA)
        assert x.is_cuda and (x @ torch.randn(3, 4, device=CUDA)).device == CUDA
        assert x[:, 1:].device == CUDA and x[torch.tensor([1, 0])].device == CUDA  # a CPU index: CUDA takes it
        with pytest.raises(FakeTensorDeviceMismatchError):
            x + torch.randn(3)
        with pytest.raises(RuntimeError, match="same dtype"):
            x.bfloat16() @ torch.randn(3, 4, device=CUDA)
        with pytest.raises(RuntimeError, match="indices should be either on cpu"):
            torch.arange(4)[torch.tensor([1, 0], device=CUDA)]
        with pytest.raises(DataDependentOutputException):
            x.sum().item()


def test_rollout_pieces_and_the_static_decode_step_on_cuda(cuda_policy):
    """The static loop as ``sample`` runs it, step by step: prefill, the decode step (what a graph
    captures), the behaviour log-probs and the per-sample sampler's counter noise (CUDA's default)."""
    from homerlhf.models.decode_attention import folded_decode_attention
    from homerlhf.models.generation import BehaviourLogprobs
    from homerlhf.models.sampling import PerSampleSampler
    from homerlhf.models.static_decode import DecodeBuffers, decode_step, next_tokens, prefill, resolve_decoder
    from homerlhf.ppo.rollout import response_mask_and_truncated

    cfg, policy, fake = cuda_policy
    inner, pad = policy.model.get_base_model(), policy.tokenizer.pad_token_id
    assert resolve_decoder("auto", policy.device) == "static"
    policy.checkpoint_activations(False)
    with fake, torch.no_grad():
        prompt_ids, prompt_mask = pad_sequences(PROMPTS, pad, device=policy.device)
        sampler = PerSampleSampler([1, 2, 3], 1.0, policy.device)
        assert sampler.noise == "counter"
        recorder, bufs = BehaviourLogprobs(1.0), DecodeBuffers(inner, 3, prompt_ids.shape[1] + 4, policy.device)
        with folded_decode_attention(inner):
            logits = prefill(inner, bufs, prompt_ids, prompt_mask)
            step, columns, last = decode_step(inner, bufs), [], prompt_ids[:, -1:]
            for t in range(4):
                tokens = next_tokens(logits, last, [recorder, sampler], 1.0)
                columns.append(tokens)
                bufs.feed(tokens, prompt_ids.shape[1] + t)
                step()
                bufs.positions.add_(1)
                logits, last = bufs.logits.clone(), tokens[:, None]
        response_ids = torch.stack(columns, dim=1)
        response_mask, truncated = response_mask_and_truncated(response_ids, policy.stop_ids)
        behaviour = torch.where(response_mask.bool(), recorder.taken(response_ids), 0.0)
    assert logits.dtype == torch.float32 and logits.device == CUDA
    assert {t.device for t in (response_ids, response_mask, truncated, behaviour)} == {CUDA}
    assert behaviour.dtype == torch.float32 and response_ids.shape == (3, 4)


class EagerGraphs(StepGraphs):
    """:class:`StepGraphs` on ``cuda:0`` with its four CUDA primitives replaced (a stream and a pool are
    names, a "graph" replays the step eagerly), as tests/models/test_decode_replays.py does on the CPU:
    the warm-up, the host-sync check and the capture's order are StepGraphs' own."""

    def new_stream(self):
        return "stream"

    def new_pool(self):
        return "pool"

    @contextlib.contextmanager
    def on_stream(self, stream):
        yield

    def capture_graph(self, step, stream, pool):
        return SimpleNamespace(replay=step)


def test_static_generate_runs_every_step_on_cuda_up_to_its_one_host_read(cuda_policy):
    """``policy.generate(decoder="static")``: prefill, warm-up, capture and replayed steps on fake CUDA;
    it stops at the read of "has every row stopped?" after its last step (``_steps_taken``), nothing
    earlier."""
    from homerlhf.models.generation import build_generation_config

    cfg, policy, fake = cuda_policy
    config = build_generation_config(max_new_tokens=3, temperature=1.0, stop_ids=policy.stop_ids,
                                     pad_id=policy.tokenizer.pad_token_id)
    policy.static_decoder.graphs = graphs = EagerGraphs(CUDA)
    policy.checkpoint_activations(False)
    try:
        with fake:
            prompt_ids, prompt_mask = pad_sequences(PROMPTS, policy.tokenizer.pad_token_id, device=policy.device)
            with pytest.raises(DataDependentOutputException) as info:
                policy.generate(prompt_ids, prompt_mask, config, decoder="static")
    finally:
        policy.static_decoder.release()
        policy.static_decoder.graphs = None
    frames = [f.name for f in info.traceback if Path(f.path).resolve().is_relative_to(PACKAGE)]
    assert frames[-1] == "_steps_taken" and graphs.graphs_made == 1
    assert policy.static_decoder.off_reason is None  # nothing refused, nothing failed to capture


def _experience(cfg, policy, generator, whiten: bool = True):
    """One rollout's experience on the policy's device: sampled ids (the counter sampler's draw on the
    last prompt logits stands in for a decode loop, tested above), old and reference log-probs,
    values, scores as the backends' floats, advantages, importance weights, policy versions; then
    a mini-batch of it taken as ``Experience.minibatches`` takes one (a CPU permutation). ``whiten``:
    the advantages' whitening, which reads the mask's count on the host (``masked_var``)."""
    from homerlhf.models.sampling import PerSampleSampler
    from homerlhf.ppo.advantages import compute_advantages
    from homerlhf.ppo.devices import to_trainer
    from homerlhf.ppo.experience import Experience
    from homerlhf.ppo.importance import truncated_importance_weights
    from homerlhf.ppo.rollout import response_mask_and_truncated

    pad, device = policy.tokenizer.pad_token_id, policy.device
    prompt_ids, prompt_mask = pad_sequences(PROMPTS, pad, device=device)
    sampler = PerSampleSampler([4, 5, 6], 1.0, device)
    response_ids = torch.stack([sampler.draw(torch.zeros(3, policy.vocab_size, device=device)) for _ in range(4)], 1)
    response_mask, truncated = response_mask_and_truncated(response_ids, policy.stop_ids)
    input_ids, attention_mask = torch.cat([prompt_ids, response_ids], 1), torch.cat([prompt_mask, response_mask], 1)
    with torch.no_grad():
        logprobs, _, values = policy.actor_logprobs_and_values(input_ids, attention_mask, 4)
        ref_logprobs = policy.reference_logprobs(input_ids, attention_mask, 4)
    exp = Experience(prompt_ids, prompt_mask, response_ids, response_mask, logprobs, ref_logprobs, values,
                     to_trainer([1.0, 0.0, 0.5], device), truncated, behaviour_logprobs=logprobs - 0.01,
                     policy_version=torch.full((3,), 2, dtype=torch.long, device=device))
    exp = compute_advantages(exp, cfg.ppo.model_copy(update={"whiten_advantages": whiten}), 0.02, exp.scores)
    exp.is_weights = truncated_importance_weights(exp.old_logprobs, exp.behaviour_logprobs, response_mask, 2.0)
    order = torch.randperm(len(exp), generator=generator, device=generator.device)  # minibatches' draw
    return exp, exp.select(order.to(exp.device)[:2]).rows(0, 2)


def _updater(cfg, backward=lambda loss: None):
    """An :class:`homerlhf.ppo.update.Updater` for :func:`homerlhf.ppo.loop.micro_batch_loss` alone: its
    ``backward`` (none by default: the fake device cannot run one)."""
    from homerlhf.ppo.update import Updater

    return Updater(cfg, SimpleNamespace(backward=backward), actor_opt=None)


def test_experience_selection_and_the_losses_on_cuda(cuda_policy):
    """The update's pieces up to its backward: a mini-batch selected with a CPU permutation and a CPU
    index, the PPO losses with separate actor and critic adapters and the GRPO loss, all on CUDA."""
    from homerlhf.ppo.group import GroupLoss
    from homerlhf.ppo.loop import micro_batch_loss

    cfg, policy, fake = cuda_policy
    policy.checkpoint_activations(True)
    updater = _updater(cfg)
    with fake:
        exp, micro = _experience(cfg, policy, torch.Generator(device="cpu").manual_seed(0), whiten=False)
        assert exp.select(torch.tensor([2, 0])).device == CUDA  # a CPU index, moved by select
        losses = micro_batch_loss(policy, micro, 1.0, updater)
        # GRPO's loss reads one advantage per response (``compute_group_advantages`` gives it): the scores here
        grouped = dataclasses.replace(micro, sequence_advantages=micro.scores.to(micro.old_logprobs.dtype))
        group = micro_batch_loss(policy, grouped, 1.0, updater, GroupLoss(0.2, 0.05, "token_mean", 4))
    assert losses["policy_loss"].requires_grad and losses["value_loss"].requires_grad
    assert {v.device for v in [*losses.values(), *group.values()]} == {CUDA}
    assert {v.dtype for v in losses.values()} == {torch.float32}
    assert {getattr(micro, f).device for f in micro.__dataclass_fields__ if getattr(micro, f) is not None} == {CUDA}


def test_the_fused_adamw_step_on_cuda(cuda_policy):
    """``build_optimizer`` takes torch's fused AdamW for CUDA parameters (the CPU keeps the default):
    its step, with a gradient of each parameter's device and dtype, as backward leaves them."""
    from homerlhf.ppo.update import build_optimizer

    cfg, policy, fake = cuda_policy
    params = policy.actor_parameters() + policy.critic_parameters()
    with fake:
        optimizer = build_optimizer("adamw", params, 1e-3, 0.0)
        assert optimizer.defaults["fused"] is True
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert states and {t.device for t in states} == {CUDA} and {p.dtype for p in params} == {torch.float32}


def test_the_losses_backward_under_bf16_compute(bf16_policy_dir, tmp_path):
    """The backward the fake device cannot run (see the module docstring), on the CPU in the GPU
    presets' dtypes: bf16 base and LM head, fp32 LoRA and value head. Real kernels refuse mixed
    dtypes; every trainable weight gets an fp32 gradient."""
    from homerlhf.ppo.loop import micro_batch_loss

    cfg, policy = _policy(bf16_policy_dir)
    policy.checkpoint_activations(True)
    _, micro = _experience(cfg, policy, torch.Generator(device="cpu").manual_seed(0))
    stats = micro_batch_loss(policy, micro, torch.tensor(1.0), _updater(cfg, lambda loss: loss.backward()))
    grads = [p.grad for p in policy.actor_parameters() + policy.critic_parameters()]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads) and torch.isfinite(stats["policy_loss"])


def test_a_cpu_tensor_among_cuda_ones_fails_here_and_not_on_the_cpu(cuda_policy, monkeypatch):
    """The bug of the first GPU run, put back: ``policy_version`` made on the CPU (a factory call without
    a device) and the one-device check gone. On the CPU it passes; on fake CUDA, ``select`` fails as
    on the GPU: its index is moved to the CUDA fields' device and indexes the CPU field."""
    from homerlhf.ppo import experience

    cfg, policy, fake = cuda_policy
    monkeypatch.setattr(experience, "check_one_device", lambda exp: None)
    cpu_exp = experience.Experience(*[torch.zeros(3, 2, dtype=torch.long)] * 7, torch.zeros(3), torch.zeros(3).bool(),
                                    policy_version=torch.zeros(3, dtype=torch.long))
    assert len(cpu_exp.select(torch.tensor([1, 0]))) == 2
    with fake:
        fields = [torch.zeros(3, 2, dtype=torch.long, device=CUDA)] * 7
        exp = experience.Experience(*fields, torch.zeros(3, device=CUDA), torch.zeros(3, device=CUDA).bool(),
                                    policy_version=torch.zeros(3, dtype=torch.long))
        with pytest.raises(RuntimeError, match="indices should be either on cpu"):
            exp.select(torch.tensor([1, 0]))
    monkeypatch.undo()
    with fake, pytest.raises(ValueError, match="policy_version on cpu"):  # the check, back: at construction
        experience.Experience(*fields, torch.zeros(3, device=CUDA), torch.zeros(3, device=CUDA).bool(),
                              policy_version=torch.zeros(3, dtype=torch.long))


# -- a critic of its own, checkpointing every n-th layer with offload, the preference log-prob pass ---------

CHECKPOINTING = ["training.gradient_checkpointing=true", "training.checkpoint_every_n_layers=2",
                 "training.activation_offload=true", "rollout.max_prompt_len=5", "ppo.micro_batch_size=3",
                 "ppo.mini_batch_size=3", "rollout.batch_size=3", "rollout.chunk_size=3"]


@pytest.fixture(scope="module")
def critic_dir(tmp_path_factory):
    """A smaller causal LM (2 layers of width 32) on the policy's tokenizer: ``critic.model``."""
    from homerlhf.tiny import build_causal_lm

    return build_causal_lm(tmp_path_factory.mktemp("fake-cuda-critic"), arch="qwen2", seed=4, hidden=32, layers=2)


@pytest.fixture(scope="module")
def cuda_critic_policy(bf16_policy_dir, critic_dir):
    """``(cfg, policy, fake)``: the policy with ``critic.model`` and every 2nd layer checkpointed, its inputs
    offloaded, on fake ``cuda:0``. A GPU run loads each base on the GPU before it enables checkpointing
    (so the offload copies from the device it finds); here they move first, then it is enabled again, the
    way transformers 5.17 takes (:func:`homerlhf.models.activations.enable_checkpointing`, ``save_on_cpu``)."""
    from homerlhf.models.activations import enable_checkpointing

    cfg, policy = _policy(bf16_policy_dir, f"critic.model={critic_dir}", *CHECKPOINTING)
    fake = FakeCuda()
    with fake:
        for module in (policy.model, policy.critic_model.model, policy.value_head):
            fake.to_cuda(module)
        for model in (policy.model.get_base_model(), policy.critic_model.backbone):
            assert enable_checkpointing(model, 2, offload=True, native=False) == "save_on_cpu"
    assert policy.critic_model.backbone.device == CUDA and policy.value_head.linear.weight.device == CUDA
    return cfg, policy, fake


def test_a_critic_of_its_own_scores_and_its_losses_run_on_cuda(cuda_critic_policy):
    """``critic.model``: its values (its own base, bf16 like the actor's, its fp32 head) and the PPO losses
    with it, on CUDA; the experience and a mini-batch of it stay on CUDA."""
    from homerlhf.ppo.loop import micro_batch_loss

    cfg, policy, fake = cuda_critic_policy
    policy.checkpoint_activations(True)
    updater = _updater(cfg)
    with fake:
        exp, micro = _experience(cfg, policy, torch.Generator(device="cpu").manual_seed(0), whiten=False)
        losses = micro_batch_loss(policy, micro, 1.0, updater)
    assert exp.values.device == CUDA and exp.values.dtype == torch.float32 and exp.values.shape == (3, 4)
    assert losses["value_loss"].requires_grad and {v.device for v in losses.values()} == {CUDA}


def test_every_nth_layer_checkpointed_offloads_its_inputs_from_cuda_and_nothing_else(cuda_critic_policy, monkeypatch):
    """One forward with gradients of the actor and of the critic of its own: the layers checkpointed (0 and 2
    of the actor's 4, 0 of the critic's 2) have their inputs, and only those, copied from ``cuda:0`` to the
    host, what the planner's ``offloaded_bytes`` says for each base; every tensor the other layers save for
    backward stays on CUDA. (Their backward, which the fake device cannot run, is the next test's, on the CPU.)"""
    from homerlhf.memory.recompute import offloaded_bytes
    from homerlhf.memory.shapes import critic_shape, shape_from_config
    from homerlhf.models import activations
    from homerlhf.models.activations import checkpointing_report

    packed: list[tuple] = []

    class Recording(activations.save_on_cpu):
        def __init__(self, pin_memory: bool = False, device_type: str = "cuda"):
            super().__init__(pin_memory=pin_memory, device_type=device_type)
            pack = self.pack_hook

            def recorded(tensor):
                device, copy = pack(tensor)
                packed.append((device, copy.device, tensor.dtype, tuple(tensor.shape), copy.nbytes))
                return device, copy

            self.pack_hook = recorded

    monkeypatch.setattr(activations, "save_on_cpu", Recording)
    cfg, policy, fake = cuda_critic_policy
    assert checkpointing_report(policy.model.get_base_model())["offloaded"] == [0, 2]
    assert checkpointing_report(policy.critic_model.backbone)["offloaded"] == [0]
    kept: list[torch.device] = []
    policy.checkpoint_activations(True)
    with fake:
        input_ids, mask = pad_sequences([p + [20, 21, 22, 23] for p in PROMPTS], 0, device=CUDA)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (kept.append(t.device), t)[1], lambda t: t):
            logprobs, _, values = policy.actor_logprobs_and_values(input_ids, mask, 4)
    assert logprobs.requires_grad and values.requires_grad and {logprobs.device, values.device} == {CUDA}
    actor, critic = [p for p in packed if p[3][-1] == 128], [p for p in packed if p[3][-1] == 32]
    assert len(actor) == 2 and len(critic) == 1 and len(packed) == 3  # the layers' hidden states, nothing else
    assert {(p[0], p[1], p[2]) for p in packed} == {(CUDA, torch.device("cpu"), torch.bfloat16)}
    policy_shape = shape_from_config(policy.model.get_base_model().config, "policy", "local")
    assert sum(p[4] for p in actor) == offloaded_bytes(cfg, policy_shape) == 2 * 3 * 9 * 128 * 2
    assert sum(p[4] for p in critic) == offloaded_bytes(cfg, critic_shape(cfg)) == 1 * 3 * 9 * 32 * 2
    assert kept and set(kept) == {CUDA}


def test_the_backward_of_a_critic_of_its_own_with_offloaded_checkpoints_under_bf16_compute(bf16_policy_dir,
                                                                                          critic_dir):
    """The backward the fake device cannot run, on the CPU in the GPU presets' dtypes, with the critic of its
    own and every 2nd layer checkpointed, its inputs offloaded: every trainable weight of the actor and of
    the critic gets a finite fp32 gradient."""
    from homerlhf.ppo.loop import micro_batch_loss

    cfg, policy = _policy(bf16_policy_dir, f"critic.model={critic_dir}", *CHECKPOINTING)
    policy.checkpoint_activations(True)
    _, micro = _experience(cfg, policy, torch.Generator(device="cpu").manual_seed(0))
    stats = micro_batch_loss(policy, micro, torch.tensor(1.0), _updater(cfg, lambda loss: loss.backward()))
    for params in (policy.actor_parameters(), policy.critic_parameters()):
        grads = [p.grad for p in params]
        assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
        assert any(g.abs().sum() > 0 for g in grads)
    assert torch.isfinite(stats["value_loss"])


def test_the_preference_held_out_pass_runs_on_cuda_up_to_its_host_read(cuda_policy):
    """DPO / KTO's held-out log-probs on a peft model on CUDA, with its adapter and with adapters off (the
    reference of a new LoRA): the decoder, the gather of the answers' positions and the chunked fp32 head
    (bf16 hidden states, bf16 head) on CUDA; the figures are copied to the host, and the pass's one read of
    a value is its sum of each answer's log-probs."""
    from homerlhf.models.sequence_logprobs import answer_logprobs, lm_parts, token_logprobs
    from homerlhf.stages import preference_eval

    cfg, policy, fake = cuda_policy
    policy.checkpoint_activations(False)
    sequences, starts = [p + [20, 21, 22] for p in PROMPTS], [len(p) for p in PROMPTS]
    with fake, torch.no_grad():
        _, head, _ = lm_parts(policy.model)
        hidden = torch.randn(5, head.weight.shape[1], device=CUDA, dtype=torch.bfloat16)
        on_device = token_logprobs(head, hidden, torch.tensor([1, 2, 3, 4, 5], device=CUDA), chunk_tokens=2)
        mine = answer_logprobs(policy.model, sequences, starts, policy.tokenizer.pad_token_id, chunk_tokens=4)
        with policy.model.disable_adapter():
            base = answer_logprobs(policy.model, sequences, starts, policy.tokenizer.pad_token_id, chunk_tokens=4)
        rows = [{"prompt_ids": p, "chosen_ids": [20, 21, 22]} for p in PROMPTS]
        with pytest.raises(DataDependentOutputException) as info:
            preference_eval.completion_logprobs(policy.model, rows, "chosen_ids", policy.tokenizer.pad_token_id, 2, 2)
    assert on_device.device == CUDA and on_device.dtype == torch.float32 and on_device.shape == (5,)
    assert [t.shape for t in mine + base] == [(3,)] * 6 and {t.dtype for t in mine + base} == {torch.float32}
    assert {t.device.type for t in mine + base} == {"cpu"}  # copied to the host at the end
    read = [f for f in info.traceback if f.path == preference_eval.__file__ or str(f.path) == preference_eval.__file__]
    assert read and read[-1].name == "<genexpr>"  # float(x.sum()): after every device step of the batch
