"""run_ppo end to end on CPU: NF4 tiny policy, adapter-off reference, in-process HF reward."""

from __future__ import annotations

import json

import pytest

from homerlhf.config import from_yaml_file, load_config
from homerlhf.errors import UserError
from homerlhf.ppo.metrics import METRIC_DESCRIPTIONS, read_metrics
from homerlhf.stages.ppo import run_ppo


@pytest.fixture(scope="module")
def tiny_rm_dir(tmp_path_factory):
    from homerlhf.tiny import build_sequence_classifier

    return build_sequence_classifier(tmp_path_factory.mktemp("tiny-rm"), arch="llama", seed=3)


def _cfg(policy_dir, rm_dir, *extra):
    return load_config("cpu-tiny", overrides=[
        f"model.name_or_path={policy_dir}", "ref.backend=adapter_off", "reward.backend=hf",
        f"reward.model={rm_dir}", "rollout.batch_size=4", "rollout.chunk_size=2", "rollout.max_new_tokens=4",
        "rollout.max_prompt_len=24", "ppo.mini_batch_size=4", "ppo.micro_batch_size=2", "ppo.epochs=1",
        "ppo.iterations=2", "checkpoint.every=1", "checkpoint.keep=1", "logging.samples_per_iteration=2",
        "logging.progress=false", "data.prompts=builtin:demo",
        "rollout.truncation_penalty=null",  # the preset's -5 would score every 4-token reply alike
        *extra])


def test_run_ppo_writes_metrics_samples_config_and_checkpoint(tiny_llama_dir, tiny_rm_dir, tmp_path):
    run_dir = tmp_path / "run"
    result = run_ppo(_cfg(tiny_llama_dir, tiny_rm_dir), out_dir=run_dir)

    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows] == [1, 2]
    for row in rows:
        assert set(row) <= set(METRIC_DESCRIPTIONS)
        for key in ("score_mean", "kl_mean", "policy_loss", "value_loss", "tokens_per_s_generation",
                    "peak_mem_generation_gib", "peak_mem_update_gib"):
            assert isinstance(row[key], float), key
        assert row["peak_mem_kind"] == "cpu_rss"
        assert 1 <= row["response_length_mean"] <= 4
    # The first iteration's KL is exactly 0: the actor starts as the base (LoRA B = 0).
    assert rows[0]["kl_mean"] == pytest.approx(0.0, abs=1e-6)

    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    # Per iteration: the first 2, the best 2 and the worst 2 (logging.samples_top_bottom's default).
    assert [(s["iteration"], s["rank"]) for s in samples] == [(i, r) for i in (1, 2) for r in ["first"] * 2 + ["top"] * 2
                                                              + ["bottom"] * 2]
    assert all(isinstance(s["response"], str) and isinstance(s["score"], float) for s in samples)
    for i in (1, 2):
        top, bottom = ([s["score"] for s in samples if (s["iteration"], s["rank"]) == (i, r)] for r in ("top", "bottom"))
        assert top == sorted(top, reverse=True) and bottom == sorted(bottom) and min(top) >= max(bottom)

    saved = from_yaml_file(run_dir / "config.yaml")
    assert saved.output_dir == str(run_dir) and saved.reward.backend == "hf"

    ckpt = result["checkpoint"]
    assert ckpt == run_dir / "checkpoints" / "iter_000002"
    assert (ckpt / "actor" / "adapter_model.safetensors").is_file()
    assert (ckpt / "critic" / "adapter_model.safetensors").is_file()
    assert (ckpt / "value_head.safetensors").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["iter_000002"]

    with pytest.raises(UserError, match="already holds a run"):
        run_ppo(_cfg(tiny_llama_dir, tiny_rm_dir), out_dir=run_dir)


def test_refuses_a_reward_model_with_another_tokenizer(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    from homerlhf.tiny import build_sequence_classifier

    rm = build_sequence_classifier(tmp_path / "rm", arch="llama", seed=0, hidden=32, layers=1)
    tok = AutoTokenizer.from_pretrained(rm)
    tok.add_tokens(["<|extra|>"])
    tok.save_pretrained(rm)
    with pytest.raises(UserError, match="different tokenizer"):
        run_ppo(_cfg(tiny_llama_dir, rm), out_dir=tmp_path / "run")


def test_cli_train_resume_of_a_missing_run_is_a_one_line_error(capsys):
    from homerlhf.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--resume", "runs/none"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no such run directory" in err


def test_a_bad_model_path_leaves_no_run_behind(tiny_rm_dir, tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(UserError, match="does not exist"):
        run_ppo(_cfg(tmp_path / "no-such-model", tiny_rm_dir), out_dir=run_dir)
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "metrics.jsonl").exists()


def test_a_cpu_trainer_runs_on_its_share_of_the_cores_and_restores_torchs(monkeypatch):
    import torch

    from homerlhf.memory import threads
    from homerlhf.stages.ppo import trainer_threads

    monkeypatch.setattr(threads, "physical_cores", lambda: 7)
    before = torch.get_num_threads()
    with trainer_threads(load_config("cpu-tiny", None, [])) as share:
        assert share == 3 and torch.get_num_threads() == 3  # 7 cores: workers 2 + 2, trainer 3
    assert torch.get_num_threads() == before
    with trainer_threads(load_config("cpu-tiny", None, ["card.device=cuda"])) as share:
        assert share == 0 and torch.get_num_threads() == before  # a GPU trainer's torch is left alone


REWARDS_PY = '''
import json
import pathlib

LOG = pathlib.Path(__file__).with_name("seen.jsonl")
CALLS = [0]


def exact(prompt, response, row):
    with LOG.open("a") as fh:
        fh.write(json.dumps({"prompt": prompt, "row": row}) + "\\n")
    return 1.0 if response.strip() == row["answer"] else 0.0


def length(response_ids):
    CALLS[0] += 1
    if CALLS[0] > 4:  # the first sample of iteration 2 (4 samples per iteration)
        raise ZeroDivisionError("boom")
    return len(response_ids) / 10
'''


def test_function_rewards_see_the_rows_combine_and_a_raise_stops_after_a_checkpoint(tiny_llama_dir, tmp_path):
    """Two functions from the user's file, weighted; the rows' ``answer`` reaches them; the second
    raises in iteration 2: the run stops with one line naming it and the sample, iteration 1 saved."""
    from homerlhf.ppo.reward_functions import RewardFunctionError

    (tmp_path / "rewards.py").write_text(REWARDS_PY)
    data = tmp_path / "problems.jsonl"
    rows = [{"prompt": f"What is {a} + {a + 1}?", "answer": str(2 * a + 1), "level": a % 3} for a in range(6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _cfg(tiny_llama_dir, "unused", "reward.backend=function", f"reward.function={tmp_path}/rewards.py:exact",
               f"data.prompts={data}", "ppo.iterations=3", "checkpoint.every=100",
               f"reward.components=[{{backend: function, function: '{tmp_path}/rewards.py:length', weight: 0.5}}]")
    run_dir = tmp_path / "run"
    with pytest.raises(RewardFunctionError) as info:
        run_ppo(cfg, out_dir=run_dir)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("reward function rewards.py:length raised ZeroDivisionError: boom on the sample with prompt ")
    assert message.endswith(f"stopped after iteration 1, checkpoint {run_dir}/checkpoints/iter_000001 "
                            f"(fix it, then --resume {run_dir})")
    assert (run_dir / "checkpoints" / "iter_000001" / "actor" / "adapter_model.safetensors").is_file()

    (row,) = read_metrics(run_dir)
    assert row["iteration"] == 1 and row["reward_exact_none"] == 0.0 and row["reward_length_none"] == 0.0
    assert 0.1 <= row["reward_length"] <= 0.4  # 1..4 response tokens, / 10
    assert row["score_mean"] == pytest.approx(1.0 * row["reward_exact"] + 0.5 * row["reward_length"], abs=1e-6)
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert len(seen) == 4 + 4  # iteration 1, and both chunks of iteration 2 (exact runs before length)
    for sample in seen:
        assert sample["row"] in rows  # every column of the dataset row, as it was
        assert sample["row"]["prompt"] in sample["prompt"]  # the row belongs to the prompt it came with


def test_a_ppo_run_scores_with_the_reward_adapter_on_the_policys_base(tiny_llama_dir, tiny_lora_rm_dir, tmp_path):
    """reward.backend=adapter: the LoRA reward model rides on the policy's NF4 base for two
    iterations; its adapter is neither trained nor checkpointed, and is gone after the run."""
    import torch

    from homerlhf.ppo.backends import AdapterReward
    from homerlhf.stages import scorers as stage

    built = []
    build = stage.build_reward

    def spy(cfg, tokenizer, run_dir, policy=None):
        built.append((build(cfg, tokenizer, run_dir, policy), policy))
        return built[-1][0]

    run_dir = tmp_path / "run"
    stage.build_reward, saved = spy, stage.build_reward
    try:
        run_ppo(_cfg(tiny_llama_dir, tiny_lora_rm_dir, "reward.backend=adapter"), out_dir=run_dir)
    finally:
        stage.build_reward = saved
    (reward, policy), = built
    assert isinstance(reward, AdapterReward)
    assert sorted(policy.model.peft_config) == ["actor", "critic"]  # unloaded when the run closed it

    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["score_mean"])) for r in rows)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len({s["score"] for s in samples}) > 1
    ckpt = run_dir / "checkpoints" / "iter_000002"
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["actor", "critic"]
    assert from_yaml_file(run_dir / "config.yaml").reward.backend == "adapter"


def test_cli_refuses_a_reward_adapter_from_another_base_in_one_line(tiny_lora_rm_dir, tmp_path, capsys):
    from homerlhf.cli import main
    from homerlhf.tiny import build_causal_lm

    other = build_causal_lm(tmp_path / "other-base", arch="llama", seed=5)
    capsys.readouterr()  # the build's progress bars
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--preset", "cpu-tiny", "--set", f"model.name_or_path={other}", "--set", "ref.backend=adapter_off",
              "--set", "reward.backend=adapter", "--set", f"reward.model={tiny_lora_rm_dir}", "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert f"not on the policy's base {other}" in err and "reward.backend=adapter needs" in err
    assert not (tmp_path / "run").exists()  # refused before the run dir or any weight
