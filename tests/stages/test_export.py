"""`homerlhf export policy` on one real tiny PPO run: NF4 policy (real bitsandbytes), the merged HF
model against the trained policy, the GGUFs in real llama.cpp, the card, the Modelfile, the checks.

The policy has hidden size 256 and MLP width 768, so every matrix row splits into llama.cpp's
256-value k-quant blocks and q4_k_m / q5_k_m / q6_k are real k-quants (the fallback of narrower
models: tests/workers/gguf/test_gguf_policy.py).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

from homerlhf.errors import UserError
from tolerances import fp32_bound

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
GGUF_TYPES = ("f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q4_k_m")
# The merged HF model against the trained policy, per token (docs/export.md). The run computed in
# float32 (cpu-tiny), so the default export is float32: the same model up to float32 rounding (the
# adapter's x A^T B^T summed in another order than x (W + B A)^T), bounded as tests/tolerances.py bounds
# another kernel path, for log-probs of up to 20 nats (the held tokens': checked below): 9.2e-4, where
# an AMD EPYC measured 4.9e-7.
LOGP_MAX = 20.0
HF_FP32_TOLERANCE = fp32_bound(LOGP_MAX)
# `--dtype bf16`: bf16 weights and, loaded as `from_pretrained` loads it, bf16 compute.
HF_BF16_TOLERANCE = 2e-2

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
        "rollout.truncation_penalty=null", "rollout.engine=hf"])  # hf: not chosen by this machine's bench figures
    run_ppo(cfg, out_dir=root / "run")
    return root / "run"


@pytest.fixture(scope="module")
def exports(trained_run, tmp_path_factory):
    """The default export (NF4 base, the run's float32, every GGUF type) and a bf16 one through the
    CLI, and one into the original weights."""
    from homerlhf.stages.export import export_policy

    root = tmp_path_factory.mktemp("exports")
    printed = _cli(str(trained_run), "--out", str(root / "policy"), "--gguf", ",".join(GGUF_TYPES[:3]),
                   "--gguf", ",".join(GGUF_TYPES[3:]))
    printed_bf16 = _cli(str(trained_run), "--out", str(root / "policy-bf16"), "--dtype", "bf16")
    original = export_policy(trained_run, root / "original", base="original")
    return {"nf4": root / "policy", "printed": printed, "bf16": root / "policy-bf16", "printed_bf16": printed_bf16,
            "original": Path(original["out"])}


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
    assert max(np.abs(lp).max() for lp in trained["logprobs"] + trained["adapter_off"]) <= LOGP_MAX


def test_default_export_of_a_float32_run_is_the_trained_policy_to_float32_rounding(exports, trained):
    import torch
    from transformers import AutoModelForCausalLM

    from homerlhf.workers.gguf.merge import sequence_logprobs

    out = exports["nf4"]
    merged = AutoModelForCausalLM.from_pretrained(out)  # plain transformers, nothing of ours
    assert merged.dtype == torch.float32
    assert _max_gap(trained["logprobs"], sequence_logprobs(merged, trained["sequences"])) < HF_FP32_TOLERANCE
    result = json.loads((out / "export.json").read_text())
    assert (result["dtype"], result["compute_dtype"], result["rounding"]) == ("float32", "float32", None)
    assert 0 <= result["gap"]["max_abs"] < HF_FP32_TOLERANCE and result["gap"]["tokens"] > 50
    assert "(base nf4, float32; the policy computed in float32)" in exports["printed"]
    assert "the trained policy up to float32 rounding" in exports["printed"]
    assert "rounding costs" not in exports["printed"] + (out / "README.md").read_text()


def test_a_lower_dtype_says_what_its_rounding_costs(exports, trained):
    """`--dtype bf16` of the float32 run: bf16 weights, within bf16 rounding of the policy, and the CLI
    and the card give the gap the export measured as the cost."""
    import torch
    from transformers import AutoModelForCausalLM

    from homerlhf.workers.gguf.merge import sequence_logprobs

    out = exports["bf16"]
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert merged.dtype == torch.bfloat16
    assert _max_gap(trained["logprobs"], sequence_logprobs(merged, trained["sequences"])) < HF_BF16_TOLERANCE
    result = json.loads((out / "export.json").read_text())
    gap = result["gap"]
    assert (result["dtype"], result["compute_dtype"]) == ("bfloat16", "float32")
    assert HF_FP32_TOLERANCE < gap["max_abs"] < HF_BF16_TOLERANCE  # beyond float32's rounding, and bounded
    cost = (f"saved in bfloat16, not the float32 the policy computed in: the rounding costs up to {gap['max_abs']:.2e} "
            f"nats/token (mean {gap['mean_abs']:.2e}) on {gap['tokens']} held tokens; --dtype fp32 exports the policy "
            "as it computed")
    assert result["rounding"] == cost
    assert cost in exports["printed_bf16"].splitlines() and f"- {cost}" in (out / "README.md").read_text()


def test_an_unknown_dtype_is_one_line_and_writes_nothing(trained_run, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        _cli(str(trained_run), "--out", str(tmp_path / "x"), "--dtype", "fp8")
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.splitlines() == [
        "error: --dtype 'fp8' is not known; use fp32, bf16 or fp16, or leave it out for the dtype the policy computed in"]
    assert not (tmp_path / "x").exists()


def test_original_base_reports_its_larger_gap(exports):
    bf16 = json.loads((exports["bf16"] / "export.json").read_text())["gap"]
    original = json.loads((exports["original"] / "export.json").read_text())
    assert original["base"] == "original" and original["rounding"] is None
    assert original["gap"]["max_abs"] > 5 * bf16["max_abs"] and original["gap"]["max_abs"] > HF_BF16_TOLERANCE
    assert "differs from the trained policy" in (exports["original"] / "README.md").read_text()


@functools.cache
def _imports(module: str) -> frozenset[str]:
    """The homerlhf modules ``module`` imports anywhere in its source (``from pkg import sub`` counts
    as importing ``pkg.sub``; TYPE_CHECKING and function-level imports count too)."""
    import ast

    def path_of(name: str) -> Path | None:
        base = ROOT.joinpath(*name.split("."))
        return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)

    path = path_of(module)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets |= {f"{base}.{a.name}" if path_of(f"{base}.{a.name}") else base for a in node.names}
    return frozenset(t for t in targets if t.startswith("homerlhf") and t != module and path_of(t))


def test_no_import_circle_runs_through_the_export_modules():
    """stages/export.py and stages/model_card.py imported each other (the package's one circle); what
    both need is in stages/export_plan.py, below both. A circle through a stages module stays in the
    stages layer (tests/test_layers.py: nothing below imports it), so the walk stays there too."""
    assert "homerlhf.stages.model_card" in _imports("homerlhf.stages.export")  # the walk reads lazy imports
    same_layer = ("homerlhf.stages.", "homerlhf.doctor")
    for start in ("homerlhf.stages.export", "homerlhf.stages.model_card", "homerlhf.stages.export_plan"):
        seen, todo = set(), list(_imports(start))
        while todo:
            module = todo.pop()
            if module not in seen and module.startswith(same_layer):
                seen.add(module)
                todo += _imports(module)
        assert start not in seen, f"{start} imports itself through a circle"


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
    for fragment in ("library_name: transformers", "tags:\n- homerlhf\n- rlhf\n- ppo\n", "- reward: the ",
                     "algorithm: ppo, 2 of 2 iterations", "many_e",
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


def test_the_card_explains_a_kl_below_zero(trained_run, tmp_path):
    """A k1 KL estimate below 0 (the walk of issue 44 saw -0.018 on the card) says why it can be."""
    import shutil

    from homerlhf.stages.export import plan_policy_export
    from homerlhf.stages.model_card import model_card

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    result = {"gap": {"max_abs": 1e-7, "mean_abs": 1e-8, "tokens": 10, "sequences": 2}, "dtype": "float32",
              "compute_dtype": "float32", "stop_tokens": ["<|end|>"], "commands": ["ollama create policy"], "gguf": []}
    for kl, note in ((-0.018, True), (0.018, False)):
        rows[-1]["kl_mean"] = kl
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        card = model_card(plan_policy_export(run, tmp_path / "out", checkpoint="2"), result)
        line = next(line for line in card.splitlines() if line.startswith("- KL to the reference"))
        assert line.startswith(f"- KL to the reference (nats per response) at iteration 2: {kl:.4f}")
        assert line.endswith(" (k1: an unbiased estimate, so one batch's mean can fall below 0; the KL itself "
                             "cannot)") is note
