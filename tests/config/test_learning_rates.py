"""``actor.lr: auto``: the rule by hand at its anchors and limits, and the config's own check of the value."""

from __future__ import annotations

import pytest

from homerlhf.config import load_config
from homerlhf.config.learning_rates import auto_actor_lr, auto_lr_line
from homerlhf.errors import UserError


@pytest.mark.parametrize("params, lr", [
    (600_000_000, 5e-5),  # Qwen3-0.6B: TRL's LoRA GRPO example
    (3_000_000_000, 1e-5),  # SmolLM3-3B: TRL's LoRA GRPO table
    (1_000_000_000, 3e-5),  # on the line between them: 5e-5 x 0.6 / 1
    (1_500_000_000, 2e-5),
    (7_620_000_000, 1e-5),  # Qwen2.5-7B (the 4090 preset): held at the 3B figure
    (30_500_000_000, 1e-5),
    (268_000_000, 1e-4),  # Gemma-3-270M: 3e-5 / 0.268 = 1.12e-4, held at our measured 1e-4
    (300_000_000, 1e-4),  # exactly the upper limit
])
def test_the_rate_by_size_at_the_anchors_and_limits(params, lr):
    assert auto_actor_lr(params) == pytest.approx(lr, rel=1e-12)


def test_the_line_names_the_rate_the_size_and_the_evidence():
    assert auto_lr_line(268_098_176) == "actor.lr auto: 1.0e-04 for a 0.27B-parameter policy (docs/learning.md)"


@pytest.mark.parametrize("value", ["-1", "0", "fast", "inf", "nan"])
def test_a_bad_actor_lr_is_one_line_naming_both_choices(value):
    with pytest.raises(UserError, match=r"^invalid config: actor.lr must be a number > 0 or 'auto'; got "):
        load_config("4090", overrides=[f"actor.lr={value}"])


def test_the_gpu_presets_with_the_rules_lora_take_the_rate_for_their_model():
    """Every GPU preset whose actor LoRA has alpha 32 (the rule's figures) says auto; the others, and the CPU
    preset with the demo task's own rate, name a number."""
    from homerlhf.config.loader import preset_names

    autos = []
    for name in preset_names():
        cfg = load_config(name)
        expected = cfg.card.device == "cuda" and cfg.actor.lora.alpha == 32
        assert (cfg.actor.lr == "auto") == expected, name
        autos += [name] if expected else []
    assert len(autos) == 6 and "4090" in autos
