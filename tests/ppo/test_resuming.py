"""Resuming: the run's logs are cut back to what they held at the checkpoint (the whole resume
through the CLI: tests/stages/test_resume.py)."""

from __future__ import annotations

import pytest

from homerlhf.errors import UserError
from homerlhf.ppo.checkpoint import log_offsets
from homerlhf.ppo.resuming import truncate_logs


def test_truncate_logs_cuts_rows_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 1}\n{"iteration": 2}\n')
    offsets = log_offsets(tmp_path)
    with path.open("a") as fh:
        fh.write('{"iteration": 3}\n{"itera')  # a row of a later iteration and a torn write
    truncate_logs(tmp_path, offsets)
    assert path.read_text() == '{"iteration": 1}\n{"iteration": 2}\n'
    path.write_text("")
    with pytest.raises(UserError, match="shorter than when the checkpoint"):
        truncate_logs(tmp_path, offsets)
