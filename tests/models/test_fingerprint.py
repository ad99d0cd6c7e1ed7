"""Base fingerprints: equal for the same files, different for other weights or another shape."""

from __future__ import annotations

import shutil

import pytest

from homerlhf.errors import UserError
from homerlhf.models.fingerprint import base_fingerprint, difference


def test_the_same_base_copied_elsewhere_has_the_same_fingerprint(tiny_llama_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, copy)
    assert base_fingerprint(copy) == base_fingerprint(tiny_llama_dir)
    assert difference(base_fingerprint(copy), base_fingerprint(tiny_llama_dir)) is None


def test_one_changed_matrix_or_another_shape_changes_it(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from homerlhf.tiny import build_causal_lm

    before = base_fingerprint(tiny_llama_dir)
    # One attention projection nudged, as a merged LoRA would: only its bytes change.
    tuned = tmp_path / "tuned"
    shutil.copytree(tiny_llama_dir, tuned)
    weights = load_file(tuned / "model.safetensors")
    name = next(k for k in sorted(weights) if k.endswith("layers.1.self_attn.v_proj.weight"))
    weights[name] = weights[name] + 1e-3
    save_file(weights, tuned / "model.safetensors", metadata={"format": "pt"})
    after = base_fingerprint(tuned)
    assert {k for k in before if before[k] != after[k]} == {"weights"}

    wider = build_causal_lm(tmp_path / "wider", arch="llama", seed=0, hidden=192)
    assert difference(before, base_fingerprint(wider)).startswith("hidden_size 128 vs 192")


def test_a_dir_without_weights_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="holds no weight files"):
        base_fingerprint(tmp_path)
    with pytest.raises(UserError, match="has no config.json"):
        base_fingerprint(tmp_path / "nothing")
