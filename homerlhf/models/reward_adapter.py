"""A reward model's LoRA riding on the policy's shared 4-bit base: ``reward.backend: adapter``.

``homerlhf reward`` with ``rm.method`` qlora or lora saves ``OUT/adapter``: a ``SEQ_CLS`` peft adapter
whose weights are the LoRA matrices and the trained score head (peft's ``modules_to_save``). Its
LoRA is loaded into the policy's ``PeftModel`` as one more adapter (:data:`REWARD`), next to
``actor`` and ``critic``; its score head becomes a small fp32 ``Linear(hidden, 1)``. No weight of
the base is copied: the reward costs the adapter, the head and a forward's activations
(:class:`RewardAdapter` scores). The adapter only means something on the weights it was trained on:
:func:`check_same_base` compares the reward model's base with the policy's (shape and a weights
fingerprint, :mod:`homerlhf.models.fingerprint`) before any weight is loaded.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import Tensor, nn

from homerlhf.errors import UserError
from homerlhf.models.fingerprint import base_fingerprint, difference
from homerlhf.models.scores import padded_batches, pooled_hidden

REWARD = "reward"
# The reward model's backend choices other than this one, named in every refusal.
OTHER_BACKENDS = "or use reward.backend=llamacpp or hf (the reward model on a base of its own)"


def reward_adapter_dir(path: str | Path) -> Path:
    """The peft adapter of a reward model: ``path/adapter`` of a reward run dir, or ``path`` itself."""
    path = Path(path)
    for candidate in (path / "adapter", path):
        if (candidate / "adapter_config.json").is_file():
            return candidate
    raise UserError(f"reward model {path} has no LoRA adapter (adapter/adapter_config.json): reward.backend=adapter "
                    f"needs one trained with rm.method=qlora or lora; train it so, {OTHER_BACKENDS}")


def _recorded_base(adapter_dir: Path) -> tuple[str, dict]:
    """(base name, fingerprint) of the base the adapter was trained on: as ``homerlhf reward``
    recorded it in ``reward_run.json``, else computed from the adapter config's base path."""
    run_file = adapter_dir.parent / "reward_run.json"
    if run_file.is_file():
        run = json.loads(run_file.read_text())
        if run.get("base_fingerprint"):
            return str(run.get("base_path") or run.get("base_model")), run["base_fingerprint"]
    base = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base or not Path(base).expanduser().is_dir():
        raise UserError(f"cannot tell which base reward model {adapter_dir} was trained on: its base {base!r} is not "
                        f"a local model dir and no reward_run.json records it; train it again with `homerlhf reward`, "
                        f"{OTHER_BACKENDS}")
    return base, base_fingerprint(Path(base).expanduser())


def check_same_base(reward_model: str | Path, policy_dir: str | Path) -> Path:
    """The reward adapter's dir, after checking it was trained on the policy's base (a local dir).

    Reads config files, the safetensors headers and a few bytes per tensor; loads no weights.
    """
    adapter_dir = reward_adapter_dir(reward_model)
    rm_base, rm_print = _recorded_base(adapter_dir)
    policy_print = base_fingerprint(policy_dir)
    differs = difference(rm_print, policy_print)
    if differs:
        raise UserError(
            f"reward model {reward_model} was trained on base {rm_base}, not on the policy's base {policy_dir} "
            f"({differs}): reward.backend=adapter needs a reward model "
            f"trained on the policy's own base (`homerlhf reward --model {policy_dir}`), {OTHER_BACKENDS}")
    return adapter_dir


def _is_head_key(key: str) -> bool:
    parts = key.split(".")
    return len(parts) >= 2 and parts[-2] == "score" and parts[-1] in ("weight", "bias") and "lora_" not in key


def read_score_head(adapter_dir: Path) -> dict[str, Tensor]:
    """``{"weight": (1, H), "bias"?: (1,)}`` of the score head saved with the adapter."""
    from peft.utils import load_peft_weights

    head = {key.rsplit(".", 1)[-1]: value for key, value in load_peft_weights(str(adapter_dir), device="cpu").items()
            if _is_head_key(key)}
    if "weight" not in head or head["weight"].shape[0] != 1:
        raise UserError(f"reward adapter {adapter_dir} holds no score head of one label (score.weight); train the "
                        f"reward model with `homerlhf reward`, {OTHER_BACKENDS}")
    return head


class RewardAdapter:
    """A reward model's LoRA + score head on a ``PeftModel``'s base, scoring token sequences.

    ``peft_model``: the policy's (``PolicyModel.model``) or any peft model on the same base.
    ``pad_id`` pads batches of ``batch_size`` sequences (right-padded; the score is read at the
    last real token). :meth:`unload` takes the adapter out again.

    A score is the head on the backbone's final hidden state at the last real token
    (:func:`homerlhf.models.scores.pooled_hidden`) of prompt + response as PPO makes it
    (:func:`homerlhf.data.replies.reward_sequence_ids`), with only the reward adapter active, no grad,
    every module in eval mode. Afterwards the active adapter, every ``requires_grad`` and every
    module's mode are as they were.
    """

    def __init__(self, peft_model, adapter_dir: str | Path, pad_id: int, batch_size: int = 8, name: str = REWARD):
        adapter_dir = Path(adapter_dir)
        if name in peft_model.peft_config:
            raise ValueError(f"the model already has an adapter named {name!r}")
        head = read_score_head(adapter_dir)
        result = peft_model.load_adapter(str(adapter_dir), adapter_name=name, is_trainable=False)
        stray = [k for k in result.unexpected_keys if not _is_head_key(k)]
        missing = [k for k in result.missing_keys if f".{name}." in k or k.endswith(f".{name}")]
        if stray or missing:
            peft_model.delete_adapter(name)
            raise UserError(f"reward adapter {adapter_dir} does not fit the policy's modules ({(stray + missing)[0]}); "
                            f"train it on the policy's base, {OTHER_BACKENDS}")
        self.peft_model, self.name, self.pad_id, self.batch_size = peft_model, name, pad_id, batch_size
        inner = peft_model.get_base_model()
        self.backbone = getattr(inner, inner.base_model_prefix)
        self.device = next(p for n, p in peft_model.named_parameters() if f".{name}." in n).device
        weight = head["weight"]
        self.head = nn.Linear(weight.shape[1], 1, bias="bias" in head, dtype=torch.float32, device=self.device)
        self.head.load_state_dict({k: v.float() for k, v in head.items()})
        self.head.requires_grad_(False)

    @contextmanager
    def _active(self) -> Iterator[None]:
        """Only the reward adapter on, all modules in eval mode; everything restored afterwards."""
        model = self.peft_model
        previous = model.active_adapter
        grads = [(p, p.requires_grad) for p in model.parameters()]
        modes = [(m, m.training) for m in model.modules()]
        model.eval()
        model.set_adapter(self.name, inference_mode=True)
        try:
            yield
        finally:
            model.set_adapter(previous)
            for param, flag in grads:
                param.requires_grad_(flag)
            for module, mode in modes:
                module.training = mode

    @torch.no_grad()
    def scores(self, sequences: Sequence[Sequence[int]]) -> Tensor:
        """Scores (n,) float32 on the CPU of unpadded token sequences (prompt + response each)."""
        out = []
        with self._active():
            for ids, mask in padded_batches(sequences, self.pad_id, self.batch_size, self.device):
                pooled = pooled_hidden(self.backbone, ids, mask)  # (b, H)
                out.append(self.head(pooled.to(self.head.weight.dtype)).squeeze(-1).cpu())
        return torch.cat(out) if out else torch.zeros(0)

    def unload(self) -> None:
        """Remove the adapter from the model (safe to call twice)."""
        if self.name in self.peft_model.peft_config:
            self.peft_model.delete_adapter(self.name)
