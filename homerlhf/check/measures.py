"""What ``homerlhf check`` measures beside memory and time: the gap between the behaviour
log-probs the rollout sampled with and the trainer's scoring of the same tokens, and the precision
and attention-kernel settings each case ran with (restored between cases).

**Kernels** (``homerlhf.models.cuda_kernels``): each policy sets TF32 and the SDPA backends; the check
takes the flags before a case and puts them back after it, and records what each case ran with.

**The sampled-vs-scored gap.** The trainer's own ``HFEngine`` samples (HF ``generate`` or the captured
static loop) and ``shares_trainer_weights``: ``homerlhf/ppo/collect.py:build_experience`` then takes the
trainer's old log-probs as the behaviour ones (``behaviour = logprobs``), so ``is_weight_mean`` is 1 by
construction and the gap never shows. The check keeps what the sampler itself recorded (its
``BehaviourLogprobs``, the batch's ``behaviour_logprobs``) in an engine of its own (the same engine,
recording; training is unchanged) and compares it with the experience's old log-probs, token by token
on the response mask, when the trainer records the iteration: max and mean absolute difference.
"""

from __future__ import annotations

from typing import Any, Optional


class SampledLogprobs:
    """The behaviour log-probs (and ids, mask) of every batch the engine returned this iteration, and
    each iteration's gap against the trainer's old log-probs."""

    def __init__(self):
        self.batches: list[tuple] = []
        self.iterations: list[dict[str, Any]] = []

    def keep(self, batch) -> None:
        if batch.behaviour_logprobs is not None:  # a device copy: no host sync inside the timed generation
            self.batches.append((batch.response_ids.detach().clone(), batch.response_mask.detach().clone(),
                                 batch.behaviour_logprobs.detach().clone()))

    def compare(self, exp) -> dict[str, Any]:
        """The gap of this iteration's kept batches (in the order sampled: the experience's rows)
        against ``exp.old_logprobs``; raises when the experience holds other tokens."""
        import torch

        batches, self.batches = self.batches, []
        if not batches:
            gap = {"tokens": 0, "max_abs": None, "mean_abs": None, "note": "the sampler recorded no log-probs"}
            self.iterations.append(gap)
            return gap
        width = exp.response_ids.shape[1]

        def cat(i: int, pad) -> torch.Tensor:
            return torch.cat([torch.nn.functional.pad(b[i].to(exp.old_logprobs.device), (0, width - b[i].shape[1]),
                                                      value=pad) for b in batches])

        ids, mask, sampled = cat(0, 0), cat(1, 0).bool(), cat(2, 0.0).float()
        on = mask & exp.response_mask.bool()
        if ids.shape != exp.response_ids.shape or not torch.equal(ids[on], exp.response_ids[on]):
            raise AssertionError("the experience does not hold the sampled tokens: the gap cannot be compared")
        diff = (exp.old_logprobs.float() - sampled).abs()[on]
        gap = {"tokens": int(on.sum()), "max_abs": float(diff.max()), "mean_abs": float(diff.mean())}
        self.iterations.append(gap)
        return gap

    def summary(self) -> Optional[dict[str, Any]]:
        """The last iteration's gap (the compared one), with every iteration's."""
        if not self.iterations:
            return None
        return {**self.iterations[-1], "per_iteration": list(self.iterations)}


def recording_trainer(cfg, policy, reference, reward, prompts, run_dir):
    """A ``RLTrainer`` whose engine (the actor's own, as a run's) keeps the sampled behaviour
    log-probs, and which compares them with its old log-probs as it records each iteration
    (``trainer.sampled``: :class:`SampledLogprobs`). Training is the plain trainer's."""
    from homerlhf.ppo.backends import Backends
    from homerlhf.ppo.engines import HFEngine
    from homerlhf.ppo.trainer import RLTrainer

    sampled = SampledLogprobs()

    class RecordingEngine(HFEngine):
        def generate(self, prompts, rollout, seeds=None):
            batch = super().generate(prompts, rollout, seeds)
            sampled.keep(batch)
            return batch

    class RecordingTrainer(RLTrainer):
        def record(self, row, exp) -> None:
            sampled.compare(exp)
            super().record(row, exp)

    trainer = RecordingTrainer(cfg, policy, Backends(reference, reward, RecordingEngine(policy)), prompts, run_dir)
    trainer.sampled = sampled
    return trainer


# -- precision and attention kernels --------------------------------------------------------------
def current_flags() -> dict:
    """The process's precision / kernel flags before a case (``cuda_kernels.current_flags``)."""
    from homerlhf.models import cuda_kernels

    return cuda_kernels.current_flags()


def restore_flags(flags: dict) -> None:
    """Back to ``flags`` after a case: a bf16 case's TF32 does not leak into an upcast one."""
    from homerlhf.models import cuda_kernels

    cuda_kernels.restore(flags)


def kernel_settings(policy=None, cfg=None, device: str = "cpu") -> Optional[dict]:
    """The kernel settings a case ran with (TF32, the SDPA backends allowed, why): the policy's
    (``policy.kernel_settings``, what ``PolicyModel.from_config`` set), else (the CLI case's subprocess)
    what ``cuda_kernels.policy_kernels`` chooses for its config on ``device``."""
    import torch

    from homerlhf.memory.components import compute_name
    from homerlhf.models import cuda_kernels

    settings = getattr(policy, "kernel_settings", None) if policy is not None else None
    if settings is None and cfg is not None:
        compute = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[compute_name(cfg)]
        upcast = bool(cfg.quant.load_in_4bit and cfg.quant.upcast_non_quantized)
        settings = cuda_kernels.policy_kernels(compute, upcast, device, cuda_kernels.device_capability(device))
    return settings.as_dict() if settings is not None else None


def checkpointing_of(policy) -> dict:
    """Which decoder layers recomputed in backward and which of them had their inputs offloaded
    (:func:`homerlhf.models.activations.checkpointing_report`), per model: ``policy`` (the shared base)
    and, with ``critic.model``, ``critic`` (its own base)."""
    from homerlhf.models.activations import checkpointing_report

    models = {"policy": policy.model.get_base_model()}
    if policy.critic_model is not None:
        models["critic"] = policy.critic_model.backbone
    return {name: checkpointing_report(model) for name, model in models.items()}
