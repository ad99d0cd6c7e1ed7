"""The launcher between the app and a detached run: ``python -m homerlhf.app.launcher APP_DIR -- COMMAND...``
runs COMMAND and writes its exit code to ``APP_DIR/exit.json`` (:mod:`homerlhf.app.runs` starts it and reads
the file: a restarted app is no longer the trainer's parent and could not learn the code otherwise)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from homerlhf.app.runs import EXIT_FILE, _write_json_atomic


def main(args: list[str]) -> int:
    app_dir, sep, command = Path(args[0]), args[1], args[2:]
    assert sep == "--", "usage: python -m homerlhf.app.launcher APP_DIR -- COMMAND..."
    # The stop signal goes to the whole group; the launcher must outlive the trainer to record
    # its exit code. A Python-level handler (not SIG_IGN) is reset to default in the child on exec.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    proc = subprocess.Popen(command)
    while True:
        try:
            returncode = proc.wait()
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries, kept for safety
            continue
    _write_json_atomic(app_dir / EXIT_FILE, {"returncode": returncode, "ended_at": time.time()})
    return returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
