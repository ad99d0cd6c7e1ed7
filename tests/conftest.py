"""Shared fixtures: tiny models built from code (offline), reused across the session."""

from __future__ import annotations

import os

# Nothing in the test suite may reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
from xdist_plan import FileOrGroupScheduling, order, pin_this_worker

pin_this_worker()  # before anything imports torch (tests/xdist_plan.py)


def pytest_collection_modifyitems(config, items):
    order(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return FileOrGroupScheduling(config, log) if config.getoption("dist") == "loadfile" else None


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Builtin models and GGUF exports go to a per-session cache, never the user's."""
    if "HOMERLHF_CACHE" not in os.environ:
        if os.environ.get("PYTEST_XDIST_WORKER"):  # one cache for the workers (tests/xdist_plan.py)
            shared = tmp_path_factory.getbasetemp().parent / "homerlhf-cache"
            shared.mkdir(exist_ok=True)
            os.environ["HOMERLHF_CACHE"] = str(shared)
        else:
            os.environ["HOMERLHF_CACHE"] = str(tmp_path_factory.mktemp("homerlhf-cache"))
    yield


@pytest.fixture(scope="session")
def gpu_session_smoke(tmp_path_factory):
    """``bash scripts/gpu_session.sh check --cpu-smoke`` then ``... speed --cpu-smoke``, run once into
    one ``$OUT``: what a GPU session runs (``homerlhf check``, benchmarks/gpu_generation.py), each in
    its CPU smoke mode. Returns the two finished processes as one (exit code: the worse; output: both)
    and the ``$OUT`` folder; ``done.each`` holds them by command."""
    import subprocess
    import time
    from pathlib import Path

    out = tmp_path_factory.mktemp("gpu-session-out")
    root = Path(__file__).resolve().parents[1]
    # A token in the environment, as a user's may be: the report must not hold it (tests/memory/test_check_report.py).
    env = dict(os.environ, OUT=str(out), CUDA_VISIBLE_DEVICES="", HF_TOKEN="hf_homerlhfSmokeCanary0123456789abcdef")
    env.pop("HOMERLHF_GPU_MODELS", None)
    each = {}
    for command in ("check", "speed"):
        started = time.perf_counter()
        each[command] = subprocess.run(["bash", str(root / "scripts" / "gpu_session.sh"), command, "--cpu-smoke"],
                                       capture_output=True, text=True, timeout=1200, env=env, cwd=out)
        each[command].seconds = time.perf_counter() - started
    done = subprocess.CompletedProcess([c.args for c in each.values()], max(c.returncode for c in each.values()),
                                       "".join(c.stdout for c in each.values()), "".join(c.stderr for c in each.values()))
    done.each, done.env = each, env
    return done, out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from homerlhf.tiny import build_causal_lm

    return build_causal_lm(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)


@pytest.fixture(scope="session")
def small_critic_dir(tmp_path_factory):
    """A causal LM of half ``tiny_llama_dir``'s layers and width (hidden 64, 2 layers) on the same
    builtin tokenizer: a smaller critic of the policy's family (``critic.model``)."""
    from homerlhf.tiny import build_causal_lm

    return build_causal_lm(tmp_path_factory.mktemp("small-critic"), arch="llama", seed=5, hidden=64, layers=2)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    from homerlhf.tiny import build_causal_lm

    return build_causal_lm(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory):
    """A tiny Qwen3-MoE (transformers' fused experts: 8 experts, top-2) on the builtin tokenizer."""
    from homerlhf.tiny import build_causal_lm

    return build_causal_lm(tmp_path_factory.mktemp("tiny-qwen3-moe"), arch="qwen3_moe", seed=2)


@pytest.fixture(scope="session")
def tiny_gpt_oss_dir(tmp_path_factory):
    """A tiny gpt-oss (fused experts stored (E, in, out) with biases, 8 experts, top-2)."""
    from homerlhf.tiny import build_causal_lm

    return build_causal_lm(tmp_path_factory.mktemp("tiny-gpt-oss"), arch="gpt_oss", seed=3)


# -- real tokenizers (tests/fixtures/README.md) -----------------------------------------------------
REAL_TOKENIZERS = ("qwen3", "llama3_1", "gemma3")
REAL_TOKENIZER_ARCH = {"qwen3": "qwen3", "llama3_1": "llama", "gemma3": "gemma3_text"}


@pytest.fixture(scope="session")
def real_tokenizer_dirs(tmp_path_factory) -> dict:
    """name -> a dir ``AutoTokenizer.from_pretrained`` loads: the xz fixtures, decompressed once."""
    import lzma
    import shutil
    from pathlib import Path

    fixtures = Path(__file__).parent / "fixtures" / "tokenizers"
    root = tmp_path_factory.mktemp("real-tokenizers")
    dirs = {}
    for name in REAL_TOKENIZERS:
        out = root / name
        out.mkdir()
        for packed in (fixtures / name).glob("*.json.xz"):
            (out / packed.name.removesuffix(".xz")).write_bytes(lzma.decompress(packed.read_bytes()))
        shutil.copy(fixtures / name / "generation_config.json", out / "generation_config.json")
        dirs[name] = out
    return dirs


@pytest.fixture(scope="session")
def real_vocab_model_dir(real_tokenizer_dirs, tmp_path_factory):
    """``real_vocab_model_dir(name)``: a tiny random-init causal LM of the matching architecture on
    that real tokenizer (hidden 64, 2 layers, tied embeddings), built once per name."""
    from homerlhf.tiny import build_causal_lm

    built = {}

    def build(name: str):
        if name not in built:
            built[name] = build_causal_lm(
                tmp_path_factory.mktemp(f"tiny-{name}"), arch=REAL_TOKENIZER_ARCH[name], seed=0,
                tokenizer_dir=real_tokenizer_dirs[name], hidden=64, layers=2, tie_embeddings=True)
        return built[name]

    return build


@pytest.fixture(scope="session")
def peaked_policy_dir(tmp_path_factory):
    """A tiny Llama whose LM head is scaled up: a random model with a peaked next-token
    distribution (entropy ~3 nats instead of ln 512), like a trained LM, so a reward on one
    token has signal from the start."""
    from homerlhf.tiny import build_causal_lm

    return build_causal_lm(tmp_path_factory.mktemp("peaked-llama"), hidden=64, layers=2, head_scale=20.0)


# The preference pairs a LoRA reward model is trained on in a few steps (tests of reward.backend adapter).
LORA_RM_PAIRS = [
    {"prompt": "Tell me about tea.", "chosen": "Happy to help! Tea is made by steeping dried leaves in hot water.",
     "rejected": "Ugh, figure it out yourself."},
    {"prompt": "Share a fact about cats.", "chosen": "Gladly! Cats sleep for most of the day.",
     "rejected": "Not my problem. Go away."},
] * 4


@pytest.fixture(scope="session")
def tiny_lora_rm_dir(tiny_llama_dir, tmp_path_factory):
    """A reward run dir (``adapter/``, ``model/``, ``reward_run.json``) of ``homerlhf reward`` with
    rm.method qlora on ``tiny_llama_dir``: 3 steps at a high learning rate, so the LoRA and the score
    head are far from their initial values."""
    import json

    from homerlhf.config import load_config
    from homerlhf.stages.reward import run_reward

    root = tmp_path_factory.mktemp("tiny-lora-rm")
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in LORA_RM_PAIRS))
    cfg = load_config("cpu-tiny", overrides=[
        "rm.method=qlora", "rm.max_steps=3", "rm.batch_size=4", "rm.grad_accum=1", "rm.lr=1e-2", "rm.eval_data=null",
        "data.eval_fraction=0.25", "logging.progress=false", "rm.export_gguf=false"])
    run_reward(cfg, root / "rm", data=str(pairs), base=str(tiny_llama_dir))
    return root / "rm"


@pytest.fixture(scope="session")
def installed_wheel(tmp_path_factory):
    """The checkout's sdist and wheel, the wheel installed (not editable) into a fresh virtual environment:
    ``.run("demo", "--fast", cwd=...)`` runs its ``homerlhf`` as a user of the package would
    (tests/wheel_venv.py). About 10 s, once per test process."""
    from wheel_venv import install

    return install(tmp_path_factory.mktemp("wheel"))
