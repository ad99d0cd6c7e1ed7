"""``homerlhf reward``: real TRL RewardTrainer on tiny models, the merged artifact, the GGUF export,
and the builtin reward model's held-out pairwise accuracy."""

from __future__ import annotations

import json

import pytest
import torch

from homerlhf.config import load_config
from tolerances import fp32_bound

PAIRS = [
    {"prompt": "Tell me about tea.", "chosen": "Happy to help! Tea is made by steeping dried leaves in hot water.",
     "rejected": "Ugh, figure it out yourself."},
    {"prompt": "Share a fact about cats.", "chosen": "Gladly! Cats sleep for most of the day.",
     "rejected": "Not my problem. Go away."},
    {"prompt": "Tell me about maps.", "chosen": "Of course. A map shows places from above at a smaller scale.",
     "rejected": "That is a stupid question."},
    {"prompt": "Same on both sides", "chosen": "x", "rejected": "x"},
] * 3


@pytest.fixture
def pairs_file(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    return str(path)


def test_qlora_reward_writes_merged_classifier_and_gguf(tiny_llama_dir, pairs_file, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from homerlhf.data.load import load_preferences
    from homerlhf.stages.reward import pair_ids, score_ids

    from homerlhf.stages.reward import run_reward

    cfg = load_config("cpu-tiny", overrides=[
        "rm.method=qlora", "rm.max_steps=3", "rm.batch_size=4", "rm.grad_accum=1", "rm.lr=1e-2",
        "rm.eval_data=null", "data.eval_fraction=0.25", "logging.progress=false", "reward.outtype=f32",
    ])
    out = tmp_path / "rm"
    summary = run_reward(cfg, out, data=pairs_file, base=str(tiny_llama_dir))

    run = json.loads((out / "reward_run.json").read_text())
    assert run == summary
    assert run["method"] == "qlora" and run["steps"] == 3
    assert run["data"]["n_bad"] == 3 and run["data"]["bad_examples"][0]["reason"] == "chosen == rejected"
    # 9 usable pairs on 3 prompts: a 0.25 split by prompt holds out one prompt's 3 pairs, a 95% interval
    # of +-1.96*0.5/sqrt(3) = 0.57: no held-out figure, every pair trains, the training accuracy is reported
    assert (run["n_train"], run["n_eval"]) == (9, 0) and run["eval_accuracy"] is None
    assert run["eval_source"] is None and run["eval_how"] == "none"
    assert "give 3 held-out pair(s) (+-0.57 at 95%): too few for a held-out figure" in run["eval_note"]
    assert 0.0 <= run["train_accuracy"] <= 1.0
    assert (out / "adapter" / "adapter_config.json").is_file()

    model = AutoModelForSequenceClassification.from_pretrained(out / "model")
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None
    assert all(p.dtype == torch.float32 for p in model.parameters())
    tok = AutoTokenizer.from_pretrained(out / "model")

    # Merged scores = full-precision base + adapter (incl. the trained score head).
    records, _ = load_preferences(pairs_file)
    ids = pair_ids(records[:3], tok, 96)["chosen_ids"]
    base = AutoModelForSequenceClassification.from_pretrained(tiny_llama_dir, num_labels=1, pad_token_id=tok.pad_token_id)
    adapted = PeftModel.from_pretrained(base, out / "adapter")
    torch.testing.assert_close(score_ids(model, ids, tok.pad_token_id), score_ids(adapted, ids, tok.pad_token_id),
                               atol=1e-4, rtol=1e-4)

    assert run["gguf_dir"] == str(out / "gguf")
    assert (out / "gguf" / "backbone.gguf").is_file() and (out / "gguf" / "score_head.safetensors").is_file()


def test_a_users_pairs_are_evaluated_on_their_own_held_out_prompts(tiny_llama_dir, tmp_path, capsys):
    """The default preset names the builtin task's held-out pairs (rm.eval_data); a user's --data
    is evaluated on its own rows instead: whole prompts held out, and the figure is the model's
    accuracy on exactly those pairs of the file."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from homerlhf.data.heldout import prompt_key, split_by_prompt
    from homerlhf.data.load import load_preferences
    from homerlhf.stages.reward import done_line, pair_ids, pairwise_accuracy, run_reward

    topics = ["tea", "cats", "maps", "rain", "bread", "trains", "bees", "clocks", "rivers", "salt", "owls", "glass",
              "paper", "moss", "kites", "wool", "stars", "honey", "sand", "ferns", "boats", "ink", "frogs", "bells",
              "caves", "pears", "wind", "coral", "tin", "hay"]
    rows = [{"prompt": f"Tell me about {t}.", "chosen": f"Gladly! {t.capitalize()} are worth a look{end}",
             "rejected": reply} for t in topics for end, reply in (("!", "Go away."), (".", "Not my problem."))]
    path = tmp_path / "my_pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config("cpu-tiny", overrides=["rm.max_steps=2", "rm.batch_size=8", "data.eval_fraction=0.75",
                                             "logging.progress=false", "rm.export_gguf=false"])
    assert cfg.rm.eval_data == "builtin:demo-pairs-heldout"  # what the preset names
    summary = run_reward(cfg, tmp_path / "rm", data=str(path), base=str(tiny_llama_dir))

    # 60 pairs on 30 prompts, 2 each: round(60 * 0.75) = 45 wanted, whole prompts: 23 of them, 46 pairs
    assert (summary["n_train"], summary["n_eval"]) == (14, 46)
    assert summary["eval_source"] == str(path) and summary["eval_how"] == "held out by prompt"
    assert summary["eval_data"] == {"source": str(path), "split": "by prompt", "eval_fraction": 0.75}
    assert summary["eval_half_width_95"] == pytest.approx(0.98 / 46 ** 0.5, abs=1e-4)  # 0.1445
    assert "builtin:demo-pairs-heldout is the builtin task's held-out set" in summary["eval_note"]
    # The figure is the saved model's accuracy on the file's held-out pairs, counted here.
    records, _ = load_preferences(str(path))
    _, held = split_by_prompt([prompt_key(r["prompt"]) for r in records], 0.75, cfg.seed)
    assert len({prompt_key(records[i]["prompt"]) for i in held}) == 23
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm" / "model")
    tok = AutoTokenizer.from_pretrained(tmp_path / "rm" / "model")
    pairs = pair_ids([records[i] for i in held], tok, cfg.rm.max_len)
    assert summary["eval_accuracy"] == pairwise_accuracy(model, pairs, tok.pad_token_id)
    line = done_line(summary, tmp_path / "rm")
    assert line.startswith(f"reward done: 14 pairs, held-out accuracy {summary['eval_accuracy']:.3f} +-0.14 (95%) "
                           f"on 46 pairs of {path} (held out by prompt), training accuracy ")
    assert "builtin:demo-pairs-heldout is the builtin task's held-out set" in capsys.readouterr().out


def test_score_ids_reads_the_last_real_token(tiny_llama_dir):
    from transformers import AutoModelForSequenceClassification

    from homerlhf.stages.reward import score_ids

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_llama_dir, num_labels=1, pad_token_id=0)
    seqs = [[5, 9, 33, 1], [5, 40, 1], [7, 8, 9, 10, 11, 1]]
    batched = score_ids(model, seqs, pad_id=0, batch_size=3)
    alone = torch.cat([score_ids(model, [s], pad_id=0) for s in seqs])
    assert batched.shape == (3,)
    torch.testing.assert_close(batched, alone, atol=fp32_bound(alone.abs().max()), rtol=0)  # other shapes


def _held_out_accuracy(run_dir, n=300):
    """(overall, rude-rejected, off-topic-rejected) pairwise accuracy of OUT/model on unseen prompts."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from homerlhf.data import builtin
    from homerlhf.data.load import normalise
    from homerlhf.stages.reward import pair_ids, score_ids

    model = AutoModelForSequenceClassification.from_pretrained(run_dir / "model")
    tok = AutoTokenizer.from_pretrained(run_dir / "model")
    raw = builtin.preference_records(seed=0, n=n, held_out=True)
    train_prompts = {r["prompt"] for r in builtin.preference_records(seed=0)}
    assert not {r["prompt"] for r in raw} & train_prompts
    records, _ = normalise(raw, "preference")
    pairs = pair_ids(records, tok, 96)
    correct = score_ids(model, pairs["chosen_ids"], tok.pad_token_id) > score_ids(model, pairs["rejected_ids"], tok.pad_token_id)
    rude = torch.tensor([r["rejected"] in builtin.RUDE_REPLIES for r in raw])

    def fraction(hits):  # counted: 270 of 300 is 0.9, not float32's 0.8999999762
        return int(hits.sum()) / len(hits)

    return fraction(correct), fraction(correct[rude]), fraction(correct[~rude])


@pytest.fixture(scope="module")
def demo_rm_dir():
    from pathlib import Path

    import homerlhf.stages  # noqa: F401 - registers builtin:demo-rm
    from homerlhf.models.registry import resolve_model

    return Path(resolve_model("builtin:demo-rm"))


@pytest.mark.slow
def test_builtin_reward_model_separates_rude_replies(demo_rm_dir):
    """builtin:demo-rm (SFT'd tiny Llama + RM, CPU, seed 0) on pairs with unseen prompts."""
    run = json.loads((demo_rm_dir / "reward_run.json").read_text())
    assert run["n_eval"] == 200 and run["eval_accuracy"] is not None
    assert (demo_rm_dir / "gguf" / "backbone.gguf").is_file()
    overall, rude, _ = _held_out_accuracy(demo_rm_dir)
    assert rude >= 0.98, rude
    assert overall >= 0.7, overall


@pytest.mark.slow
def test_builtin_reward_model_ranks_held_out_pairs(demo_rm_dir):
    """The issue's bar: >= 0.9 pairwise accuracy on held-out builtin pairs. The model is built on this
    CPU, so its figures depend on the CPU's kernels (measured 0.945 on an AMD EPYC under default and
    AVX2 kernels); the accuracies are counted fractions, so 0.9 is 0.9 (270 of 300), not a float32 mean
    that reads 0.8999999762 and misses its own line."""
    run = json.loads((demo_rm_dir / "reward_run.json").read_text())
    overall, _, _ = _held_out_accuracy(demo_rm_dir)
    assert run["eval_accuracy"] >= 0.9 and overall >= 0.9, (run["eval_accuracy"], overall)


def test_a_failed_export_keeps_the_trained_model_and_names_the_command(pairs_file, tmp_path):
    """A WordPiece vocabulary trains fine but has no GGUF form: the trained model stays, the error
    says how to export later (or use it as it is)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedTokenizerFast

    from homerlhf.data import builtin
    from homerlhf.errors import UserError
    from homerlhf.stages.reward import run_reward
    from homerlhf.tiny import model_config

    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.train_from_iterator(builtin.corpus(), trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[EOS]"], show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=wordpiece, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} [EOS] {% endfor %}"
    AutoModelForCausalLM.from_config(model_config("llama", len(tok), hidden=32, layers=1)).save_pretrained(tmp_path / "wp")
    tok.save_pretrained(tmp_path / "wp")

    cfg = load_config("cpu-tiny", overrides=["rm.method=full", "rm.max_steps=1", "rm.batch_size=4", "rm.eval_data=null",
                                             "data.eval_fraction=0.25", "logging.progress=false"])
    out = tmp_path / "rm"
    with pytest.raises(UserError) as info:
        run_reward(cfg, out, data=pairs_file, base=str(tmp_path / "wp"))
    assert info.value.exit_code == 1
    assert str(info.value) == (
        f"the reward model is trained and saved in {out / 'model'}, but its GGUF export failed (tokenizer model "
        "'WordPiece' is not supported; supported: BPE (byte-level or byte-fallback), Unigram); export it later with "
        f"`homerlhf export reward --model {out} --out {out / 'gguf'}`, or use it as it is with reward.backend=hf")
    run = json.loads((out / "reward_run.json").read_text())
    assert run["gguf_dir"] is None and "WordPiece" in run["gguf_error"] and not (out / "gguf").exists()
    AutoModelForSequenceClassification.from_pretrained(out / "model")  # the trained model is there, whole


# -- one sequence shape and one pooling rule, with real tokenizers (tests/fixtures/README.md) --------
REAL_PAIRS = [
    {"prompt": "Tell me about tea, please.", "chosen": "Tea is made by steeping dried leaves in hot water.",
     "rejected": "No."},
    {"prompt": "Share a fact about cats.", "chosen": "Cats sleep for most of the day.",
     "rejected": "Figure it out yourself, I am busy today."},
]


REAL_ARCH = {"qwen3": "qwen3", "llama3_1": "llama", "gemma3": "gemma3_text"}  # as tests/conftest.py builds them


def _real_records():
    from homerlhf.data.load import normalise

    records, _ = normalise(REAL_PAIRS, "preference")
    return records


def _real_reward_model(name, real_tokenizer_dirs, out_dir):
    """A tiny random-init reward model on a real tokenizer, saved as the reward stage saves one: the
    tokenizer as the stages load it (Llama-3.1: pad = eos = <|eot_id|>) and its pad id in the config."""
    from transformers import AutoModelForSequenceClassification

    from homerlhf.models.policy import load_tokenizer
    from homerlhf.tiny import build_sequence_classifier

    tok = load_tokenizer(str(real_tokenizer_dirs[name]), trust_remote_code=False, padding_side=None)
    path = build_sequence_classifier(out_dir, arch=REAL_ARCH[name], seed=11,
                                     tokenizer_dir=real_tokenizer_dirs[name], hidden=64, layers=2)
    model = AutoModelForSequenceClassification.from_pretrained(path, pad_token_id=tok.pad_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model.eval(), tok


@pytest.mark.slow  # each real vocabulary is exported and served by a worker (Gemma-3: 262k tokens)
@pytest.mark.parametrize("name", ["qwen3", "llama3_1", "gemma3"])
def test_one_score_through_stage_evaluation_hf_backend_and_worker(name, real_tokenizer_dirs, tmp_path):
    """The RM score of a (prompt, reply) is the same through the reward stage's evaluation (the ids
    it trains on), the ``hf`` backend and the llama.cpp worker (F32 export, F32 KV cache) fed as PPO
    feeds them (prompt ids, response ids up to the stop token), and equals the score at the last
    token of that one unpadded sequence."""
    import numpy as np

    from homerlhf.data.tokens import prompt_ids
    from homerlhf.ppo.backends import HFReward
    from homerlhf.stages.reward import pair_ids, score_ids
    from homerlhf.workers.backends import connect
    from homerlhf.workers.gguf import export_reward
    from homerlhf.workers.process import WorkerProcess

    path, model, tok = _real_reward_model(name, real_tokenizer_dirs, tmp_path / "rm")
    if name == "llama3_1":
        assert tok.pad_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|eot_id|>")
    records = _real_records()
    pairs = pair_ids(records, tok, max_len=256)
    sequences = pairs["chosen_ids"] + pairs["rejected_ids"]  # different lengths: padding is exercised
    prompts = [prompt_ids(tok, r["prompt"]) for r in records] * 2
    responses = [seq[len(p):] for seq, p in zip(sequences, prompts)]
    assert all(seq[:len(p)] == p for seq, p in zip(sequences, prompts))

    stage = score_ids(model, sequences, tok.pad_token_id, batch_size=4).double().numpy()
    hf = np.array(HFReward(str(path), batch_size=4).score(prompts, responses))
    export = export_reward(str(path), tmp_path / "export", outtype="f32")
    worker = connect("reward", process=WorkerProcess("reward", export, ctx=128, f32_kv_cache=True, threads=1,
                                                     log_path=tmp_path / "reward.log"))
    try:
        served = np.array(worker.score(prompts, responses))
    finally:
        worker.close()
    with torch.no_grad():
        alone = np.array([model.score(model.model(input_ids=torch.tensor([s])).last_hidden_state[0, -1]).item()
                          for s in sequences])
    print(f"{name}: scores {np.round(alone, 4).tolist()}; max |diff| stage {np.abs(stage - alone).max():.1e}, "
          f"hf {np.abs(hf - alone).max():.1e}, worker {np.abs(served - alone).max():.1e}")
    assert np.abs(stage - alone).max() <= 1e-4 and np.abs(hf - alone).max() <= 1e-4
    assert np.abs(served - stage).max() <= 1e-3
    assert np.ptp(alone) > 1e-2  # distinct scores: a mix-up between sequences would show


def test_reward_trainer_loss_reads_the_last_real_token_when_pad_is_eos(real_vocab_model_dir, tmp_path):
    """The trainer's Bradley-Terry loss on a collated batch of the shape's ids (Llama-3.1: pad = eos)
    is ``-log sigmoid(r_chosen - r_rejected)`` with scores at the last real token, not at the last
    non-pad id that TRL's model forward would read."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig

    from homerlhf.models.policy import load_tokenizer
    from homerlhf.models.scores import score_sequences
    from homerlhf.stages.reward import _last_token_reward_trainer, pair_ids

    base = real_vocab_model_dir("llama3_1")
    tok = load_tokenizer(str(base), trust_remote_code=False, padding_side=None)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, pad_token_id=tok.pad_token_id)
    pairs = pair_ids(_real_records(), tok, max_len=256)
    trainer = _last_token_reward_trainer()(
        model=model, args=RewardConfig(output_dir=str(tmp_path / "t"), report_to="none", use_cpu=True,
                                       max_length=None, disable_dropout=True),
        train_dataset=Dataset.from_dict(pairs), processing_class=tok)
    batch = trainer.data_collator([{"chosen_ids": c, "rejected_ids": r}
                                   for c, r in zip(pairs["chosen_ids"], pairs["rejected_ids"])])
    assert batch["input_ids"][0, -1].item() == tok.pad_token_id  # a padded row: trailing eos pads
    model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(model, dict(batch))
        chosen = score_sequences(model, pairs["chosen_ids"], tok.pad_token_id)
        rejected = score_sequences(model, pairs["rejected_ids"], tok.pad_token_id)
        want = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
        hf_pooled = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
    # TRL's padded batch against our scores of each row (tests/tolerances.py): the loss moves with the
    # scores' difference, at most by that much.
    bound = fp32_bound(torch.cat([chosen, rejected]).abs().max())
    torch.testing.assert_close(loss, want, atol=bound, rtol=0)
    hf_loss = -torch.nn.functional.logsigmoid(hf_pooled[:2] - hf_pooled[2:]).mean()
    print(f"loss {loss.item():.6f}, ours {want.item():.6f}, HF's pooling {hf_loss.item():.6f}; bound {bound:.1e}")
    assert abs(hf_loss.item() - want.item()) > 10 * bound  # the rule matters on these ids


# -- over-long pairs keep their prompt's head -------------------------------------------------------
FIT_SYSTEM = "You are a terse pirate who answers in one line."
FIT_LONG = ("Tell me everything about the sea, the ships and the stars above them. " * 40).strip()


@pytest.mark.parametrize("name", ["qwen3", "llama3_1", "gemma3"])
def test_an_over_long_pair_keeps_bos_the_system_turn_and_both_whole_replies(name, real_tokenizer_dirs):
    """Cut inside the last user message, the same cut under both replies; each reply and its
    end-of-turn token kept whole, so the score is read where PPO reads it."""
    from homerlhf.data.load import LoadReport, normalise
    from homerlhf.data.replies import reward_sequence_ids
    from homerlhf.data.tokens import prompt_ids
    from homerlhf.models.policy import load_tokenizer
    from homerlhf.stages.reward import _fit, pair_ids

    tok = load_tokenizer(str(real_tokenizer_dirs[name]), trust_remote_code=False, padding_side=None)
    prompt = [{"role": "system", "content": FIT_SYSTEM}, {"role": "user", "content": FIT_LONG}]
    [record], _ = normalise([{"prompt": prompt, "chosen": "The sea is wide and the ships are slow.",
                              "rejected": "No."}], "preference")
    n_prompt = len(prompt_ids(tok, record["prompt"]))
    full = {k: reward_sequence_ids(tok, record["prompt"], record[k]) for k in ("chosen", "rejected")}
    reply = {k: full[k][n_prompt:] for k in full}  # the reply's ids and its end-of-turn token
    limit = 100
    assert n_prompt > 3 * limit and len(reply["chosen"]) > len(reply["rejected"]) + 5

    pairs = pair_ids([record], tok, limit)
    chosen, rejected = pairs["chosen_ids"][0], pairs["rejected_ids"][0]
    assert chosen[-len(reply["chosen"]):] == reply["chosen"] and rejected[-len(reply["rejected"]):] == reply["rejected"]
    cut = chosen[: -len(reply["chosen"])]
    assert cut == rejected[: -len(reply["rejected"])]  # one cut prompt under both replies
    assert limit - 6 <= len(chosen) <= limit  # the longer reply uses the budget, nearly all of it
    text, full_text = (tok.decode(ids, clean_up_tokenization_spaces=False) for ids in (cut, full["chosen"][:n_prompt]))
    before_long = full_text[: full_text.index(FIT_LONG)]
    assert FIT_SYSTEM in before_long and text.startswith(before_long + FIT_LONG[:40])  # BOS, system turn, the head
    assert cut[-3:] == full["chosen"][n_prompt - 3:n_prompt]  # the generation prompt's end
    if tok.bos_token_id is not None:  # Llama-3.1, Gemma-3
        assert cut[0] == tok.bos_token_id == full["chosen"][0]

    report = LoadReport(source="s", kind="preference", n_rows=1, n_usable=1)
    [pair] = _fit([record], report, tok, limit, "truncate")
    assert (pair.chosen_ids, pair.rejected_ids, report.n_truncated) == (chosen, rejected, 1)
    report = LoadReport(source="s", kind="preference", n_rows=2, n_usable=2)
    short = dict(record, prompt=[{"role": "user", "content": "Hi"}])
    assert len(_fit([record, short], report, tok, limit, "drop")) == 1 and report.n_dropped == 1


def test_a_reply_too_long_for_any_prompt_keeps_its_end():
    """When the reply alone leaves no room for the prompt's tags, the ids are cut from the left as the
    last resort: the end of the reply and its end-of-turn token, where the score is read, stay."""
    from homerlhf.data.load import normalise
    from homerlhf.data.replies import reward_sequence_ids
    from homerlhf.stages.reward import pair_ids
    from homerlhf.tiny import build_tokenizer

    tok = build_tokenizer()
    [record], _ = normalise([{"prompt": "Tell me about tea.", "chosen": "Tea is good. " * 30, "rejected": "No."}],
                            "preference")
    full = reward_sequence_ids(tok, record["prompt"], record["chosen"])
    pairs = pair_ids([record], tok, 20)
    assert len(full) > 40 and pairs["chosen_ids"][0] == full[-20:]
    assert pairs["rejected_ids"][0] == reward_sequence_ids(tok, record["prompt"], record["rejected"])[-20:]


@pytest.mark.slow
def test_builtin_reward_model_ranks_every_rejected_kind_below_its_clean_reply(demo_rm_dir):
    """Garbling cannot fool the demo's reward model: held-out pairs of each rejected kind (typos in
    the frame or the fact, cut, jumped, spliced, derailed, another topic's fact, rude, dressed up),
    most of them made from their own chosen reply, ranked right kind by kind."""
    from homerlhf.data import builtin
    from homerlhf.stages.builtin import kind_accuracies

    recorded = json.loads((demo_rm_dir / "reward_run.json").read_text())["held_out_accuracy_per_kind"]
    assert set(recorded) == set(builtin.REJECTED_KINDS)
    # the model and so its figures depend on the CPU's kernels: measured 0.78-1.00 on a Xeon (both
    # kernel settings), 0.89-1.00 on an AMD EPYC with the 40% other-topic mix
    assert all(accuracy >= 0.75 for accuracy in recorded.values()), recorded
    assert kind_accuracies(demo_rm_dir) == recorded  # the figures the build wrote are the model's on disk
