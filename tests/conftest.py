"""Shared fixtures: tiny models built from code (offline), reused across the session."""

from __future__ import annotations

import os

# Nothing in the test suite may reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Builtin models and GGUF exports go to a per-session cache, never the user's."""
    if "HOMERLHF_CACHE" not in os.environ:
        os.environ["HOMERLHF_CACHE"] = str(tmp_path_factory.mktemp("homerlhf-cache"))
    yield


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from homerlhf.tiny import build_causal_lm

    return build_causal_lm(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    from homerlhf.tiny import build_causal_lm

    return build_causal_lm(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", seed=1)
