"""A reward function for the kill test in ``test_session.py``: a component of weight 0 that gives
0.0 to every sample, and, in a run whose environment names a file in ``HOMERLHF_TEST_HOLD_FILE``,
holds that run at the first sample of iteration 4: it creates the file and blocks for good, so the
test kills the run at a state it chose (iteration 3 logged to every tracker, iteration 4 none yet).

The run scores ``rollout.batch_size`` samples an iteration, one call each, and (``rollout.async``
off) scores an iteration's samples only after the iteration before it was logged: so its call
``3 * batch_size + 1`` is the first of iteration 4.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

CALLS_BEFORE_HOLD = 3 * 4  # iterations 1..3 of rollout.batch_size=4 samples
_calls = 0


def hold(response: str) -> float:
    global _calls
    _calls += 1
    held = os.environ.get("HOMERLHF_TEST_HOLD_FILE")
    if held and _calls > CALLS_BEFORE_HOLD:
        Path(held).write_text(f"call {_calls}\n")
        threading.Event().wait()  # until the test's SIGKILL
    return 0.0
