"""Where llama.cpp's own log goes in this process: its warnings (``n_ctx_seq > n_ctx_train``, a LoRA tensor
that cannot use a CPU buffer type, ...) into a file in the run dir once a run names one
(:func:`log_to`), its errors to stderr as well; with ``--verbose`` (:func:`set_verbose`) both to stderr.
Info lines are dropped. The callback is process-wide: llama.cpp calls it for every model and context
here, from its own threads. A worker process writes everything it prints to its own log
(:mod:`homerlhf.workers.process`), whose last lines a failure quotes.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Optional

# ggml.h: DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the previous line at its level).
WARN, ERROR, CONT = 3, 4, 5
_STATE: dict = {"callback": None, "level": 0, "path": None, "verbose": False}
_LOCK = threading.Lock()


def log_to(path: Optional[Path]) -> Optional[Path]:
    """llama.cpp's warnings go to ``path`` (appended) from now on; None: to stderr. Returns where they went
    before (a run restores it when it ends)."""
    with _LOCK:
        previous, _STATE["path"] = _STATE["path"], Path(path) if path is not None else None
    return previous


def set_verbose(on: bool) -> None:
    """``--verbose``: warnings to stderr even where a run named a log file."""
    _STATE["verbose"] = bool(on)


def log_path() -> Optional[Path]:
    return _STATE["path"]


def _write(level: int, text: str) -> None:
    path = _STATE["path"]
    if path is not None and not _STATE["verbose"]:
        try:
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(text)
            if level != ERROR:  # an error reaches the user wherever the rest goes
                return
        except OSError:  # the run dir is gone: the line is not lost
            pass
    sys.stderr.write(text)


def install() -> None:
    """Our own log callback (llama-cpp-python's maps an older ggml level enum and lets info lines through)."""
    import llama_cpp

    if _STATE["callback"] is not None:
        return

    @llama_cpp.llama_log_callback
    def _log(level, text, user_data):
        try:
            with _LOCK:
                if level != CONT:
                    _STATE["level"] = level
                if _STATE["level"] in (WARN, ERROR):
                    _write(_STATE["level"], text.decode("utf-8", "replace"))
        except Exception:  # noqa: BLE001 - never raise into llama.cpp's C frames
            pass

    _STATE["callback"] = _log  # llama.cpp keeps calling it: it must never be collected
    llama_cpp.llama_log_set(_log, None)
