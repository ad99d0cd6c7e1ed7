"""The Export tab's checkpoint list, dtype choice and refusals without a browser (the export itself:
tests/stages/test_export.py, and through the browser: tests/app/test_browser.py)."""

from __future__ import annotations

import re

import pytest

from homerlhf.app import eval_tab, export_tab
from homerlhf.config import load_config, to_yaml
from homerlhf.errors import UserError
from homerlhf.ppo.manifest import write_manifest


def _run(tmp_path):
    for iteration in (1, 2):
        ckpt = tmp_path / "checkpoints" / f"iter_{iteration:06d}"
        (ckpt / "actor").mkdir(parents=True)
        (ckpt / "actor" / "adapter_model.safetensors").write_bytes(b"stand-in weights " * 8)
        (ckpt / "config.yaml").write_text("seed: 0\n")
        write_manifest(ckpt, iteration)
    return tmp_path


def test_the_list_names_checkpoints_as_evaluate_does_and_marks_a_changed_one(tmp_path):
    run = str(_run(tmp_path))
    choices = export_tab.checkpoint_choices(run)
    assert choices == [("iter_000002", "2"), ("iter_000001", "1"), ("best (the highest mean score)", "best")]
    assert [label for label, _ in choices[:-1]] == [label for label, _ in eval_tab.checkpoint_choices(run)]
    assert export_tab.default_checkpoint(choices) == "2"
    (tmp_path / "checkpoints" / "iter_000002" / "config.yaml").write_text("seed: 1\n")  # same size, changed
    why = "(not usable: config.yaml does not match its MANIFEST.json sha256 (changed after it was written))"
    choices = export_tab.checkpoint_choices(run)
    assert choices[:2] == [(f"iter_000002 {why}", "2"), ("iter_000001", "1")]
    assert [label for label, _ in choices[:-1]] == [label for label, _ in eval_tab.checkpoint_choices(run)]
    assert export_tab.default_checkpoint(choices) == "1"  # the newest usable one, as Evaluate selects
    assert export_tab.checkpoint_choices("") == []


def test_the_dtype_defaults_to_the_one_the_policy_computed_in(tmp_path):
    assert export_tab.dtype_choices("") == [("as the policy computed", "auto"), ("fp32", "fp32"), ("bf16", "bf16"),
                                            ("fp16", "fp16")]
    (tmp_path / "config.yaml").write_text(to_yaml(load_config("cpu-tiny")))  # a CPU run: fp32
    assert export_tab.dtype_choices(str(tmp_path))[0] == ("as the policy computed (fp32)", "auto")
    (tmp_path / "config.yaml").write_text(to_yaml(load_config("cpu-tiny", None, ["quant.compute_dtype=bf16"])))
    assert export_tab.compute_flag(str(tmp_path)) == "bf16"
    feedback_run = tmp_path / "dpo-1" / "checkpoints" / "iter_000002"  # a DPO / KTO run: a config per checkpoint
    feedback_run.mkdir(parents=True)
    (feedback_run / "config.yaml").write_text(to_yaml(load_config("cpu-tiny")))
    assert export_tab.compute_flag(str(tmp_path / "dpo-1")) == "fp32"


def _refusal(run, out, **options) -> str:
    args = {"checkpoint": "2", "base": "nf4", "types": [], "overwrite": False, "hub_repo": "", "private": False,
            "dtype": "auto", **options}
    with pytest.raises(UserError) as caught:
        export_tab.on_export(run_dir=str(run), out=str(out), **args)
    message = str(caught.value)
    assert not re.search(r"--[a-z]", message), message  # no CLI flag: the tab's own fields
    return message


def test_refusals_name_the_tabs_fields_not_the_cli_flags(tmp_path):
    run = _run(tmp_path / "run")
    full = tmp_path / "out"
    full.mkdir()
    (full / "kept.txt").write_text("x")
    assert _refusal(run, full).endswith("already exists and is not empty; tick 'Overwrite' to replace it, or "
                                        "choose another 'Output directory'")
    free = tmp_path / "free"
    assert _refusal(run, free, private=True) == "'Private' makes sense only with 'Upload to repo' filled"
    assert _refusal(run, free, dtype="fp8").startswith("'Save in' 'fp8' is not known; use fp32, bf16 or fp16")
    assert _refusal(run, free, base="fp4").startswith("'Merge into' 'fp4' is not known")
    assert _refusal(run, free, types=["q3_x"]).startswith("'GGUF types' 'q3_x' is not a type homerlhf exports")
    assert _refusal(run, free, checkpoint="7").endswith("has no complete checkpoint of that iteration; it has 1, 2 "
                                                        "(or pick best)")
    assert _refusal(run, free, checkpoint="best").endswith("has no score_mean for any kept checkpoint; pick a "
                                                           "checkpoint of the list")
    assert _refusal(tmp_path / "nowhere", free).endswith("no such run directory; give the directory of a run "
                                                         "(the Train tab's, or one `homerlhf train` wrote)")


def test_a_rounding_note_names_the_field():
    note = ("saved in bfloat16, not the float32 the policy computed in: the rounding costs up to 1.00e-02 nats/token "
            "(mean 1.00e-03) on 8 held tokens; --dtype fp32 exports the policy as it computed")
    assert export_tab.app_words(note).endswith("; 'Save in' fp32 exports the policy as it computed")
