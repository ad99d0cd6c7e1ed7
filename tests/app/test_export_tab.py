"""The Export tab's checkpoint list without a browser (the export itself: tests/stages/test_export.py,
and through the browser: tests/app/test_browser.py)."""

from __future__ import annotations

from homerlhf.app import export_tab
from homerlhf.ppo.manifest import write_manifest


def test_the_list_marks_a_checkpoint_whose_actor_changed_and_says_why(tmp_path):
    for iteration in (1, 2):
        ckpt = tmp_path / "checkpoints" / f"iter_{iteration:06d}"
        (ckpt / "actor").mkdir(parents=True)
        (ckpt / "actor" / "adapter_model.safetensors").write_bytes(b"stand-in weights " * 8)
        (ckpt / "config.yaml").write_text("seed: 0\n")
        write_manifest(ckpt, iteration)
    assert export_tab.checkpoint_choices(str(tmp_path)) == [("last", "last"), ("best", "best"), ("2", "2"), ("1", "1")]
    (tmp_path / "checkpoints" / "iter_000002" / "config.yaml").write_text("seed: 1\n")  # same size, changed
    why = "(not usable: config.yaml does not match its MANIFEST.json sha256 (changed after it was written))"
    assert export_tab.checkpoint_choices(str(tmp_path)) == [
        (f"last {why}", "last"), ("best", "best"), (f"2 {why}", "2"), ("1", "1")]
    assert export_tab.checkpoint_choices("") == []
