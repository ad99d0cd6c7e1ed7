"""``homerlhf dpo`` / ``homerlhf kto`` on tiny models: real TRL trainers, real bitsandbytes NF4, real peft.

- DPO from an SFT run dir (a new LoRA; the reference the SFT model with adapters off) through the CLI:
  the held-out chosen-over-rejected log-prob margin rises; the margin the run reports for the start
  is the SFT model's own, computed here independently; the checkpoint is a policy checkpoint
  (actor adapter, config with the base, manifest) that a later run starts from;
- resume: a run of 4 steps with a checkpoint at 2; the checkpoint at 4 removed, ``--resume`` redoes
  steps 3-4: the same adapter bit for bit and the same logged figures;
- KTO and DPO from a GRPO run's checkpoint (its actor adapter continued; the reference that adapter
  as loaded): the reported start margin is the GRPO policy's, computed independently; KTO raises
  the good answers' log-probs and lowers the bad ones'.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tolerances import fp32_bound

FACTS = ["tea is made from leaves", "cats sleep a lot", "snow holds air", "maps show places from above",
         "bees make honey", "the moon has no air", "rivers run to the sea", "bread needs yeast",
         "owls hunt at night", "ice floats on water", "salt melts ice", "wind turns mills"]
TOPICS = ["tea", "cats", "snow", "maps", "bees", "the moon", "rivers", "bread", "owls", "ice", "salt", "wind"]


def _pairs(indices) -> list[dict]:
    return [{"prompt": f"Tell me about {TOPICS[i]}.", "chosen": f"Happy to help! {FACTS[i].capitalize()}.",
             "rejected": f"Go away. {FACTS[i].capitalize()}."} for i in indices]


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


SETTINGS = ["logging.progress=false", "data.eval_fraction=0", "dpo.lr=1e-2", "dpo.batch_size=4", "dpo.grad_accum=1",
            "dpo.max_len=96", "dpo.warmup_ratio=0", "dpo.beta=0.5", "kto.lr=1e-2", "kto.batch_size=4",
            "kto.grad_accum=1", "kto.max_len=96", "kto.warmup_ratio=0", "kto.beta=0.5", "checkpoint.keep=3"]


def _cli(*argv: str) -> str:
    from homerlhf.cli import main

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        main(list(argv))
    return buffer.getvalue()


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref-data")
    return {"train": _write(root / "train.jsonl", _pairs(range(8))),
            "held": _write(root / "held.jsonl", _pairs(range(8, 12)))}


@pytest.fixture(scope="module")
def sft_run(tiny_llama_dir, tmp_path_factory):
    """A real (short) SFT run dir: OUT/model, OUT/sft_run.json."""
    from homerlhf.config import load_config
    from homerlhf.stages.sft import run_sft

    root = tmp_path_factory.mktemp("pref-sft")
    rows = [{"prompt": p["prompt"], "completion": p["chosen"]} for p in _pairs(range(8))]
    cfg = load_config("cpu-tiny", overrides=["sft.method=full", "sft.max_steps=1", "sft.batch_size=4",
                                             "sft.grad_accum=1", "logging.progress=false"])
    run_sft(cfg, root / "sft", data=_write(root / "sft.jsonl", rows), base=str(tiny_llama_dir))
    return root / "sft"


@pytest.fixture(scope="module")
def grpo_run(tiny_llama_dir, tmp_path_factory):
    """One GRPO iteration on the tiny model (reward: a function), one checkpoint with its actor."""
    from homerlhf.config import load_config
    from homerlhf.stages.ppo import run_ppo

    root = tmp_path_factory.mktemp("pref-grpo")
    (root / "rewards.py").write_text("def many_e(response):\n    return response.count('e') / 4.0\n")
    cfg = load_config("cpu-tiny", overrides=[
        f"model.name_or_path={tiny_llama_dir}", "algorithm=grpo", "group.size=2", "ref.backend=adapter_off",
        "reward.backend=function", f"reward.function={root / 'rewards.py'}:many_e", "rollout.batch_size=4",
        "rollout.chunk_size=4", "rollout.max_new_tokens=6", "rollout.max_prompt_len=24", "ppo.mini_batch_size=4",
        "ppo.micro_batch_size=4", "ppo.iterations=1", "checkpoint.every=1", "actor.lr=5e-2",
        "logging.samples_per_iteration=0", "logging.progress=false", "rollout.truncation_penalty=null"])
    run_ppo(cfg, out_dir=root / "run")
    return root / "run"


def _sequence_logprobs(model, ids: list[int]) -> torch.Tensor:
    """Per token ``log p(ids[t] | ids[:t])`` (t >= 1), fp64, from the model's own full logits (the slow way)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0]


def _margins(model, tokenizer, pairs: list[dict]) -> tuple[list[float], float]:
    """(log p(chosen) - log p(rejected) per pair, computed here: the whole sequence's per-token log-probs
    from the model's full logits, summed over the answer's tokens; the tolerance a mean of these margins
    is compared with (:func:`_tolerance`))."""
    from homerlhf.data.load import normalise
    from homerlhf.data.replies import ReplyEncoder

    records, _ = normalise(pairs, "preference")
    encoder = ReplyEncoder(tokenizer)
    out, magnitude = [], 0.0
    for r in records:
        head = len(encoder.prompt_ids(r["prompt"]))
        sides = [encoder.sequence_ids(r["prompt"], r[side]) for side in ("chosen", "rejected")]
        logps = [_sequence_logprobs(model, ids)[head - 1:] for ids in sides]  # per answer token
        out.append(float(logps[0].sum() - logps[1].sum()))
        magnitude += float(sum(lp.abs().sum() for lp in logps))
    return out, _tolerance(magnitude / len(records))


def _tolerance(magnitude: float) -> float:
    """How far the run's mean margin may be from ours: ``magnitude`` (the summed |log p| of a pair's
    answer tokens, on average) x eps32 x the model's widest reduction (its MLP, 384 wide).

    Both sums are of fp32 log-probs of the same tokens, through other kernels: the run's in a padded
    batch of the held-out rows (homerlhf.stages.preference_eval), ours one unpadded sequence at a
    time. Another batch shape reorders each matmul's reduction, which moves a log-prob by up to
    eps32 (1.2e-7) x the reduction's length x its size; a pair's margin sums its answers' tokens'
    log-probs (255 nats of them here), so the bound is 1.2e-2: 110x the largest difference any CPU
    has shown (1.03e-4 on an Intel Xeon with AMX, -31.151157 against -31.151260; 1e-6 on an AMD
    EPYC), and a hundredth of what the GRPO adapter moves the mean margin (1.04; the test that
    starts from it checks that the start is not the bare base, by 10x the bound)."""
    return float(torch.finfo(torch.float32).eps) * 384 * magnitude


def _start_policy(base: str, adapter: Path | None):
    """The start loaded as the stage loads its base (homerlhf.stages.common:load_model: the CPU 4-bit
    kernels of the PPO policy's loader differ by up to 1e-2 nats on these answers), with its adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from homerlhf.config import load_config
    from homerlhf.models.policy import load_tokenizer
    from homerlhf.stages.common import load_model

    model = load_model(AutoModelForCausalLM, base, load_config("cpu-tiny"), "qlora")
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    return model, load_tokenizer(base)


@pytest.fixture(scope="module")
def dpo_from_sft(sft_run, data_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("pref-dpo") / "run"
    printed = _cli("dpo", "--model", str(sft_run), "--data", data_files["train"], "--eval-data", data_files["held"],
                   "--out", str(out), *[x for s in SETTINGS + ["dpo.max_steps=4", "checkpoint.every=2"]
                                        for x in ("--set", s)])
    return out, printed


def test_dpo_from_an_sft_run_raises_the_held_out_margin(dpo_from_sft, sft_run, data_files):
    from homerlhf.config import from_yaml_file

    out, printed = dpo_from_sft
    summary = json.loads((out / "preference_run.json").read_text())
    held = summary["held_out"]
    assert summary["stage"] == "dpo" and summary["steps"] == 4 and summary["n_train"] == 8
    assert summary["start"]["kind"] == "sft run" and summary["start"]["adapter"] is None
    assert held["eval_pairs"] == 4
    assert held["margin_after"] > held["margin_before"] + 1.0, held
    assert held["chosen_logp_change"] > held["rejected_logp_change"] and held["accuracy_after"] >= held["accuracy_before"]
    assert f"held-out margin {held['margin_before']:+.3f} -> {held['margin_after']:+.3f} on 4 pairs" in printed
    # The reported start is the SFT model itself (4-bit, adapters off), measured here on its own.
    model, tokenizer = _start_policy(str(sft_run / "model"), None)
    mine, tolerance = _margins(model, tokenizer, _pairs(range(8, 12)))
    assert held["margin_before"] == pytest.approx(sum(mine) / 4, abs=tolerance)
    # A policy checkpoint, as a PPO run writes them: actor adapter + config naming the base + manifest.
    ckpt = Path(summary["checkpoint"])
    assert ckpt.name == "iter_000004" and sorted(p.name for p in ckpt.parent.iterdir()) == ["iter_000002", "iter_000004"]
    assert (ckpt / "actor" / "adapter_model.safetensors").is_file() and (ckpt / "MANIFEST.json").is_file()
    assert from_yaml_file(ckpt / "config.yaml").model.name_or_path == str(sft_run.resolve() / "model")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert all("rewards/margins" in r for r in rows if "loss" in r)
    # The same figures on the 8 pairs it trained on (what the app's Evaluate says a feedback run did).
    trained = summary["trained_rows"]
    assert trained["eval_pairs"] == 8 and trained["margin_after"] > trained["margin_before"], trained


def test_dpo_resume_redoes_the_steps_bit_for_bit(dpo_from_sft, tmp_path):
    import shutil

    out, _ = dpo_from_sft
    run = tmp_path / "run"
    shutil.copytree(out, run)
    final = load_file(str(out / "checkpoints" / "iter_000004" / "actor" / "adapter_model.safetensors"))
    logged = (out / "metrics.jsonl").read_text()
    shutil.rmtree(run / "checkpoints" / "iter_000004")  # the run stopped after its checkpoint at step 2
    (run / "preference_run.json").unlink()
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 3, "loss": 123.0}\n')  # a step logged after the checkpoint: redone, not kept
    _cli("dpo", "--resume", str(run))
    summary = json.loads((run / "preference_run.json").read_text())
    assert summary["resumed_from"].endswith("iter_000002") and summary["steps"] == 4
    resumed = load_file(str(run / "checkpoints" / "iter_000004" / "actor" / "adapter_model.safetensors"))
    assert final.keys() == resumed.keys() and all(torch.equal(final[k], resumed[k]) for k in final)

    def figures(text: str) -> list[dict]:  # every step's logged figures (the end-of-run totals aside)
        rows = [json.loads(line) for line in text.splitlines()]
        return [{k: v for k, v in r.items() if "runtime" not in k and "per_second" not in k} for r in rows if "loss" in r]

    assert figures((run / "metrics.jsonl").read_text()) == figures(logged)


def test_a_later_run_starts_from_a_dpo_run(dpo_from_sft, data_files, tmp_path):
    """dpo -> kto: the earlier run's actor continues, on the same base."""
    from homerlhf.config import load_config
    from homerlhf.stages.preference import run_preference

    out, _ = dpo_from_sft
    cfg = load_config("cpu-tiny", overrides=SETTINGS + ["kto.max_steps=1"])
    summary = run_preference("kto", cfg, tmp_path / "kto", data=[data_files["train"]], base=str(out))
    assert summary["start"]["kind"] == "dpo run"
    assert summary["start"]["adapter"].endswith("iter_000004/actor") and summary["steps"] == 1


@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_from_a_grpo_checkpoint_the_reference_is_that_policy(method, grpo_run, data_files, tiny_llama_dir, tmp_path):
    from homerlhf.config import load_config
    from homerlhf.stages.preference import run_preference

    cfg = load_config("cpu-tiny", overrides=SETTINGS + [f"{method}.max_steps=2", f"{method}.lr=2e-2", "kto.batch_size=8"])
    summary = run_preference(method, cfg, tmp_path / method, data=[data_files["train"]],
                             eval_data=data_files["held"], base=str(grpo_run))
    held = summary["held_out"]
    ckpt = grpo_run / "checkpoints" / "iter_000001"
    assert summary["start"] == {"name": str(grpo_run), "kind": "ppo run", "base": str(tiny_llama_dir),
                                "adapter": str(ckpt / "actor"), "checkpoint": str(ckpt)}
    assert summary["n_train"] == (16 if method == "kto" else 8)  # a pair is a good and a bad answer for KTO
    model, tokenizer = _start_policy(str(tiny_llama_dir), ckpt / "actor")
    mine, tolerance = _margins(model, tokenizer, _pairs(range(8, 12)))
    with model.disable_adapter():
        base, _ = _margins(model, tokenizer, _pairs(range(8, 12)))
    print(f"{method}: margin_before {held['margin_before']:.6f}, ours {sum(mine) / 4:.6f}, the bare base's "
          f"{sum(base) / 4:.6f}; tolerance {tolerance:.2e}")
    # The GRPO adapter is not the bare base, by far more than the tolerance: the check below can fail.
    assert abs(sum(mine) - sum(base)) / 4 > 10 * tolerance
    assert held["margin_before"] == pytest.approx(sum(mine) / 4, abs=tolerance)
    assert held["margin_after"] > held["margin_before"] + 0.5, held
    # TRL's step-1 figures come from the forward before the first update: the policy starts equal to its
    # reference (the GRPO adapter's exact weights, not TRL's bf16 rounding of them), so its rewards are 0.
    first = next(json.loads(line) for line in (tmp_path / method / "metrics.jsonl").read_text().splitlines()
                 if '"loss"' in line)
    assert first["step"] == 1 and abs(first["rewards/chosen"]) < 1e-6 and abs(first["rewards/rejected"]) < 1e-6, first
    if method == "kto":
        assert held["good_logp_change"] > 0 > held["bad_logp_change"], held


def test_kto_from_an_sft_run_raises_good_answers_and_lowers_bad_ones(sft_run, data_files, tmp_path):
    from homerlhf.config import load_config
    from homerlhf.stages.preference import run_preference

    cfg = load_config("cpu-tiny", overrides=SETTINGS + ["kto.max_steps=2", "kto.batch_size=8"])
    summary = run_preference("kto", cfg, tmp_path / "kto", data=[data_files["train"]], eval_data=data_files["held"],
                             base=str(sft_run))
    held = summary["held_out"]
    assert summary["start"]["kind"] == "sft run" and (summary["n_good"], summary["n_bad"]) == (8, 8)
    assert held["eval_rated"] == 8 and held["good_logp_change"] > 0 > held["bad_logp_change"], held
    assert held["margin_after"] > held["margin_before"], held
    # The same figures on the 16 rated answers it trained on (what the app's Evaluate says a feedback run did).
    trained = summary["trained_rows"]
    assert trained["eval_rated"] == 16 and trained["good_logp_change"] > trained["bad_logp_change"], trained


def test_a_dpo_checkpoint_exports_as_the_trained_policy(dpo_from_sft, tmp_path):
    """`homerlhf export policy` (and so the app's Export) takes a DPO run's checkpoint as it takes a PPO run's:
    the merged model is the trained policy up to float32 rounding (tests/stages/test_export.py's bound), and the
    model card names the method, its data and steps, not the preset's PPO iterations."""
    from homerlhf.stages.export import export_policy

    out, _ = dpo_from_sft
    result = export_policy(out, tmp_path / "export")
    assert result["checkpoint"].endswith("iter_000004") and result["dtype"] == "float32"
    assert 0 <= result["gap"]["max_abs"] < fp32_bound(20) and result["gap"]["tokens"] > 10  # |log p| <= 20
    card = (tmp_path / "export" / "README.md").read_text()
    assert "(DPO, a LoRA actor on a 4-bit NF4 base)" in card
    assert "- algorithm: dpo (TRL), 4 optimizer steps (checkpoint `iter_000004`)\n" in card
    # Tagged and described as what trained it: no PPO tag, no reward model it never used (the preset's demo-rm).
    front = card.split("---")[1]
    assert "- dpo" in front.splitlines() and "- ppo" not in front.splitlines()
    assert "- reward model: none (DPO learns from the preference pairs themselves)" in card and "demo-rm" not in card
    summary = json.loads((out / "preference_run.json").read_text())
    assert f"- started from: `{summary['start']['name']}` (sft run)" in card
    assert f"({summary['n_train']} training rows)" in card and "- training pairs: margin" in card
    assert "iterations" not in card


def test_dpo_sft_weight_adds_trls_sft_loss_on_the_chosen_answers(dpo_from_sft, sft_run, data_files, tmp_path):
    """``dpo.sft_weight`` (RPO: TRL's ``sft`` loss, the chosen answers' mean token NLL, beside the DPO loss):
    from the same start, data, seed and steps as the run without it, the held-out chosen answers end likelier."""
    from homerlhf.config import load_config
    from homerlhf.stages.preference import run_preference

    cfg = load_config("cpu-tiny", overrides=SETTINGS + ["dpo.max_steps=4", "checkpoint.every=2", "dpo.sft_weight=5"])
    summary = run_preference("dpo", cfg, tmp_path / "rpo", data=[data_files["train"]], eval_data=data_files["held"],
                             base=str(sft_run))
    plain = json.loads((dpo_from_sft[0] / "preference_run.json").read_text())["held_out"]
    held = summary["held_out"]
    assert held["margin_before"] == pytest.approx(plain["margin_before"], abs=1e-6)  # the same start
    assert held["chosen_logp_change"] > plain["chosen_logp_change"] + 1.0, (held, plain)


def test_under_bf16_compute_a_continued_adapter_starts_equal_to_its_reference(sft_run, data_files, tmp_path):
    """A GPU preset's dtypes, on the CPU (bf16 compute: the trainable weights train in bf16): a DPO run of one
    step from the SFT model, then a DPO run continuing its adapter (under the first run's settings). TRL
    copies that adapter into its fp32 ``ref`` adapter, then rounds the trainable one to bf16; the reference is
    made the adapter the policy starts from, in its dtype, so the second run's first rewards (beta x the
    policy's answer log-prob minus the reference's, from the forward before the first update) are 0, not the
    rounding's offset."""
    from homerlhf.config import load_config
    from homerlhf.stages.preference import run_preference

    cfg = load_config("cpu-tiny", overrides=SETTINGS + ["dpo.max_steps=1", "quant.compute_dtype=bf16"])
    run_preference("dpo", cfg, tmp_path / "first", data=[data_files["train"]], base=str(sft_run))
    summary = run_preference("dpo", cfg, tmp_path / "second", data=[data_files["train"]], base=str(tmp_path / "first"))
    assert summary["start"]["kind"] == "dpo run"
    first = next(json.loads(line) for line in (tmp_path / "second" / "metrics.jsonl").read_text().splitlines()
                 if '"loss"' in line)
    assert first["step"] == 1 and abs(first["rewards/chosen"]) < 1e-6 and abs(first["rewards/rejected"]) < 1e-6, first
