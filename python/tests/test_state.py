# SPDX-License-Identifier: Apache-2.0
"""PENDING / READY / FAILED: set_ready, set_error, wait and its timeout."""

import threading
import time

import pytest

import bufbroker
from conftest import slow, wait_until_parked


def test_wait_returns_ready_once_another_connection_sets_it(daemon, client, other):
    with client.alloc(64) as buf, other.open(buf.id) as seen:
        result = {}

        def waiter():
            result["state"] = seen.wait(10)
            result["woke"] = time.monotonic()

        t = threading.Thread(target=waiter)
        t.start()
        wait_until_parked(daemon, 1)
        assert "state" not in result, "wait returned while the buffer was pending"
        set_at = time.monotonic()
        buf.set_ready()
        t.join(10)
        assert result["state"] == "ready"
        assert result["woke"] >= set_at, "the wait returned before set_ready"
        assert seen.stat().state == "ready"
        assert seen.wait(0) == "ready"


def test_set_error_fails_the_buffer_with_its_message(client, other):
    with client.alloc(64) as buf, other.open(buf.id) as seen:
        buf.set_error("decoder ran out of frames: é")
        assert seen.wait(5) == "failed"
        info = seen.stat()
        assert info.state == "failed"
        assert info.error == "decoder ran out of frames: é"


def test_wait_times_out_on_a_pending_buffer(client):
    with client.alloc(64) as buf:
        t0 = time.monotonic()
        with pytest.raises(bufbroker.Timeout) as ei:
            buf.wait(0.3)
        elapsed = time.monotonic() - t0
        assert ei.value.code == bufbroker.ERR_TIMEOUT
        assert ei.value.message
        # The daemon's timer: not early, and late by no more than a round
        # trip and scheduling explain (a timer 3x late fails); the slack
        # scales with the run's slowness, the bound does not widen.
        assert 0.29 <= elapsed < 0.3 + 0.25 * slow()
        with pytest.raises(bufbroker.Timeout):
            buf.wait(0)  # a poll
        assert buf.stat().state == "pending"


def test_wait_longer_than_one_slice_still_times_out(client):
    with client.alloc(64) as buf:
        t0 = time.monotonic()
        with pytest.raises(bufbroker.Timeout):
            buf.wait(1.4)
        assert 1.39 <= time.monotonic() - t0 < 1.4 + 0.5 * slow()


def test_forever_wait_returns_when_set_after_more_than_one_slice(client, other):
    with client.alloc(64) as buf, other.open(buf.id) as seen:
        timer = threading.Timer(1.3, buf.set_ready)
        timer.start()
        try:
            assert seen.wait() == "ready"
        finally:
            timer.join()


def test_state_changes_only_from_pending(client):
    with client.alloc(64) as buf:
        buf.set_ready()
        with pytest.raises(bufbroker.StateError) as ei:
            buf.set_ready()
        assert ei.value.code == bufbroker.ERR_STATE
        with pytest.raises(bufbroker.StateError):
            buf.set_error("too late")
    with client.alloc(64) as buf:
        buf.set_error("first")
        with pytest.raises(bufbroker.StateError):
            buf.set_ready()
        assert buf.stat().error == "first"


def test_bad_timeouts_are_invalid_arguments(client):
    with client.alloc(64) as buf:
        for bad in (-1, float("nan"), "1", True):
            with pytest.raises(bufbroker.InvalidArgument):
                buf.wait(bad)


def test_one_client_serves_a_waiting_thread_and_a_setting_thread(daemon, client):
    buf = client.alloc(64)
    seen = buf.ref()
    result = {}

    def waiter():
        result["state"] = seen.wait(10)

    t = threading.Thread(target=waiter)
    t.start()
    wait_until_parked(daemon, 1)
    t0 = time.monotonic()
    buf.set_ready()
    assert time.monotonic() - t0 < 0.5 * slow(), "set_ready queued behind the other thread's wait"
    t.join(10)
    assert result["state"] == "ready"
    buf.close()
    seen.close()
