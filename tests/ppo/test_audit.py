"""Runs that hack their reward are flagged by the run and by ``homerlhf audit``; runs that train
nothing are stopped by the no-op guards. Real cpu-tiny GRPO runs on a tiny peaked policy whose
replies end at varied lengths (``eos_probability``), rewarded by functions that pay for length, for
echoing the prompt and for repetition: the policy learns each in a few iterations at ``actor.lr`` 1e-2."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from homerlhf.config import load_config
from homerlhf.ppo.audit import audit_run
from homerlhf.ppo.guards import NoOpError, NoOpGuards
from homerlhf.ppo.metrics import read_metrics
from homerlhf.stages.ppo import run_ppo

REWARDS_PY = '''
def length(response_ids):
    return float(len(response_ids))

def echo(prompt_ids, response_ids):
    asked = set(prompt_ids[1:-2])  # <|user|> ... <|end|><|assistant|>: the question's own tokens
    words = response_ids[:-1] if len(response_ids) > 1 else response_ids
    return sum(t in asked for t in words) / len(words)

def repeat(response_ids):
    return float(len(response_ids) - len(set(response_ids)))

def constant(response):
    return 1.0
'''


@pytest.fixture(scope="module")
def hack_kit(tmp_path_factory):
    """(policy dir, rewards file, echo prompts file): the prompts are the policy's own samples, so
    that echoing them is within its reach in a few iterations."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from homerlhf.data.builtin import all_examples
    from homerlhf.tiny import build_causal_lm

    root = tmp_path_factory.mktemp("hacks")
    policy = build_causal_lm(root / "policy", hidden=64, layers=2, head_scale=20.0, eos_probability=0.1)
    (root / "rewards.py").write_text(REWARDS_PY)
    tok, model = AutoTokenizer.from_pretrained(policy), AutoModelForCausalLM.from_pretrained(policy)
    prompts = [tok.apply_chat_template([{"role": "user", "content": ex.prompt}], tokenize=False,
                                       add_generation_prompt=True) for ex in all_examples()[:16]]
    batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(1)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, max_new_tokens=8, suppress_tokens=[tok.eos_token_id],
                             pad_token_id=tok.pad_token_id)
    texts = [tok.decode(o[batch["input_ids"].shape[1]:], skip_special_tokens=True) for o in out]
    (root / "echo.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return policy, root / "rewards.py", root / "echo.jsonl"


def _run(kit, tmp_path_factory, function, iterations, *extra):
    policy, rewards, _ = kit
    run_dir = tmp_path_factory.mktemp(function) / "run"
    cfg = load_config("cpu-tiny", overrides=[
        f"model.name_or_path={policy}", "ref.backend=adapter_off", "reward.backend=function",
        f"reward.function={rewards}:{function}", "algorithm=grpo", "group.size=4", "rollout.batch_size=16",
        "rollout.chunk_size=16", "rollout.max_new_tokens=16", "rollout.max_prompt_len=24", "ppo.mini_batch_size=16",
        "ppo.micro_batch_size=16", "ppo.epochs=2", f"ppo.iterations={iterations}", "checkpoint.every=100",
        "logging.progress=false", "data.prompts=builtin:demo", "rollout.truncation_penalty=null", "actor.lr=1e-2",
        "ppo.kl_coef=0.0", "ppo.adaptive_kl=false", "guards.empty_or_cut_iterations=null", *extra])
    run_ppo(cfg, out_dir=run_dir)
    return run_dir


def _audit_cli(run_dir, capsys, *args):
    from homerlhf.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["audit", str(run_dir), *args])
    captured = capsys.readouterr()
    return info.value.code or 0, captured.out, captured.err


def _raised(run_dir, name) -> bool:
    return any(row.get(f"signal_flag_{name}") == 1 for row in read_metrics(run_dir))


@pytest.fixture(scope="module")
def length_run(hack_kit, tmp_path_factory):
    return _run(hack_kit, tmp_path_factory, "length", 4)


def test_a_reward_that_pays_for_length_is_flagged_by_the_run_and_the_audit(length_run, capsys, tmp_path):
    assert _raised(length_run, "length_drift") and _raised(length_run, "length_corr")
    code, out, _ = _audit_cli(length_run, capsys, "--json", "--plot", str(tmp_path / "signals.png"))
    assert code == 1
    report = json.loads(out)
    flags = {f["name"]: f for f in report["flags"]}
    assert not report["ok"] and {"length_drift", "length_corr"} <= set(flags)
    assert (tmp_path / "signals.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The samples shown are long: each longer than twice the first iteration's mean logged reply.
    first = [s for s in map(json.loads, (length_run / "samples.jsonl").read_text().splitlines())
             if s["iteration"] == 1 and s["rank"] == "first"]
    mean_first = sum(len(s["response"]) for s in first) / len(first)
    shown = flags["length_drift"]["examples"]
    assert len(shown) == 3 and all(len(s["response"]) > 2 * mean_first for s in shown)
    code, text, _ = _audit_cli(length_run, capsys)
    assert code == 1 and "length_drift" in text and "FLAG at iterations" in text and "after the fact" in text


def test_a_reward_that_pays_for_echoing_the_prompt_is_flagged(hack_kit, tmp_path_factory, capsys):
    run_dir = _run(hack_kit, tmp_path_factory, "echo", 5, f"data.prompts={hack_kit[2]}", "audit.ngram=1")
    assert _raised(run_dir, "prompt_echo")
    audit = audit_run(run_dir)
    (echo,) = [f for f in audit.flags if f.name == "prompt_echo"]
    assert echo.examples and all(s["score"] > 0.5 for s in echo.examples)  # the echo share the reward paid
    assert _audit_cli(run_dir, capsys)[0] == 1


def test_a_reward_that_pays_for_repetition_is_flagged(hack_kit, tmp_path_factory, capsys):
    run_dir = _run(hack_kit, tmp_path_factory, "repeat", 6, "audit.patience=1")
    assert _raised(run_dir, "repetition")
    (rep,) = [f for f in audit_run(run_dir).flags if f.name == "repetition"]
    assert rep.examples and all(len(set(s["response"])) < len(s["response"]) / 2 for s in rep.examples)
    assert _audit_cli(run_dir, capsys)[0] == 1


def test_a_constant_reward_stops_the_run_naming_the_cause(hack_kit, tmp_path_factory):
    with pytest.raises(NoOpError) as info:
        _run(hack_kit, tmp_path_factory, "constant", 5, "guards.flat_reward_iterations=2")
    message = str(info.value)
    assert message.startswith("iteration 2: training stopped: the reward gave every response the same score (1)")
    assert "\n" not in message


def test_an_update_that_moves_no_weight_stops_the_run(hack_kit, tmp_path_factory):
    """At actor.lr 1e-50 every Adam step rounds to nothing in float32."""
    with pytest.raises(NoOpError, match="left the actor's LoRA weights unchanged"):
        _run(hack_kit, tmp_path_factory, "length", 2, "actor.lr=1e-50")


def test_audit_refuses_in_one_line_what_is_not_an_audited_run(length_run, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(length_run / "metrics.jsonl", bare / "metrics.jsonl")  # a real run's metrics, no samples
    for path, fragment in ((tmp_path / "missing", "does not exist"), (tmp_path, "has no metrics.jsonl"),
                           (bare, "has no samples")):
        code, out, err = _audit_cli(path, capsys)
        assert code == 2 and out == "" and err.count("\n") == 1 and fragment in err and "Traceback" not in err


class _Batch:
    """The few fields of an experience the no-op guards read."""

    def __init__(self, scores, lengths, truncated):
        self.scores = torch.tensor(scores)
        width = max(lengths)
        self.response_mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
        self.truncated = torch.tensor(truncated)
        self.sequence_advantages = self.scores - self.scores.mean()
        self.advantages = None

    def __len__(self):
        return len(self.scores)


def test_all_capped_importance_weights_and_all_cut_responses_trip_their_guards(caplog):
    cfg = load_config("cpu-tiny", overrides=["guards.empty_or_cut_iterations=2"])
    healthy = _Batch([1.0, 2.0], [3, 1], [False, False])  # 2 tokens + end, and an empty reply (its end token)
    NoOpGuards(cfg).check({"iteration": 1, "is_capped_fraction": 0.5}, healthy)
    with pytest.raises(NoOpError, match="importance weight was capped"):
        NoOpGuards(cfg).check({"iteration": 1, "is_capped_fraction": 1.0}, healthy)
    guards = NoOpGuards(cfg)
    cut_or_empty = _Batch([1.0, 2.0], [16, 1], [True, False])
    guards.check({"iteration": 1}, cut_or_empty)
    with pytest.raises(NoOpError, match="empty or cut at rollout.max_new_tokens"):
        guards.check({"iteration": 2}, cut_or_empty)
    warn = NoOpGuards(load_config("cpu-tiny", overrides=["guards.action=warn", "guards.empty_or_cut_iterations=1"]))
    warn.check({"iteration": 3}, cut_or_empty)  # warns, goes on
    assert "no-op guard" in caplog.text and "empty or cut" in caplog.text
