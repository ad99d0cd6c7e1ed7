"""`homerlhf export policy` on one real tiny PPO run: NF4 policy (real bitsandbytes), the merged HF
model against the trained policy, the GGUFs in real llama.cpp, the card, the Modelfile, the checks.

The policy has hidden size 256 and MLP width 768, so every matrix row splits into llama.cpp's
256-value k-quant blocks and q4_k_m / q5_k_m / q6_k are real k-quants (the fallback of narrower
models: tests/workers/gguf/test_gguf_policy.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

from homerlhf.errors import UserError

DOCS = Path(__file__).resolve().parents[2] / "docs"
GGUF_TYPES = ("f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q4_k_m")
# The merged HF model against the trained policy, per token (docs/export.md): bf16 weights and,
# loaded as `from_pretrained` loads it, bf16 compute.
HF_BF16_TOLERANCE = 2e-2
HF_BF16_WEIGHTS_TOLERANCE = 1e-2  # the same weights computed in float32

SCORE_GGUFS = """
import json, sys
import numpy as np
from llama_cpp import Llama
seqs = json.loads(sys.argv[2]); out = {}
for path in json.loads(sys.argv[1]):
    llm = Llama(path, logits_all=True, n_ctx=256, n_batch=256, n_ubatch=256, n_threads=1, verbose=False)
    rows = []
    for ids in seqs:
        llm.reset()
        llm.eval(ids)
        s = np.array(llm.scores[: len(ids)], dtype=np.float64)
        s -= s.max(-1, keepdims=True)
        logp = s - np.log(np.exp(s).sum(-1, keepdims=True))
        rows.append(logp[np.arange(len(ids) - 1), ids[1:]].tolist())
    out[path] = {"logprobs": rows, "template": llm.metadata.get("tokenizer.chat_template")}
    llm.close()
print(json.dumps(out))
"""


def _cli(*argv: str) -> str:
    from homerlhf.cli import main

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        main(["export", "policy", *argv])
    return buffer.getvalue()


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """Two PPO iterations (checkpoints 1 and 2) at a high actor learning rate, so the adapter moves
    the log-probs by far more than any tolerance below; the reward is a function (no reward model)."""
    from homerlhf.config import load_config
    from homerlhf.stages.ppo import run_ppo
    from homerlhf.tiny import build_causal_lm

    root = tmp_path_factory.mktemp("export-run")
    policy = build_causal_lm(root / "policy", arch="llama", seed=0, hidden=256, layers=2)
    (root / "rewards.py").write_text("def many_e(response):\n    return response.count('e') / 4.0\n")
    cfg = load_config("cpu-tiny", overrides=[
        f"model.name_or_path={policy}", "ref.backend=adapter_off", "reward.backend=function",
        f"reward.function={root / 'rewards.py'}:many_e", "rollout.batch_size=4", "rollout.chunk_size=4",
        "rollout.max_new_tokens=6", "rollout.max_prompt_len=24", "ppo.mini_batch_size=4",
        "ppo.micro_batch_size=4", "ppo.epochs=2", "ppo.iterations=2", "checkpoint.every=1", "checkpoint.keep=2",
        "actor.lr=2e-2", "logging.samples_per_iteration=2", "logging.progress=false",
        "rollout.truncation_penalty=null"])
    run_ppo(cfg, out_dir=root / "run")
    return root / "run"


@pytest.fixture(scope="module")
def exports(trained_run, tmp_path_factory):
    """The default export (NF4 base, every GGUF type) through the CLI, and one into the original weights."""
    from homerlhf.stages.export import export_policy

    root = tmp_path_factory.mktemp("exports")
    printed = _cli(str(trained_run), "--out", str(root / "policy"), "--gguf", ",".join(GGUF_TYPES[:3]),
                   "--gguf", ",".join(GGUF_TYPES[3:]))
    original = export_policy(trained_run, root / "original", base="original")
    return {"nf4": root / "policy", "printed": printed, "original": Path(original["out"])}


@pytest.fixture(scope="module")
def trained(trained_run):
    """Held sequences and the trained policy's log-probs on them, computed as the Evaluate tab loads
    a checkpoint (the run's own 4-bit base + the actor adapter), with the adapter on and off."""
    from peft import PeftModel

    from homerlhf.config import from_yaml_file
    from homerlhf.models.policy import load_base, load_tokenizer
    from homerlhf.workers.gguf.merge import sequence_logprobs

    ckpt = trained_run / "checkpoints" / "iter_000002"
    cfg = from_yaml_file(ckpt / "config.yaml")
    tokenizer = load_tokenizer(cfg.model.name_or_path)
    chats = [[{"role": "user", "content": "What is the weather like?"}, {"role": "assistant", "content": "Sunny, I hope."}],
             [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "An apple."}]]
    sequences = [tokenizer.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"] for c in chats]
    rng = np.random.default_rng(0)
    sequences.append([2] + rng.integers(7, len(tokenizer), size=40).tolist())  # ids no template would make
    model = PeftModel.from_pretrained(load_base(cfg.model.name_or_path, cfg), str(ckpt / "actor"), adapter_name="actor")
    model.eval()
    on = sequence_logprobs(model, sequences)
    with model.disable_adapter():
        off = sequence_logprobs(model, sequences)
    return {"sequences": sequences, "logprobs": on, "adapter_off": off, "tokenizer": tokenizer}


def _max_gap(a, b) -> float:
    return float(max(np.abs(x - y).max() for x, y in zip(a, b)))


def gguf_tolerances() -> dict[str, float]:
    """The per-type bounds docs/workers.md states for an exported policy's GGUF."""
    text = (DOCS / "workers.md").read_text()
    section = text.split("## An exported policy's GGUF", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^\| `(\w+)` \| ([0-9.e+-]+) \|", section, re.M)}


def test_the_adapter_matters_so_the_comparisons_below_can_fail(trained):
    assert _max_gap(trained["logprobs"], trained["adapter_off"]) > 50 * HF_BF16_TOLERANCE


def test_merged_dir_is_the_trained_policy_within_bf16_rounding(exports, trained):
    import torch
    from transformers import AutoModelForCausalLM

    from homerlhf.workers.gguf.merge import sequence_logprobs

    out = exports["nf4"]
    merged = AutoModelForCausalLM.from_pretrained(out)  # plain transformers, nothing of ours
    assert merged.dtype == torch.bfloat16
    assert _max_gap(trained["logprobs"], sequence_logprobs(merged, trained["sequences"])) < HF_BF16_TOLERANCE
    as_fp32 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert _max_gap(trained["logprobs"], sequence_logprobs(as_fp32, trained["sequences"])) < HF_BF16_WEIGHTS_TOLERANCE
    reported = json.loads((out / "export.json").read_text())["gap"]
    assert 0 < reported["max_abs"] < HF_BF16_TOLERANCE and reported["tokens"] > 50
    assert "the trained policy up to rounding" in exports["printed"]


def test_original_base_reports_its_larger_gap(exports):
    nf4 = json.loads((exports["nf4"] / "export.json").read_text())["gap"]
    original = json.loads((exports["original"] / "export.json").read_text())
    assert original["base"] == "original"
    assert original["gap"]["max_abs"] > 5 * nf4["max_abs"] and original["gap"]["max_abs"] > HF_BF16_TOLERANCE
    assert "differs from the trained policy" in (exports["original"] / "README.md").read_text()


def test_gguf_logprobs_within_the_documented_tolerance_per_type(exports, trained):
    from homerlhf.doctor import run_child

    tolerances = gguf_tolerances()
    assert set(GGUF_TYPES) <= set(tolerances)
    paths = {t: exports["nf4"] / "gguf" / f"policy-{t}.gguf" for t in GGUF_TYPES}
    scored = run_child(SCORE_GGUFS, json.dumps([str(p) for p in paths.values()]),
                       json.dumps(trained["sequences"]), timeout=600)
    template = trained["tokenizer"].chat_template
    for outtype, path in paths.items():
        got = [np.array(row) for row in scored[str(path)]["logprobs"]]
        assert _max_gap(trained["logprobs"], got) < tolerances[outtype], outtype
        assert scored[str(path)]["template"] == template, outtype  # tokenizer.chat_template metadata
    types = json.loads((exports["nf4"] / "export.json").read_text())["gguf"]
    assert "Q4_K" in types[GGUF_TYPES.index("q4_k_m")]["tensors"]  # real k-quants: no fallback at this shape


def test_files_card_generation_config_and_modelfile(exports, trained_run):
    from transformers import AutoTokenizer

    out = exports["nf4"]
    result = json.loads((out / "export.json").read_text())
    for rel in result["files"]:
        assert (out / rel).is_file(), rel
    assert not list(out.parent.glob(".policy.tmp-*"))
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(trained_run.parent / "policy").chat_template
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|end|>")
    modelfile = (out / "gguf" / "Modelfile.q4_k_m").read_text()
    assert modelfile.startswith("FROM ./policy-q4_k_m.gguf\n") and 'PARAMETER stop "<|end|>"' in modelfile
    assert "TEMPLATE" not in modelfile.replace("No TEMPLATE", "")
    card = (out / "README.md").read_text()
    last = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()][-1]
    for fragment in ("library_name: transformers", "algorithm: ppo, 2 of 2 iterations", "many_e",
                     f"{last['score_mean']:.4f}", f"{last['kl_mean']:.4f}", "ollama create policy"):
        assert fragment in card, fragment


def test_checkpoint_by_number_last_and_best(trained_run):
    from homerlhf.stages.export import resolve_checkpoint

    rows = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    best = max(rows, key=lambda r: (r["score_mean"], r["iteration"]))["iteration"]
    assert resolve_checkpoint(trained_run, "1").name == "iter_000001"
    assert resolve_checkpoint(trained_run, "last").name == "iter_000002"
    assert resolve_checkpoint(trained_run, "best").name == f"iter_{best:06d}"
    with pytest.raises(UserError, match="has no complete checkpoint of that iteration; it has 1, 2"):
        resolve_checkpoint(trained_run, "7")


def test_last_never_passes_over_a_newest_checkpoint_whose_manifest_is_gone(trained_run, tmp_path):
    """Checkpoints are renamed into place once sealed, so an iter_ folder without a readable manifest
    was damaged since: `last` is that one, refused in one line, not the older one in silence."""
    import shutil

    from homerlhf.stages.export import resolve_checkpoint, verify_policy_files

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    damaged = run / "checkpoints" / "iter_000003"
    shutil.copytree(run / "checkpoints" / "iter_000002", damaged)
    (damaged / "MANIFEST.json").unlink()
    assert resolve_checkpoint(run, "last") == damaged
    with pytest.raises(UserError) as info:
        verify_policy_files(damaged)
    assert str(info.value) == (f"checkpoint {damaged}: MANIFEST.json is missing or unreadable (not a finished "
                               "checkpoint); export iter_000002 instead with --checkpoint 2")


def test_overwrite_replaces_only_when_asked_and_a_failure_keeps_the_old_export(exports, trained_run, monkeypatch):
    from homerlhf.stages import export as E

    out = exports["original"]
    before = (out / "export.json").read_bytes()
    with pytest.raises(UserError, match="already exists and is not empty; pass --overwrite"):
        E.plan_policy_export(trained_run, out, base="original")
    with pytest.raises(UserError, match="holds the run"):
        E.plan_policy_export(trained_run, trained_run.parent, overwrite=True)

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr("homerlhf.workers.gguf.merge.write_model_files", broken)  # after the weights are written
    with pytest.raises(RuntimeError, match="disk full"):
        E.export_policy(trained_run, out, base="original", overwrite=True)
    assert (out / "export.json").read_bytes() == before
    assert not list(out.parent.glob(f".{out.name}.*"))


def test_push_to_hub_needs_a_login_and_the_network(trained_run, tmp_path, monkeypatch):
    from homerlhf.stages.export import plan_policy_export

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(UserError, match="no Hugging Face login; run `hf auth login` or set HF_TOKEN"):
        plan_policy_export(trained_run, tmp_path / "x", push_to_hub="me/policy")
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="HF_HUB_OFFLINE is set"):
        plan_policy_export(trained_run, tmp_path / "x", push_to_hub="me/policy")
    with pytest.raises(UserError, match="is not a Hub repo id"):
        plan_policy_export(trained_run, tmp_path / "x", push_to_hub="a/b/c")
    with pytest.raises(UserError, match="--private makes sense only with --push-to-hub"):
        plan_policy_export(trained_run, tmp_path / "x", private=True)
    assert not (tmp_path / "x").exists()


def _flip_byte(path: Path) -> None:
    """One byte changed in place, the size kept: what no size check sees."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_changed_or_cut_actor_adapter_is_refused_before_any_weight_loads(trained_run, tmp_path, capsys, monkeypatch):
    """A byte flipped (same size) in the newest checkpoint's actor: one stderr line naming the file and
    the checkpoint to export instead, exit 2, nothing loaded or written. In a copy: the run is shared."""
    import shutil

    from homerlhf.stages.export import plan_policy_export

    run, out = tmp_path / "run", tmp_path / "out"
    shutil.copytree(trained_run, run)
    newest = run / "checkpoints" / "iter_000002"
    adapter = newest / "actor" / "adapter_model.safetensors"
    _flip_byte(adapter)
    loaded = []
    monkeypatch.setattr("homerlhf.workers.gguf.merge.load_trained_policy", lambda *a, **k: loaded.append(a))

    def refused(*argv: str) -> list[str]:
        with pytest.raises(SystemExit) as info:
            _cli(str(run), "--out", str(out), *argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and "Traceback" not in err
        return err.splitlines()

    assert refused() == [f"error: checkpoint {newest}: actor/adapter_model.safetensors does not match its MANIFEST.json "
                         "sha256 (changed after it was written); export iter_000001 instead with --checkpoint 1"]
    assert loaded == [] and not out.exists()
    assert plan_policy_export(run, out, checkpoint="1").checkpoint.name == "iter_000001"  # the fallback is sound

    adapter.write_bytes(adapter.read_bytes()[:100])  # cut short: named too, not "no complete checkpoint"
    [line] = refused("--checkpoint", "2")
    assert line.startswith(f"error: checkpoint {newest}: actor/adapter_model.safetensors is 100 bytes, its "
                           "MANIFEST.json says ") and line.endswith("export iter_000001 instead with --checkpoint 1")
    _flip_byte(run / "checkpoints" / "iter_000001" / "actor" / "adapter_model.safetensors")
    [line] = refused()
    assert line.endswith("no earlier checkpoint's actor is intact: restore the file from a backup, or train again")
    assert loaded == [] and not out.exists()
