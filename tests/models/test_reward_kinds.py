"""Where a reward model can run, from its files: what ``reward.backend: auto`` may choose among."""

from __future__ import annotations

import shutil

from homerlhf.models.reward_kinds import assumed_note, possible_reward_backends


def test_a_lora_reward_run_on_the_policys_base_can_run_anywhere(tiny_llama_dir, tiny_qwen2_dir, tiny_lora_rm_dir):
    # adapter/ (trained on tiny_llama_dir) and model/ (the merged classifier): all three.
    assert possible_reward_backends(str(tiny_lora_rm_dir), str(tiny_llama_dir)) == ["llamacpp", "adapter", "hf"]
    # The same run for another policy: its adapter means nothing on that base.
    assert possible_reward_backends(str(tiny_lora_rm_dir), str(tiny_qwen2_dir)) == ["llamacpp", "hf"]


def test_a_classifier_an_export_and_a_name_not_here(tiny_lora_rm_dir, tmp_path):
    classifier = tmp_path / "classifier"
    shutil.copytree(tiny_lora_rm_dir / "model", classifier)
    assert possible_reward_backends(str(classifier)) == ["llamacpp", "hf"]
    export = tmp_path / "export"
    export.mkdir()
    (export / "manifest.json").write_text("{}")  # what homerlhf.workers.gguf.export_reward writes, with the GGUF
    assert possible_reward_backends(str(export)) == ["llamacpp"]
    (tmp_path / "rm.gguf").write_bytes(b"GGUF")
    assert possible_reward_backends(str(tmp_path / "rm.gguf")) == ["llamacpp"]
    # A hub id or a run not trained yet: what `homerlhf reward` makes; a run's start looks again.
    assert possible_reward_backends("acme/some-reward-model") == ["llamacpp", "adapter", "hf"]
    # A builtin says what its build makes without being built: demo-rm is a full fine-tune, never an adapter.
    assert possible_reward_backends("builtin:demo-rm") == ["llamacpp", "hf"]
    assert assumed_note("builtin:demo-rm") == "" and assumed_note(str(classifier)) == ""
    assert assumed_note("acme/some-reward-model").startswith("the reward model acme/some-reward-model is not on this "
                                                             "machine yet: the placements count reward.backend=adapter")
    assert possible_reward_backends(None) == ["llamacpp"]  # reward.url: a worker elsewhere
