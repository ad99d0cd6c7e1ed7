"""The planner: every GPU preset fits its card, JSON complete, CPU plans, the prediction logged at run
time (the pieces: test_components.py, test_phases.py; suggestions: test_search.py)."""

from __future__ import annotations

import json

import pytest

from homerlhf.config import load_config, preset_names
from homerlhf.memory.components import GIB
from homerlhf.memory.phases import PHASES
from homerlhf.memory.planner import compare, plan, predicted_peaks
from homerlhf.memory.shapes import BUILTIN_SHAPES, resolve_shape, shape_from_config

QWEN7 = BUILTIN_SHAPES["Qwen/Qwen2.5-7B"]
GPU_PRESETS = [p for p in preset_names() if load_config(p).card.device == "cuda"]


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_every_gpu_preset_fits_its_card(preset):
    cfg = load_config(preset)
    result = plan(cfg, resolve_shape(cfg.model.name_or_path))
    assert result.gpu_gib == cfg.card.gpu_gib > 0
    assert result.fits, result.verdict()
    assert result.suggestion is None


def test_json_is_complete_and_consistent():
    result = plan(load_config("3090"), QWEN7)
    data = json.loads(json.dumps(result.to_dict()))
    for key in ("model", "shape", "preset", "card", "gpu_gib", "settings", "params", "phases", "peak_phase",
                "peak_gib", "fits", "headroom_gib", "verdict", "suggestion", "assumptions", "notes"):
        assert key in data, key
    assert [p["name"] for p in data["phases"]] == list(PHASES)
    for phase in data["phases"]:
        total = sum(c["bytes"] for c in phase["components"])
        assert phase["total_gib"] == pytest.approx(total / GIB, abs=1e-3)
        allocated = sum(c["bytes"] for c in phase["components"] if c["in_allocator"])
        assert phase["allocated_gib"] == pytest.approx(allocated / GIB, abs=1e-3)
        assert {"KV cache", "LoRA actor", "base linear weights (NF4)"} & {c["name"] for c in phase["components"]}
    assert data["peak_gib"] == max(p["total_gib"] for p in data["phases"])
    assert data["params"]["total"] == QWEN7.total_params


def test_cpu_preset_has_no_verdict_and_compare_reports_error():
    cfg = load_config("cpu-tiny")
    result = plan(cfg, resolve_shape(cfg.model.name_or_path))
    assert result.fits is None and result.headroom_gib is None and "no GPU budget" in result.verdict()
    assert not any(c.kind == "overhead" for p in result.phases for c in p.components)
    predicted = result.phase("update").allocated_gib
    rows = compare(result, {"update": predicted * 2})
    assert rows["update"]["error"] == pytest.approx(-0.5, abs=1e-3)


def test_predicted_peaks_for_logging():
    """What the trainer logs: the plan's allocated GiB per phase, for the shape read off the loaded
    model's transformers config."""
    cfg = load_config("4090")
    peaks = predicted_peaks(cfg, shape_from_config(QWEN7.to_hf_config(), "loaded", "model"))
    assert set(peaks) == set(PHASES)
    assert peaks == {p.name: p.allocated_gib for p in plan(cfg, QWEN7).phases}


def test_predicted_peaks_of_an_unresolved_config_are_of_what_its_models_run():
    """A trainer built from a config whose checkpointing is still ``auto`` (outside ``homerlhf train``,
    which resolves it) runs every layer checkpointed, no offload (``TrainingConfig.every_n``): the peaks
    it logs beside the measured ones are that config's, not the plan's own choice for ``auto`` (for
    Qwen2.5-1.5B on the 4090's card: 1 of 28 layers, a larger update)."""
    cfg = load_config("4090", overrides=["training.checkpoint_every_n_layers=auto", "training.activation_offload=auto"])
    shape = resolve_shape("Qwen/Qwen2.5-1.5B")
    every_layer = load_config("4090", overrides=["training.checkpoint_every_n_layers=1",
                                                 "training.activation_offload=false"])
    assert predicted_peaks(cfg, shape) == {p.name: p.allocated_gib for p in plan(every_layer, shape).phases}
    chosen = plan(cfg, shape)  # the planner resolves auto to its own choice
    assert chosen.settings["training.checkpoint_every_n_layers"] == 28
    assert chosen.phase("update").allocated_gib > predicted_peaks(cfg, shape)["update"]


def test_fits_needs_ten_percent_of_the_card_free(preset_named):
    from homerlhf.memory.planner import MARGIN
    from homerlhf.memory.render import suggestion_line
    from homerlhf.memory.search import apply_overrides

    cfg, shape = preset_named(), resolve_shape("Qwen/Qwen2.5-7B")
    peak = plan(cfg, shape, 24).peak_gib
    assert MARGIN == 0.10
    # The margin is met exactly at card = peak / 0.9: a hair above fits, a hair below is tight.
    roomy = plan(cfg, shape, peak / 0.9 + 0.01)
    assert roomy.status == "fits" and roomy.fits is True and roomy.suggestion is None
    tight = plan(cfg, shape, peak / 0.9 - 0.01)
    assert tight.status == "tight" and tight.fits is False
    assert tight.verdict().startswith(f"tight on GPU ({peak / 0.9 - 0.01:g} GiB): peak {peak:.2f} GiB")
    assert "GiB headroom (9.9% of the card)" in tight.verdict()
    assert "within 5% of peaks measured on an H200, not on this card" in tight.verdict()
    assert "a fit needs 10% of the card free" in tight.verdict()
    # Its suggestion restores the margin, and the plan it gives fits.
    sug = tight.suggestion
    assert sug is not None and sug.peak_gib <= 0.9 * tight.gpu_gib
    assert plan(apply_overrides(cfg, sug.overrides), shape, tight.gpu_gib).status == "fits"
    assert suggestion_line(tight).startswith("suggestion that restores the margin (peak ")
    over = plan(cfg, shape, peak - 0.5)
    assert over.status == "over" and over.fits is False and "does NOT fit" in over.verdict()
    assert over.to_dict()["status"] == "over" and over.to_dict()["margin"] == 0.10
