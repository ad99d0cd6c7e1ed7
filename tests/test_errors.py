"""The bad-input edge: every row of docs/errors.md, through the real CLI or the real HTTP worker. A
CLI row must exit with the documented code, print exactly one stderr line starting with ``error:``
that holds the documented fragment, and never a traceback; a worker row must answer the documented
4xx with the fragment in ``detail`` and keep serving.

A CLI row calls ``homerlhf.cli.main`` in this process, seen as a fresh ``python -m homerlhf.cli``
would be (``run_in_process``); the few rows in SUBPROCESS_ROWS run in one (``run_cli``).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"

# (id, argv with {tmp}/{gguf}/{port} placeholders, exit code, fragment of the one stderr line)
CLI_CASES = [
    ("unknown-preset", ["train", "--preset", "nope"], 2, "unknown preset 'nope'; choose one of:"),
    ("config-file-missing", ["train", "--config", "{tmp}/missing.yaml"], 2, "config file not found:"),
    ("config-file-bad-yaml", ["train", "--config", "{tmp}/bad.yaml"], 2, "is not valid YAML at line 2: fix the syntax"),
    ("config-file-not-mapping", ["train", "--config", "{tmp}/list.yaml"], 2, "must be a mapping of keys to values, got list"),
    ("config-file-unknown-key", ["train", "--config", "{tmp}/typo.yaml"], 2, "unknown config key 'ppo.klcoef' (check spelling"),
    ("set-without-equals", ["train", "--set", "ppo.kl_coef"], 2, "must look like section.key=value"),
    ("set-unknown-key", ["train", "--set", "ppo.foo=1"], 2, "unknown config key 'ppo.foo'"),
    ("set-wrong-type", ["train", "--set", "ppo.kl_coef=abc"], 2, "config key 'ppo.kl_coef': got 'abc'; input should be a valid number"),
    ("set-out-of-range", ["train", "--set", "rollout.batch_size=0"], 2, "config key 'rollout.batch_size': got 0; input should be greater than or equal to 1"),
    ("set-bad-choice", ["train", "--set", "ppo.kl_estimator=k2"], 2, "got 'k2'; input should be 'k1' or 'k3'"),
    ("minibatch-over-batch", ["train", "--set", "ppo.mini_batch_size=64"], 2, "ppo.mini_batch_size (64) must be <= rollout.batch_size (32)"),
    ("minibatch-not-multiple", ["train", "--set", "ppo.micro_batch_size=5"], 2, "must be a multiple of ppo.micro_batch_size (5)"),
    ("upcast-with-fsdp", ["plan", "--preset", "4090", "--set", "distributed.fsdp=true", "--set",
                          "quant.upcast_non_quantized=true"], 2, "set quant.upcast_non_quantized=false with distributed.fsdp"),
    ("offload-without-checkpointing", ["plan", "--preset", "4090", "--set", "training.gradient_checkpointing=false", "--set",
                                       "training.activation_offload=true"], 2, "set training.gradient_checkpointing=true, or leave them at 1/false"),
    ("ref-backend-hf", ["train", "--set", "ref.backend=hf"], 2, "ref.backend 'hf' is not available; use 'llamacpp', 'adapter_off' or 'auto'"),
    ("reward-backend-adapter-off", ["train", "--set", "reward.backend=adapter_off"], 2, "reward.backend 'adapter_off' makes no sense"),
    ("reward-model-missing", ["train", "--set", "reward.model=null"], 2, "reward.model is required"),
    ("reward-function-without-backend", ["train", "--set", "reward.function=rewards.py:score"], 2, "reward.function is set but reward.backend is 'llamacpp'; set reward.backend=function"),
    ("nonfinite-limit-zero", ["train", "--set", "training.max_nonfinite_steps=0"], 2, "config key 'training.max_nonfinite_steps': got 0"),
    ("rollout-top-p", ["train", "--set", "rollout.top_p=0.9"], 2, "training rollouts must sample the full distribution"),
    ("gpu-preset-without-gpu", ["train", "--preset", "4090"], 2, "needs a CUDA GPU (RTX 4090) and none is visible; use --preset cpu-tiny"),
    ("unknown-option", ["train", "--bogus"], 2, "No such option: --bogus"),
    ("unknown-command", ["bogus"], 2, "No such command 'bogus'"),
    ("plan-gpu-gib-zero", ["plan", "--gpu-gib", "0"], 2, "--gpu-gib must be > 0, got 0"),
    ("plan-model-missing", ["plan", "--model", "{tmp}/nomodel"], 2, "not a local model dir, not in the hub cache, not in the builtin table"),
    ("plan-plot-folder-missing", ["plan", "--plot", "{tmp}/no/such/dir/plan.png"], 2, "does not exist; create it or pick another path"),
    ("plan-calibration-missing", ["plan", "--calibration", "{tmp}/none.json"], 2, "no such file; give the JSON report `homerlhf check` wrote"),
    ("plan-calibration-not-json", ["plan", "--calibration", "{tmp}/bad.yaml"], 2, "not JSON (Expecting value: line 1 column 1 (char 0)); give the report `homerlhf check` wrote"),
    ("plan-calibration-other-card", ["plan", "--preset", "3090", "--calibration", "{report}"], 2, "measured on NVIDIA GeForce RTX 4090, not the plan's RTX 3090 (24 GiB); plan with that card's preset, or run `homerlhf check` on this card"),
    ("plan-algorithm-unknown", ["plan", "--algorithm", "sft"], 2, "--algorithm 'sft': choose one of ppo, grpo, rloo, dpo, kto"),
    ("dpo-too-few-pairs", ["dpo", "--data", "{tmp}/pairs3.jsonl", "--out", "{tmp}/p1"], 2, "pairs3.jsonl gave 3 usable for training after the held-out split: collect more, or lower dpo.min_rows"),
    ("dpo-identical-answers", ["dpo", "--data", "{tmp}/same.jsonl", "--out", "{tmp}/p2"], 2, "same.jsonl (2 bad; first: chosen == rejected)"),
    ("dpo-unknown-columns", ["dpo", "--data", "{tmp}/nocol.jsonl", "--out", "{tmp}/p3"], 2, "no chosen/rejected columns among ['foo']; set data.chosen_column and data.rejected_column"),
    ("kto-unknown-columns", ["kto", "--data", "{tmp}/nocol.jsonl", "--out", "{tmp}/p4"], 2, "no answer and rating columns among ['foo']"),
    ("kto-bad-ratings", ["kto", "--data", "{tmp}/badlabel.jsonl", "--out", "{tmp}/p5"], 2, "first: label 'maybe' is not a rating; use true/false, 1/0/-1, up/down or good/bad"),
    ("dpo-prompt-over-length", ["dpo", "--model", "{tiny}", "--data", "{tmp}/pairs6.jsonl", "--set", "dpo.max_len=8", "--out", "{tmp}/p6"], 2, "fits dpo.max_len=8 tokens (data.overlong=truncate): raise dpo.max_len or shorten the prompts"),
    ("dpo-start-run-without-checkpoint", ["dpo", "--model", "{tmp}/oldrun", "--out", "{tmp}/p7"], 2, "neither a model dir (config.json), an SFT run (model/), nor a run with checkpoints"),
    ("dpo-resume-a-ppo-run", ["dpo", "--resume", "{tmp}/ckptrun"], 2, "is not a dpo/kto checkpoint (no start.json); resume a PPO run with `homerlhf train --resume`"),
    ("demo-method-unknown", ["demo", "--method", "orpo", "--out", "{tmp}/p8"], 2, "demo --method 'orpo': choose dpo or kto"),
    ("check-unknown-preset", ["check", "--preset", "nope"], 2, "--preset 'nope' is not a GPU preset; choose one of: 3060-12g, 3090, 4060ti-16g, 4080, 4090, a100-80g, t4-colab"),
    ("check-out-exists", ["check", "--out", "{tmp}/list.yaml"], 2, "list.yaml already exists; pass --overwrite to replace it or choose another --out"),
    ("config-file-is-a-dir", ["train", "--config", "{tmp}/empty"], 2, "cannot read config file"),
    ("option-not-a-number", ["worker", "--role", "ref", "--model", "{gguf}", "--port", "abc"], 2, "Invalid value for '--port'"),
    ("worker-unknown-role", ["worker", "--role", "critic", "--model", "{gguf}"], 2, "--role 'critic' is not known; use ref or reward"),
    ("worker-public-bind-no-token", ["worker", "--role", "ref", "--model", "{gguf}", "--host", "0.0.0.0"], 2, "refusing to bind 0.0.0.0 without a token"),
    ("worker-token-in-argv", ["worker", "--role", "ref", "--model", "{gguf}", "--token", "s3cret"], 2, "--token puts the secret in the process list; set HOMERLHF_WORKER_TOKEN"),
    ("worker-token-file-shared", ["worker", "--role", "ref", "--model", "{gguf}", "--token-file", "{tmp}/shared.token"], 2, "is readable by others (mode 0644); run `chmod 600"),
    ("worker-model-missing", ["worker", "--role", "ref", "--model", "{tmp}/none.gguf"], 2, "does not exist; export it first (homerlhf export ref)"),
    ("worker-ref-model-is-dir", ["worker", "--role", "ref", "--model", "{tmp}"], 2, "is a directory; the ref worker takes a .gguf file"),
    ("worker-not-a-gguf", ["worker", "--role", "ref", "--model", "{tmp}/fake.gguf"], 2, "is not a readable GGUF file"),
    ("worker-reward-dir-no-manifest", ["worker", "--role", "reward", "--model", "{tmp}/empty"], 2, "is not an exported reward dir (no manifest.json)"),
    ("worker-ctx-too-small", ["worker", "--role", "ref", "--model", "{gguf}", "--ctx", "1"], 2, "--ctx 1 is too small; use at least 2"),
    ("worker-port-in-use", ["worker", "--role", "ref", "--model", "{gguf}", "--ctx", "64", "--batch-tokens", "64", "--port", "{port}"], 2, "pick another --port (0: any free one)"),
    ("export-model-missing", ["export", "ref", "--model", "{tmp}/nomodel", "--out", "{tmp}/x.gguf"], 2, "does not exist; check the path"),
    ("export-bad-outtype", ["export", "ref", "--model", "{tmp}/nomodel", "--out", "{tmp}/x.gguf", "--outtype", "q4"], 2, "outtype 'q4' is not supported; use one of f32, f16, bf16, q8_0"),
    ("export-not-a-model-dir", ["export", "ref", "--model", "{tmp}", "--out", "{tmp}/x.gguf"], 2, "has no config.json; pass a HF model directory"),
    ("export-arch-unsupported", ["export", "ref", "--model", "{tmp}/gpt2", "--out", "{tmp}/x.gguf"], 2, "architecture 'gpt2' is not supported for GGUF export; supported: gemma2, gemma3_text, llama, mistral, phi3, qwen2, qwen3"),
]

# `homerlhf train` and the run directory: {tmp}/oldrun holds a run without checkpoints,
# {tmp}/ckptrun one with a complete checkpoint of the cpu-tiny config (LoRA r=8), {tmp}/flippedrun one
# whose newest checkpoint's actor adapter changed after it was written.
TRAIN_CASES = [
    ("train-over-existing-run", ["train", "--out", "{tmp}/oldrun"], 2, "already holds a run; pass --resume"),
    ("resume-no-such-dir", ["train", "--resume", "{tmp}/nothere"], 2, "no such run directory; give the --out of an earlier run"),
    ("resume-no-checkpoint", ["train", "--resume", "{tmp}/oldrun"], 2, "the run has no complete checkpoint yet"),
    ("resume-other-lora-rank", ["train", "--resume", "{tmp}/ckptrun", "--set", "actor.lora.r=4"], 2, "config key 'actor.lora.r' differs from the checkpoint's (8 there, 4 now)"),
    ("resume-other-model", ["train", "--resume", "{tmp}/ckptrun", "--set", "model.name_or_path=org/other"], 2, "config key 'model.name_or_path' differs from the checkpoint's"),
    ("resume-other-preset-model", ["train", "--resume", "{tmp}/ckptrun", "--preset", "3090"], 2, "config key 'model.name_or_path' differs"),
    ("resume-and-overwrite", ["train", "--resume", "{tmp}/ckptrun", "--overwrite"], 2, "pass only one of them"),
    ("resume-with-other-out", ["train", "--resume", "{tmp}/ckptrun", "--out", "{tmp}/elsewhere"], 2, "drop --out"),
    ("resume-checkpoint-changed", ["train", "--resume", "{tmp}/flippedrun"], 2, "iter_000002: actor/adapter_model.safetensors does not match its MANIFEST.json sha256 (changed after it was written); move it out of the way"),
    ("sft-over-existing-run", ["sft", "--out", "{tmp}/oldsft"], 2, "oldsft already holds a run; pass --overwrite or choose another --out"),
    ("reward-over-existing-run", ["reward", "--out", "{tmp}/oldsft"], 2, "oldsft already holds a run; pass --overwrite or choose another --out"),
    ("model-path-missing", ["train", "--set", "model.name_or_path={tmp}/nomodel", "--out", "{tmp}/r-model"], 2, "does not exist (check the path, or give a hub id)"),
    ("builtin-model-unknown", ["train", "--set", "model.name_or_path=builtin:nope", "--out", "{tmp}/r-builtin"], 2, "unknown builtin model 'builtin:nope'; choose one of"),
    ("dataset-file-missing", ["train", "--set", "model.name_or_path={tiny}", "--set", "data.prompts={tmp}/none.jsonl", "--out", "{tmp}/r-data1"], 2, "dataset file not found:"),
    ("dataset-unknown-builtin", ["train", "--set", "model.name_or_path={tiny}", "--set", "data.prompts=builtin:nope", "--out", "{tmp}/r-data2"], 2, "unknown builtin dataset 'builtin:nope'; choose one of"),
    ("dataset-no-prompt-column", ["train", "--set", "model.name_or_path={tiny}", "--set", "data.prompts={tmp}/nocol.jsonl", "--out", "{tmp}/r-data3"], 2, "cannot find prompts among columns ['foo']; set data.prompt_column"),
    ("dataset-not-json", ["train", "--set", "model.name_or_path={tiny}", "--set", "data.prompts={tmp}/garbage.jsonl", "--out", "{tmp}/r-data4"], 2, "has no rows; check the file or split"),
    ("train-gpu-preset-no-data", ["train", "--preset", "4090", "--model", "{tiny}", "--out", "{tmp}/r-data5"], 2, "no prompts to train on: pass --data PROMPTS (a .jsonl, .json, .csv or .parquet file, a folder of them or a hub id; docs/data.md), or set data.prompts"),
    ("train-data-missing", ["train", "--data", "{tmp}/none.jsonl", "--out", "{tmp}/r-data6"], 2, "dataset file not found:"),
    ("train-data-empty", ["train", "--data", "{tmp}/blank.jsonl", "--out", "{tmp}/r-data7"], 2, "blank.jsonl: no JSON rows found (one object per line, or a list of objects)"),
    ("train-data-pairs", ["train", "--data", "{tmp}/pairs3.jsonl", "--out", "{tmp}/r-data8"], 2, "pairs3.jsonl holds preference pairs (chosen, rejected), not prompts: give it to `homerlhf reward` (or dpo, kto) and `train --data` a prompts file; to train on the pairs' prompts, set data.prompts_from_pairs=true"),
    ("arch-ref-unsupported", ["train", "--set", "model.name_or_path={tmp}/gpt2", "--out", "{tmp}/r-arch1"], 2, "architecture 'gpt2' cannot be served by the llama.cpp ref worker"),
    ("arch-reward-unsupported", ["train", "--set", "reward.model={tmp}/gpt2-rm", "--out", "{tmp}/r-arch2"], 2, "architecture 'gpt2' cannot be served by the llama.cpp reward worker"),
    ("arch-remote-code", ["train", "--set", "model.name_or_path={tmp}/internlm2", "--out", "{tmp}/r-arch3"], 2, "architecture 'internlm2' is not in transformers"),
    ("arch-sliding-window", ["train", "--set", "model.name_or_path={tmp}/mistral-window", "--out", "{tmp}/r-arch4"], 2, "sliding window of 32 tokens is not applied by llama.cpp's llama graph"),
    ("reward-arch-no-export", ["reward", "--set", "model.name_or_path={tmp}/gpt2", "--out", "{tmp}/r-arch5"], 2, "set rm.export_gguf=false and use the reward model with reward.backend=hf"),
    ("ref-gguf-missing", ["train", "--set", "ref.model={tmp}/none.gguf", "--out", "{tmp}/r-gguf1"], 2, "does not exist; give an existing .gguf file"),
    ("policy-gguf-not-causal", ["train", "--set", "model.name_or_path={tmp}/lora.gguf", "--out", "{tmp}/r-gguf2"], 2, "this GGUF is a LoRA adapter (general.type 'adapter', architecture 'llama'), not a causal language model; give the base model's .gguf or its HF directory"),
    ("policy-no-chat-template", ["train", "--set", "model.name_or_path={tmp}/notemplate", "--out", "{tmp}/r-tmpl"], 2, "notemplate's tokenizer has no chat template ("),
    ("dpo-no-chat-template", ["dpo", "--model", "{tmp}/notemplate", "--data", "{tmp}/pairs6.jsonl", "--out", "{tmp}/p9"], 2, "notemplate's tokenizer has no chat template"),
    ("policy-over-memory", ["train", "--set", "model.name_or_path={tmp}/huge", "--out", "{tmp}/r-huge"], 2, "does not fit this machine's memory by the plan"),
    ("reward-function-file-missing", ["train", "--set", "reward.backend=function", "--set", "reward.function={tmp}/none.py:score", "--out", "{tmp}/r-fn1"], 2, "none.py not found (give path/to/file.py:function_name, the path relative to the working directory)"),
    ("reward-function-missing", ["train", "--set", "reward.backend=function", "--set", "reward.function={tmp}/rewards.py:nope", "--out", "{tmp}/r-fn2"], 2, "rewards.py has no function 'nope' (it defines: loud, wants_x)"),
    ("reward-function-bad-parameter", ["train", "--set", "reward.backend=function", "--set", "reward.function={tmp}/rewards.py:wants_x", "--out", "{tmp}/r-fn3"], 2, "rewards.py:wants_x takes parameter 'x'; a reward function takes some of prompt, response, prompt_ids, response_ids, row"),
    ("reward-function-component-missing", ["train", "--set", "reward.components=[{{backend: function, function: '{tmp}/none.py:score'}}]", "--out", "{tmp}/r-fn4"], 2, "reward.components[0].function: file "),
    ("ref-gguf-other-vocab", ["train", "--set", "model.name_or_path={tiny}", "--set", "ref.model={tmp}/vocab400.gguf", "--out", "{tmp}/r-gguf2"], 2, "has 400 tokens but the policy's embedding 512"),
    ("export-policy-no-run", ["export", "policy", "{tmp}/nothere", "--out", "{tmp}/e1"], 2, "no such run directory; give the --out of a `homerlhf train` run"),
    ("export-policy-no-actor", ["export", "policy", "{tmp}/ckptrun", "--out", "{tmp}/e2"], 2, "has no actor adapter (actor/adapter_model.safetensors)"),
    ("export-policy-no-such-checkpoint", ["export", "policy", "{tmp}/ckptrun", "--checkpoint", "7", "--out", "{tmp}/e3"], 2, "has no complete checkpoint of that iteration; it has 2 (or pass last or best)"),
    ("export-policy-out-exists", ["export", "policy", "{tmp}/ckptrun", "--out", "{tmp}/oldsft"], 2, "already exists and is not empty; pass --overwrite to replace it"),
    ("export-policy-arch-gguf", ["export", "policy", "{tmp}/gpt2run", "--out", "{tmp}/e4", "--gguf", "f16"], 2, "gpt2: architecture 'gpt2' is not supported for GGUF export"),
    ("export-policy-bad-gguf-type", ["export", "policy", "{tmp}/gpt2run", "--out", "{tmp}/e5", "--gguf", "q3"], 2, "--gguf 'q3' is not a type homerlhf exports; use one of f32, f16, bf16, q8_0, q6_k, q5_k_m, q4_k_m"),
    ("export-policy-bad-dtype", ["export", "policy", "{tmp}/gpt2run", "--out", "{tmp}/e8", "--dtype", "fp8"], 2, "--dtype 'fp8' is not known; use fp32, bf16 or fp16, or leave it out for the dtype the policy computed in"),
    ("export-policy-checkpoint-changed", ["export", "policy", "{tmp}/flippedrun", "--out", "{tmp}/e7"], 2, "iter_000002: actor/adapter_model.safetensors does not match its MANIFEST.json sha256 (changed after it was written); export iter_000001 instead with --checkpoint 1"),
    ("export-policy-no-hub-login", ["export", "policy", "{tmp}/gpt2run", "--out", "{tmp}/e6", "--push-to-hub", "me/policy"], 2, "no Hugging Face login; run `hf auth login` or set HF_TOKEN"),
]
SNAPSHOTS = ("oldrun", "ckptrun", "oldsft", "gpt2run", "flippedrun")  # earlier runs and outputs no bad input may touch

# The rows that still run in a fresh interpreter, and why: what they check is fixed once per process,
# or they load llama.cpp and bind a server. The others prove as much in this process.
SUBPROCESS_ROWS = {
    "gpu-preset-without-gpu": "CUDA_VISIBLE_DEVICES='' hides a GPU only from a process yet to initialise CUDA",
    "export-policy-no-hub-login": "huggingface_hub looks for a saved login under HF_HOME, read when it is imported",
    "worker-port-in-use": "loads the GGUF into llama.cpp (a process-wide backend and log callback), then binds",
}
# Variables of _env an in-process row leaves as they are: read once per process (torch, huggingface_hub
# and datasets read them at import: setting them here would change later tests) or meaningless in it.
READ_ONCE = {"CUDA_VISIBLE_DEVICES", "HF_HOME", "PYTHONUNBUFFERED"}

# (id, method path, body or raw bytes, token, status, fragment of detail)
HTTP_CASES = [
    ("http-no-sequences", "/logprobs", {"sequences": []}, "secret", 422, "at least 1"),
    ("http-token-outside-vocab", "/logprobs", {"sequences": [{"prompt_ids": [2, 3], "response_ids": [4, 99999]}]}, "secret", 400, "outside the vocabulary"),
    ("http-over-context", "/logprobs", {"sequences": [{"prompt_ids": list(range(3, 40)), "response_ids": list(range(3, 20))}]}, "secret", 400, "exceed the worker context"),
    ("http-wrong-endpoint", "/score", {"sequences": [{"prompt_ids": [2], "response_ids": [4]}]}, "secret", 400, "POST /logprobs"),
    ("http-missing-field", "/logprobs", {"sequences": [{"prompt_ids": [2]}]}, "secret", 422, "malformed request"),
    ("http-not-json", "/logprobs", b"not json", "secret", 422, "malformed request"),
    ("http-wrong-token", "/logprobs", {"sequences": [{"prompt_ids": [2], "response_ids": [4]}]}, "wrong", 401, "missing or wrong bearer token"),
]


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ, HOMERLHF_CACHE=str(tmp / "cache"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", HF_HOME=str(tmp / "hf-home"))  # no Hub login
    env.pop("HF_TOKEN", None)
    return env


def run_cli(argv: list[str], tmp: Path, timeout: float = 300, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "homerlhf.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env or _env(tmp), cwd=tmp)


def run_in_process(argv: list[str], tmp: Path) -> subprocess.CompletedProcess:
    """``run_cli`` without the fresh interpreter: ``homerlhf.cli.main(argv)`` here, in ``tmp`` with the
    variables of ``_env`` but READ_ONCE; stdout, stderr and exit code as a fresh process would have them."""
    import uvicorn

    from homerlhf.cli import main

    # A worker row that got as far as serving would serve here for good: make that a traceback instead.
    no_server = mock.patch.object(uvicorn.Server, "run", side_effect=AssertionError("a bad-input row started serving"))
    with _row_env(tmp), no_server, _fresh_output() as output, _fresh_warnings():
        code = _exit_code(main, argv)
    return subprocess.CompletedProcess(["homerlhf", *argv], code, *output)


def _exit_code(main, argv: list[str]) -> int:
    """The exit code of ``main(argv)`` run as a program; an exception it lets out is printed as the
    interpreter prints it (the traceback check_one_line refuses)."""
    try:
        main(argv)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except Exception:  # noqa: BLE001 - the interpreter's last resort
        traceback.print_exc()
        return 1
    return 0


@contextlib.contextmanager
def _row_env(tmp: Path):
    """cwd ``tmp`` and the environment of ``_env(tmp)`` but READ_ONCE, for the block."""
    env = _env(tmp)
    keys = {key for key in env.keys() | os.environ.keys() if env.get(key) != os.environ.get(key)} - READ_ONCE
    saved, cwd = {key: os.environ.get(key) for key in keys}, os.getcwd()
    _set_env({key: env.get(key) for key in keys})
    os.chdir(tmp)
    try:
        yield
    finally:
        os.chdir(cwd)
        _set_env(saved)


def _set_env(values: dict[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@contextlib.contextmanager
def _fresh_output():
    """What the block writes, as a fresh process's stdout and stderr pipes would hold it: fds 1 and 2
    (C code), sys.stdout and sys.stderr, and logging (``_logging_to``). Yields [stdout, stderr],
    filled in when the block ends."""
    files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    streams = [open(f.fileno(), "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)
               for f in files]
    before, fds, output = (sys.stdout, sys.stderr), (os.dup(1), os.dup(2)), []
    for stream in (*before, sys.__stdout__, sys.__stderr__):
        stream.flush()
    try:
        for fd, f in zip((1, 2), files):
            os.dup2(f.fileno(), fd)
        sys.stdout, sys.stderr = streams
        with _logging_to(dict(zip(map(id, before), streams))):
            yield output
    finally:
        for stream in (*streams, sys.__stdout__, sys.__stderr__):
            stream.flush()
        sys.stdout, sys.stderr = before
        for fd, saved in zip((1, 2), fds):
            os.dup2(saved, fd)
            os.close(saved)
        for stream, f in zip(streams, files):
            stream.close()
            f.seek(0)
            # Read as text=True reads a pipe: universal newlines.
            output.append(io.TextIOWrapper(f, encoding="utf-8", errors="replace").read())


@contextlib.contextmanager
def _logging_to(stand_ins: dict[int, io.TextIOBase]):
    """Logging as in a fresh process: a handler that writes to a stream of this one (its ``id`` a key
    of ``stand_ins``) writes to the stand-in, and with the root logger's handlers (pytest's) set aside
    a record no handler takes goes to logging.lastResort (WARNING and up, on sys.stderr)."""
    loggers = [logging.root, *(x for x in logging.Logger.manager.loggerDict.values()
                               if isinstance(x, logging.Logger))]
    moved = {h: h.stream for x in loggers for h in x.handlers
             if isinstance(h, logging.StreamHandler) and id(h.stream) in stand_ins}
    root_handlers, root_level = logging.root.handlers[:], logging.root.level
    for handler, stream in moved.items():
        handler.setStream(stand_ins[id(stream)])
    logging.root.handlers.clear()
    logging.root.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logging.root.handlers[:] = root_handlers
        logging.root.setLevel(root_level)
        for handler, stream in moved.items():
            handler.setStream(stream)


@contextlib.contextmanager
def _fresh_warnings():
    """The warning filters of a fresh ``python -m homerlhf.cli`` (its __main__ is homerlhf.cli), each
    warning again once per place, shown on sys.stderr instead of recorded by pytest."""
    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.simplefilter("default")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        warnings.filterwarnings("default", category=DeprecationWarning, module="homerlhf.cli")
        warnings.showwarning = _show_on_stderr
        yield


def _show_on_stderr(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def doc_rows() -> dict[str, str]:
    """id -> the whole table row of docs/errors.md."""
    rows = {}
    for line in DOC.read_text().splitlines():
        match = re.match(r"^\|\s*`([a-z0-9-]+)`\s*\|", line)
        if match:
            rows[match.group(1)] = line
    return rows


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def _fake_checkpoint(run: Path, overrides: tuple[str, ...] = (), actor: bool = False) -> None:
    """A run dir whose newest checkpoint is complete as far as resuming's config check (and, with
    ``actor``, the policy export's checks) reads it: the adapter files hold no weights."""
    from homerlhf.config import load_config, to_yaml
    from homerlhf.ppo.manifest import write_manifest

    ckpt = run / "checkpoints" / "iter_000002"
    ckpt.mkdir(parents=True)
    text = to_yaml(load_config("cpu-tiny", overrides=list(overrides))).encode()
    (ckpt / "config.yaml").write_bytes(text)
    if actor:
        (ckpt / "actor").mkdir()
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            (ckpt / "actor" / name).write_text("not an adapter\n")
    write_manifest(ckpt, 2)  # what the checkpoint writer seals it with
    (run / "config.yaml").write_bytes(text)
    (run / "metrics.jsonl").write_text('{"iteration": 1}\n{"iteration": 2}\n')


def _flipped_run(run: Path) -> None:
    """A run whose checkpoint iter_000002 had one byte of its actor adapter changed after it was written
    (same size), and whose iter_000001 is intact."""
    import shutil

    from homerlhf.ppo.manifest import MANIFEST, write_manifest

    _fake_checkpoint(run, actor=True)
    first = run / "checkpoints" / "iter_000001"
    shutil.copytree(run / "checkpoints" / "iter_000002", first)
    (first / MANIFEST).unlink()
    write_manifest(first, 1)
    (run / "checkpoints" / "iter_000002" / "actor" / "adapter_model.safetensors").write_text("not an adaptor\n")


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_llama_dir):
    """Placeholders of the argv templates: scratch dir, a real tiny GGUF, the tiny model, runs."""
    from homerlhf.workers.gguf import export_ref

    tmp = tmp_path_factory.mktemp("bad-inputs")
    (tmp / "bad.yaml").write_text("ppo: [1, 2\n")
    (tmp / "list.yaml").write_text("- 1\n- 2\n")
    (tmp / "typo.yaml").write_text("ppo: {klcoef: 0.1}\n")
    (tmp / "fake.gguf").write_text("not a gguf\n")
    (tmp / "nocol.jsonl").write_text('{"foo": 1}\n{"foo": 2}\n')
    (tmp / "garbage.jsonl").write_text("garbage\n{{{\n")
    (tmp / "blank.jsonl").write_text("")
    pair = {"prompt": "Tell me about tea.", "chosen": "Tea is made from leaves.", "rejected": "Go away."}
    (tmp / "pairs3.jsonl").write_text(json.dumps(pair) + "\n" + json.dumps(pair) + "\n" + json.dumps(pair) + "\n")
    (tmp / "pairs6.jsonl").write_text((json.dumps(pair) + "\n") * 6)
    (tmp / "same.jsonl").write_text((json.dumps({**pair, "rejected": pair["chosen"]}) + "\n") * 2)
    (tmp / "badlabel.jsonl").write_text((json.dumps({"prompt": "Hi", "completion": "Hello!", "label": "maybe"}) + "\n") * 2)
    (tmp / "rewards.py").write_text("def loud(response, row):\n    return float(row['solution'])\n\n\n"
                                    "def wants_x(response, x):\n    return 0.0\n")  # the reward-function-* rows
    (tmp / "empty").mkdir()
    (tmp / "shared.token").write_text("s3cret\n")
    (tmp / "shared.token").chmod(0o644)
    (tmp / "oldrun").mkdir()
    (tmp / "oldrun" / "config.yaml").write_text("seed: 0\n")
    (tmp / "oldrun" / "metrics.jsonl").write_text('{"iteration": 1}\n')
    _fake_checkpoint(tmp / "ckptrun")
    (tmp / "oldsft" / "model").mkdir(parents=True)  # an SFT / reward run's merged model
    (tmp / "oldsft" / "model" / "config.json").write_text("{}\n")
    gguf = export_ref(str(tiny_llama_dir), tmp / "ref.gguf", outtype="f32")
    _architecture_dirs(tmp)
    _fake_checkpoint(tmp / "gpt2run", (f"model.name_or_path={tmp / 'gpt2'}",), actor=True)  # export-policy-*
    _flipped_run(tmp / "flippedrun")  # *-checkpoint-changed
    report = Path(__file__).resolve().parent / "fixtures" / "check_reports" / "rtx4090_example.json"  # plan-calibration-*
    return {"tmp": tmp, "gguf": Path(gguf), "tiny": Path(tiny_llama_dir), "report": report}


def _architecture_dirs(tmp: Path) -> None:
    """Models the backends cannot serve: config.json (+ tokenizer) and a garbage weights file, so a
    refusal that came after reading weights would be a load error instead of the documented line."""
    from homerlhf.tiny import build_tokenizer, model_config

    def model_dir(name: str, config: dict) -> None:
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps(config))
        (tmp / name / "model.safetensors").write_bytes(b"not weights")
        build_tokenizer().save_pretrained(tmp / name)

    model_dir("gpt2", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 512, "n_embd": 32,
                       "n_layer": 1, "n_head": 4})
    model_dir("gpt2-rm", {"model_type": "gpt2", "architectures": ["GPT2ForSequenceClassification"], "vocab_size": 512})
    model_dir("internlm2", {"model_type": "internlm2", "architectures": ["InternLM2ForCausalLM"],
                            "auto_map": {"AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"}})
    mistral = {k: v for k, v in model_config("mistral", 512).to_dict().items() if k != "transformers_version"}
    model_dir("mistral-window", {**mistral, "sliding_window": 32})
    llama = {k: v for k, v in model_config("llama", 512).to_dict().items() if k != "transformers_version"}
    model_dir("notemplate", llama)
    tok = build_tokenizer()
    tok.chat_template = None
    (tmp / "notemplate" / "chat_template.jinja").unlink(missing_ok=True)
    tok.save_pretrained(tmp / "notemplate")
    # 2,048 layers of width 16,384: petabyte-sized in any dtype, over any machine's RAM by the plan
    model_dir("huge", {**llama, "hidden_size": 16384, "intermediate_size": 65536, "num_hidden_layers": 2048,
                       "num_attention_heads": 128, "num_key_value_heads": 8, "head_dim": 128})
    import gguf

    writer = gguf.GGUFWriter(str(tmp / "lora.gguf"), "llama")  # a LoRA adapter's GGUF: no model
    writer.add_type("adapter")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    # A real GGUF whose vocabulary (400 tokens) is not the tiny policy's (512).
    from transformers import AutoModelForCausalLM

    from homerlhf.workers.gguf import export_ref

    tok = build_tokenizer(vocab_size=400)
    AutoModelForCausalLM.from_config(model_config("llama", len(tok), hidden=32, layers=1)).save_pretrained(tmp / "v400")
    tok.save_pretrained(tmp / "v400")
    export_ref(str(tmp / "v400"), tmp / "vocab400.gguf", outtype="f32")


@pytest.fixture(scope="module")
def cli_results(files):
    """Every CLI row run once: SUBPROCESS_ROWS each in a fresh interpreter, from threads, while the
    others run one after another in this process (cwd and environment are process-wide). Also
    returns the contents of the earlier runs before and after, to show nothing was written over."""
    tmp = files["tmp"]
    before = {name: _snapshot(tmp / name) for name in SNAPSHOTS}
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    argvs = {case[0]: [a.format(port=port, **files) for a in case[1]] for case in CLI_CASES + TRAIN_CASES}
    try:
        with ThreadPoolExecutor(max_workers=len(SUBPROCESS_ROWS)) as pool:
            env = _env(tmp)  # taken before the in-process rows change this process's environment
            fresh = {ident: pool.submit(run_cli, argvs[ident], tmp, env=env) for ident in SUBPROCESS_ROWS}
            results = {ident: run_in_process(argv, tmp) for ident, argv in argvs.items()
                       if ident not in SUBPROCESS_ROWS}
            results.update((ident, future.result()) for ident, future in fresh.items())
    finally:
        busy.close()
    after = {name: _snapshot(tmp / name) for name in SNAPSHOTS}
    return results, before, after


def check_one_line(proc: subprocess.CompletedProcess, code: int, fragment: str) -> None:
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert fragment in lines[0], lines[0]
    assert proc.returncode == code, (proc.returncode, lines[0])


def test_doc_table_and_tests_cover_the_same_rows():
    ids = [c[0] for c in CLI_CASES] + [c[0] for c in HTTP_CASES] + [c[0] for c in TRAIN_CASES]
    assert len(ids) == len(set(ids))
    rows = doc_rows()
    assert sorted(rows) == sorted(ids)
    assert len(rows) >= 25
    for ident, *_, fragment in CLI_CASES + HTTP_CASES + TRAIN_CASES:
        assert _md_escape(fragment) in rows[ident], f"docs/errors.md row {ident} lacks {fragment!r}"


@pytest.mark.slow  # one fixture runs ~70 CLI rows, 3 in fresh interpreters (~15 s on 2 busy cores)
@pytest.mark.parametrize("ident, argv, code, fragment", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input(cli_results, ident, argv, code, fragment):
    if ident == "gpu-preset-without-gpu":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    check_one_line(cli_results[0][ident], code, fragment)


@pytest.mark.slow  # one fixture runs ~70 CLI rows, 3 in fresh interpreters (~15 s on 2 busy cores)
@pytest.mark.parametrize("ident, argv, code, fragment", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_train_bad_input_writes_nothing_over(cli_results, files, ident, argv, code, fragment):
    results, before, after = cli_results
    check_one_line(results[ident], code, fragment)
    assert after == before  # the earlier runs are byte for byte what they were
    assert not any((files["tmp"] / f"e{i}").exists() for i in range(1, 9))  # no export output either
    assert not any((files["tmp"] / f"r-data{i}").exists() for i in range(5, 9))  # a refused --data: no run dir


@pytest.fixture(scope="module")
def worker_url(files):
    """The real worker, started through the CLI with a token, on the tiny Llama export."""
    tmp, gguf = files["tmp"], files["gguf"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "homerlhf.cli", "worker", "--role", "ref", "--model", str(gguf), "--ctx", "48",
         "--threads", "1", "--parent-pid", str(os.getpid())],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**_env(tmp), "HOMERLHF_WORKER_TOKEN": "secret"})
    try:
        url = None
        for line in proc.stdout:
            match = re.search(r"homerlhf worker ready .*url=(\S+)", line)
            if match:
                url = match.group(1)
                break
        assert url, "worker did not start"
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("ident, path, body, token, status, fragment", HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_worker_bad_request(worker_url, ident, path, body, token, status, fragment):
    import httpx

    headers = {"Authorization": f"Bearer {token}", "content-type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{worker_url}{path}", content=content, headers=headers, timeout=60)
    assert response.status_code == status, response.text
    assert fragment in response.json()["detail"]
    ok = httpx.post(f"{worker_url}/logprobs", json={"sequences": [{"prompt_ids": [2, 3], "response_ids": [4, 5]}]},
                    headers={"Authorization": "Bearer secret"}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["logprobs"][0]) == 2


