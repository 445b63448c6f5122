# SPDX-License-Identifier: Apache-2.0
"""Reconnecting across a daemon restart: the options, and what a client sees
when the daemon that kept its state does not come back (the resume itself is
tested with real restarts in tests/integration/test_resume.c)."""

import time

import pytest

import bufbroker
from conftest import _start, slow


@pytest.fixture
def doomed():
    """A daemon that keeps its state (--restart), for a test to kill."""
    d = _start(args=("--restart",))
    yield d
    d.cleanup()


def _gone(d, **client_kwargs):
    """A client of d, which is then killed for good: (the client, a buffer
    it held)."""
    c = bufbroker.Client(d.socket, **client_kwargs)
    buf = c.alloc(64)
    d.proc.kill()
    d.proc.wait(10)
    return c, buf


def test_reconnect_off_fails_at_once(doomed):
    c, buf = _gone(doomed, reconnect=False)
    t0 = time.monotonic()
    with pytest.raises(bufbroker.Disconnected):
        c.stat(buf.id)
    assert time.monotonic() - t0 < 1 * slow()
    assert c.resumes == 0
    c.close()


def test_reconnect_gives_up_after_its_timeout(doomed):
    c, buf = _gone(doomed)
    c.set_reconnect(timeout=0.4, backoff=0.005, max_backoff=0.05)
    t0 = time.monotonic()
    with pytest.raises(bufbroker.Disconnected) as ei:
        c.stat(buf.id)
    took = time.monotonic() - t0
    # The library counts its timeout in whole milliseconds of
    # CLOCK_MONOTONIC: its deadline may fall up to 1 ms before ours.
    assert 0.399 <= took < 0.4 + 2 * slow()
    assert "within 400 ms" in ei.value.message
    c.close()


def test_set_reconnect_checks_its_options(daemon):
    with bufbroker.Client(daemon.socket) as c:
        with pytest.raises(bufbroker.InvalidArgument):
            c.set_reconnect(backoff=1, max_backoff=0.5)
        with pytest.raises(bufbroker.InvalidArgument):
            c.set_reconnect(timeout=-1)
        with pytest.raises(bufbroker.InvalidArgument):
            c.set_reconnect(timeout="10")
        c.set_reconnect(False)
        c.set_reconnect(timeout=30, backoff=0.02, max_backoff=1)
        assert c.resumes == 0
