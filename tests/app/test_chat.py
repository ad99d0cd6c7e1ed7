"""The Evaluate tab's loading: the run's config and reward model, one-line errors for what is missing."""

from __future__ import annotations

import pytest
import torch

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


def test_a_checkpoint_switched_away_from_is_freed_before_the_next_loads(monkeypatch, tiny_llama_dir):
    """One checkpoint at a time: the one left is closed and its 4-bit layers freed (they are reference
    cycles) before the next loads, so a 24 GB card holds one policy, not two."""
    import gc
    import weakref

    from bitsandbytes.nn import Linear4bit
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    class Loaded:  # what EvalModels holds that matters here: a 4-bit policy and a close()
        def __init__(self, run_dir, checkpoint, right=None):
            quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
            self.model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=quant, device_map="cpu")
            self.closed = False

        def close(self):
            self.closed = True

    monkeypatch.setattr(chat, "load_models", Loaded)
    gc.disable()  # no collection but the cache's own
    try:
        first = chat.get_models("run", "iter_000001")
        layers = [weakref.ref(m) for m in first.model.modules() if isinstance(m, Linear4bit)]
        assert chat.get_models("run", "iter_000001") is first  # kept while in use
        del first
        second = chat.get_models("run", "iter_000002")
        alive = sum(ref() is not None for ref in layers)
        chat.unload_all()
    finally:
        gc.enable()
    assert layers and alive == 0 and second.closed
