"""Helpers of the GGUF export tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

# Run in a child interpreter: a llama.cpp build for another CPU dies by SIGILL, and in the pytest
# process it would take the whole test run with it.
LLAMA_CPP_LOGITS = """
import json, sys
import numpy as np
from llama_cpp import Llama

n_ctx = int(sys.argv[3])
llm = Llama(sys.argv[1], logits_all=True, type_k=0, type_v=0, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, verbose=False)
ids = json.loads(sys.argv[2])
llm.eval(ids)
np.save(sys.argv[4], np.array(llm.scores[: len(ids)], dtype=np.float64))
llm.close()
print(json.dumps({"saved": sys.argv[4]}))
"""


def _llama_cpp_logits(gguf_path, ids, n_ctx: int = 64) -> np.ndarray:
    from homerlhf.doctor import ChildFailed, run_child

    out = Path(gguf_path).with_suffix(".logits.npy")
    try:
        run_child(LLAMA_CPP_LOGITS, str(gguf_path), json.dumps([int(i) for i in ids]), str(n_ctx), str(out), timeout=300)
    except ChildFailed as exc:  # one failed test that says why, not a dead test run
        pytest.fail(f"llama.cpp on {Path(gguf_path).name}: {exc.detail}; {exc.fix}", pytrace=False)
    return np.load(out)


@pytest.fixture(scope="session")
def llama_cpp_logits():
    """``llama_cpp_logits(gguf, ids, n_ctx=64)``: (T, V) float64 logits of llama.cpp's high-level
    ``Llama.eval`` for ``ids`` (F32 KV cache), computed in a child process."""
    return _llama_cpp_logits
