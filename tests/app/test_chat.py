"""The Evaluate tab's loading: the run's config and reward model, one-line errors for what is missing."""

from __future__ import annotations

import pytest

from homerlhf.app import chat


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory with a resolved config (an HF reward model) and no checkpoint."""
    from homerlhf.config import load_config, to_yaml
    from homerlhf.tiny import build_sequence_classifier

    root = tmp_path_factory.mktemp("eval-run")
    rm_dir = build_sequence_classifier(root / "rm", arch="llama", seed=3)
    cfg = load_config("cpu-tiny", None, [
        "model.name_or_path=builtin:tiny-llama", "ref.backend=adapter_off",
        "reward.backend=hf", f"reward.model={rm_dir}",
    ])
    (root / "config.yaml").write_text(to_yaml(cfg))
    return root


def test_the_reward_model_is_the_runs(run_dir):
    from homerlhf.app import runs
    from homerlhf.ppo.backends import HFReward

    cfg = runs.run_config(run_dir)
    reward = chat.reward_backend(cfg, run_dir, tokenizer=None)
    assert isinstance(reward, HFReward) and reward.source_path == str(run_dir / "rm")
    reward.close()


def test_missing_checkpoint_or_config_is_a_user_error(run_dir, tmp_path):
    from homerlhf.errors import UserError

    with pytest.raises(UserError, match="no 'actor' adapter"):
        chat.load_models(run_dir, run_dir / "checkpoints" / "iter_999999")
    with pytest.raises(UserError, match="no run config"):
        chat.load_models(tmp_path, tmp_path)


def test_a_weighted_reward_is_rebuilt_whole_not_one_worker(run_dir):
    from transformers import AutoTokenizer

    from homerlhf.config import load_config
    from homerlhf.ppo.backends import HFReward
    from homerlhf.ppo.reward_functions import FunctionReward, WeightedReward

    cfg = load_config("cpu-tiny", None, [
        "reward.backend=function", "reward.function=builtin:reverse",
        f"reward.components=[{{backend: hf, model: '{run_dir / 'rm'}', weight: 0.5}}]"])
    reward = chat.reward_backend(cfg, run_dir, tokenizer=AutoTokenizer.from_pretrained(run_dir / "rm"))
    assert isinstance(reward, WeightedReward)
    assert [(name, weight, type(part)) for name, weight, part in reward.parts] == [
        ("reverse", 1.0, FunctionReward), ("rm", 0.5, HFReward)]
    reward.close()
