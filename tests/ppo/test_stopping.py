"""Graceful stop: the first signal sets the flag, the second aborts; handlers are restored."""

from __future__ import annotations

import os
import signal

import pytest

from homerlhf.ppo.stopping import StopRequested


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_first_signal_requests_stop_second_aborts(sig):
    before = signal.getsignal(sig)
    messages = []
    with StopRequested(echo=messages.append) as stop:
        assert not stop.requested
        os.kill(os.getpid(), sig)
        assert stop.requested and stop.reason == signal.Signals(sig).name
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), sig)
    assert signal.getsignal(sig) is before
    assert "stopping after the current phase" in messages[0] and "aborting now" in messages[1]


def test_request_from_code_keeps_first_reason():
    stop = StopRequested(echo=lambda msg: None)
    stop.request("non-finite")
    stop.request("later")
    assert stop.requested and stop.reason == "non-finite"
