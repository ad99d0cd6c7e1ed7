"""Override text parsing and the guard that keeps tracebacks out of the UI."""

from __future__ import annotations

import pytest

from homerlhf.app.common import error_text, guarded, parse_overrides, set_override
from homerlhf.errors import UserError


def test_parse_overrides_one_per_line_with_comments_and_spaces():
    text = "# smaller\nppo.iterations=2\n\n  data.prompts=my data.jsonl  \n"
    assert parse_overrides(text) == ["ppo.iterations=2", "data.prompts=my data.jsonl"]
    with pytest.raises(UserError, match="section.key=value"):
        parse_overrides("ppo.iterations 2")


def test_set_override_replaces_the_same_key():
    assert set_override("ppo.iterations=2\nrollout.batch_size=8", "ppo.iterations", "5") == (
        "rollout.batch_size=8\nppo.iterations=5"
    )


def test_guarded_turns_errors_into_a_message():
    @guarded(2, error_index=1)
    def handler(x):
        if x == "user":
            raise UserError("model 'nope' not found (check the name)")
        if x == "bug":
            raise KeyError("boom")
        return "ok", ""

    assert handler("fine") == ("ok", "")
    _, message = handler("user")
    assert message == "**Error:** model 'nope' not found (check the name)"
    _, message = handler("bug")
    assert message == "**Error:** KeyError: 'boom'"
    assert error_text(RuntimeError("")) == "RuntimeError"


def test_app_on_a_busy_port_is_one_line(tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "homerlhf.cli", "app", "--port", str(port)],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: cannot serve on 127.0.0.1:{port}: the port is in use (pick another --port)")
    assert "Traceback" not in out.stderr
