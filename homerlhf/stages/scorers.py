"""What a PPO run scores and samples with, built as configured: the reference backend, the reward
(one model, a function, or a weighted sum), the rollout engine, and the reward for scoring outside
a run (side-by-side answers). :mod:`homerlhf.stages.data_parallel` decides which process builds
them; :mod:`homerlhf.stages.ppo` runs the trainer with them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from homerlhf.config import RunConfig
from homerlhf.errors import UserError
from homerlhf.models.registry import resolve_model
from homerlhf.ppo.backends import ReferenceBackend, RewardBackend
from homerlhf.ppo.engines import HFEngine, RolloutEngine


def _check_same_vocab(policy_tokenizer, reward_path: str) -> None:
    """Ids go to the reward model as they are: its tokenizer must be the policy's."""
    from transformers import AutoTokenizer

    try:
        reward_tokenizer = AutoTokenizer.from_pretrained(reward_path)
    except (OSError, ValueError):
        return  # no tokenizer saved with the reward model: nothing to compare against
    if reward_tokenizer.get_vocab() != policy_tokenizer.get_vocab():
        raise UserError(
            f"reward model '{reward_path}' uses a different tokenizer than the policy; train the reward "
            "model from the policy's base (`homerlhf reward` with the same model)"
        )


def build_reference(cfg: RunConfig, policy, policy_model_path: str, run_dir: Path) -> ReferenceBackend:
    if cfg.ref.backend == "adapter_off":
        from homerlhf.ppo.backends import AdapterOffReference

        return AdapterOffReference(policy, batch_size=cfg.ppo.micro_batch_size)
    from homerlhf.workers.backends import llamacpp_reference

    return llamacpp_reference(cfg, policy_model_path, policy.tokenizer, run_dir, vocab_rows=policy.vocab_size)


def build_reward(cfg: RunConfig, tokenizer, run_dir: Optional[Path], policy=None) -> RewardBackend:
    """The run's reward: one reward model as it is; a function, or several rewards, weighted
    (:class:`homerlhf.ppo.reward_functions.WeightedReward`). ``tokenizer``: the policy's;
    ``policy``: the run's ``PolicyModel``, which ``reward.backend: adapter`` scores on."""
    if not uses_weighted_reward(cfg):
        return _model_reward(cfg, cfg.reward, tokenizer, run_dir, policy)
    from homerlhf.ppo.reward_functions import FunctionReward, WeightedReward, load_reward_function

    parts = []
    try:
        for key, rc in cfg.reward.all_rewards():
            if rc.backend == "function":
                backend = FunctionReward(load_reward_function(rc.function, f"{key}.function"), tokenizer)
            else:
                backend = _model_reward(cfg, rc, tokenizer, run_dir, policy)
            parts.append((rc.metric_name, rc.weight, backend))
    except BaseException:
        for _, _, backend in parts:
            backend.close()
        raise
    return WeightedReward(parts)


def uses_weighted_reward(cfg: RunConfig) -> bool:
    return cfg.reward.backend == "function" or bool(cfg.reward.components)


def _model_reward(cfg: RunConfig, rc, tokenizer, run_dir: Optional[Path], policy=None) -> RewardBackend:
    """A reward model (``rc``: ``cfg.reward`` or one of its components) on its backend."""
    if rc.backend == "adapter":
        return adapter_reward(cfg, rc, policy)
    cfg = cfg.model_copy(update={"reward": rc})  # the backends read cfg.reward
    if cfg.reward.backend == "hf":
        import torch

        from homerlhf.models.policy import compute_dtype
        from homerlhf.ppo.backends import HFReward

        if not cfg.reward.model:
            raise UserError("reward.backend 'hf' needs reward.model (a reward run dir, HF dir or hub id)")
        path = resolve_model(cfg.reward.model)
        device = "cuda" if cfg.card.device == "cuda" and torch.cuda.is_available() else "cpu"
        reward = HFReward(path, device=device, dtype=compute_dtype(cfg.quant, device),
                          batch_size=cfg.ppo.micro_batch_size, trust_remote_code=cfg.model.trust_remote_code)
        _check_same_vocab(tokenizer, reward.source_path)
        return reward
    from homerlhf.workers.backends import llamacpp_reward

    return llamacpp_reward(cfg, tokenizer, run_dir)


def adapter_reward(cfg: RunConfig, rc, policy) -> RewardBackend:
    """``rc`` (``backend: adapter``) as a third adapter on ``policy``'s base, once its base is checked
    to be the policy's. Several such rewards get one adapter each (``reward``, ``reward_<name>``)."""
    from homerlhf.models.registry import resolve_model_dir
    from homerlhf.models.reward_adapter import REWARD, RewardAdapter, check_same_base
    from homerlhf.ppo.backends import AdapterReward

    if policy is None:
        raise UserError("reward.backend 'adapter' scores on the policy's base, which only a PPO run loads; "
                        "use reward.backend=llamacpp or hf here")
    adapter_dir = check_same_base(resolve_model(rc.model), resolve_model_dir(cfg.model.name_or_path))
    _check_same_vocab(policy.tokenizer, str(adapter_dir))
    name = REWARD if rc.metric_name == "rm" else f"{REWARD}_{rc.metric_name}"
    return AdapterReward(RewardAdapter(policy.model, adapter_dir, policy.tokenizer.pad_token_id,
                                       batch_size=cfg.ppo.micro_batch_size, name=name))


def build_engine(cfg: RunConfig, policy, policy_model_path: str, run_dir: Path) -> RolloutEngine:
    """The configured rollout engine (``rollout.engine``): the actor's own generate, or llama.cpp
    on the KL-consistent export with the actor's LoRA swapped in before every rollout."""
    if cfg.rollout.engine == "auto":  # never taken as llamacpp by default: a run's start chooses
        raise ValueError("rollout.engine 'auto' is chosen when a run starts; resolve it first "
                         "(homerlhf.stages.autoplan.resolve_auto)")
    if cfg.rollout.engine == "hf":
        return HFEngine(policy)
    from homerlhf.workers.rollout_engine import llamacpp_engine

    return llamacpp_engine(cfg, policy, policy_model_path, run_dir)


def scoring_reward(cfg: RunConfig, tokenizer) -> RewardBackend:
    """The configured reward model for scoring outside a PPO run (side-by-side answers): in process
    for ``hf`` (and for ``adapter``: its run's merged ``model/``, on a full-precision base); else ``reward.url``, or a llama.cpp worker of its own on the exported model. Reward
    functions see no dataset row here (``row`` is ``{}``)."""
    if uses_weighted_reward(cfg):
        return build_reward(cfg, tokenizer, run_dir=None)
    if cfg.reward.backend in ("hf", "adapter"):  # adapter: its merged model/, on a base of its own
        from homerlhf.ppo.backends import HFReward

        return HFReward(resolve_model(cfg.reward.model), trust_remote_code=cfg.model.trust_remote_code)
    from homerlhf.workers.backends import llamacpp_reward

    return llamacpp_reward(cfg, tokenizer, run_dir=None)
