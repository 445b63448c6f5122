# SPDX-License-Identifier: Apache-2.0
"""References: counts seen through stat, ref/close, take/adopt, names,
retain/release, context managers."""

import gc
import re
import time

import pytest

import bufbroker


def test_stat_describes_a_new_buffer(client):
    with client.alloc(12345) as buf:
        info = client.stat(buf.id)
        assert isinstance(info, bufbroker.Info)
        assert info == bufbroker.Info(
            id=buf.id, size=12345, kind="host", device=0, state="pending", refs=1, name=None, error=None
        )
        assert buf.stat() == info
        assert (buf.size, buf.kind) == (12345, "host")


def test_buffer_context_manager_releases_the_buffer(client):
    with client.alloc(4096) as buf:
        id_ = buf.id
        assert client.stat(id_).refs == 1
    assert buf.closed
    with pytest.raises(bufbroker.NotFound) as ei:
        client.stat(id_)
    assert ei.value.code == bufbroker.ERR_NOT_FOUND


def test_close_is_idempotent_and_closed_buffers_refuse_use(client):
    buf = client.alloc(64)
    buf.close()
    buf.close()
    for call in (buf.view, buf.set_ready, buf.wait, buf.stat, buf.ref, buf.take):
        with pytest.raises(ValueError):
            call()


def test_garbage_collected_buffer_is_released(client):
    id_ = client.alloc(64).id  # the Buffer object is dropped at once
    gc.collect()
    with pytest.raises(bufbroker.NotFound):
        client.stat(id_)


def test_local_refs_share_one_daemon_reference(client):
    buf = client.alloc(64)
    copies = [buf.ref() for _ in range(3)]
    assert all(c.id == buf.id for c in copies)
    assert client.stat(buf.id).refs == 1
    buf.close()
    for c in copies[:-1]:
        c.close()
    assert client.stat(buf.id).refs == 1, "the last local copy still holds it"
    copies[-1].close()
    with pytest.raises(bufbroker.NotFound):
        client.stat(buf.id)


def test_two_connections_holding_a_buffer_count_two(client, other):
    with client.alloc(64) as buf:
        seen = other.open(buf.id)
        again = other.open(buf.id)  # coalesced: same connection, no new daemon count
        assert client.stat(buf.id).refs == 2
        seen.close()
        assert client.stat(buf.id).refs == 2
        again.close()
        # The last close's Release is not waited for; a round trip on the same
        # connection is ordered after it, one on another connection is not.
        assert other.stat(buf.id).refs == 1


def test_take_returns_a_token_and_consumes_the_object(client, other):
    buf = client.alloc(64)
    keep = buf.ref()
    token = buf.take()
    assert re.fullmatch(r"[0-9a-f]{32}", token)
    assert buf.closed
    buf.close()  # no-op: the count went into the token
    assert client.stat(keep.id).refs == 2, "our connection + the live token"
    keep.close()
    assert client.stat(keep.id).refs == 1, "the token alone keeps it"
    with other.adopt(token) as got:
        assert got.id == keep.id
        assert other.stat(got.id).refs == 1, "the token moved into the adopter"
    with pytest.raises(bufbroker.NotFound):
        other.stat(keep.id)


def test_take_of_the_last_reference_moves_it_into_the_token(client, other):
    buf = client.alloc(64)
    id_ = buf.id
    token = buf.take()
    assert other.stat(id_).refs == 1
    with other.adopt(token) as got:
        assert got.id == id_


def test_a_token_is_adopted_once(client, other):
    with client.alloc(64) as buf:
        token = buf.ref().take()
        with other.adopt(token):
            pass
        with pytest.raises(bufbroker.NotFound) as ei:
            other.adopt(token)
        assert ei.value.code == bufbroker.ERR_NOT_FOUND


def test_adopt_accepts_raw_token_bytes(client, other):
    with client.alloc(64) as buf:
        token = buf.ref().take()
        with other.adopt(bytes.fromhex(token)) as got:
            assert got.id == buf.id


def test_malformed_token_is_invalid_argument(client):
    for bad in ("xyz", "0" * 31, "g" * 32, "0" * 33):
        with pytest.raises(bufbroker.InvalidArgument) as ei:
            client.adopt(bad)
        assert ei.value.code == bufbroker.ERR_INVALID
    with pytest.raises(bufbroker.InvalidArgument):
        client.adopt(12345)


def test_open_by_name(client, other):
    with client.alloc(256, name="bbpy-named") as buf:
        with other.open_name("bbpy-named") as seen:
            assert seen.id == buf.id and seen.size == 256
            assert seen.stat().name == "bbpy-named"
        with pytest.raises(bufbroker.Exists) as ei:
            client.alloc(16, name="bbpy-named")
        assert ei.value.code == bufbroker.ERR_EXISTS
    # The last unref is sent without waiting: a round trip on the same
    # connection orders it before the other connection's open.
    with pytest.raises(bufbroker.NotFound):
        client.stat(buf.id)
    with pytest.raises(bufbroker.NotFound):
        other.open_name("bbpy-named")


def test_retain_and_release_move_the_daemon_count(client, other):
    with client.alloc(64) as buf:
        before = other.stat(buf.id).refs
        client.retain(buf.id, 2)
        assert other.stat(buf.id).refs == before + 2
        client.release(buf.id, 2)
        assert other.stat(buf.id).refs == before
    with pytest.raises(bufbroker.NotFound):
        client.retain(buf.id)


def test_client_context_manager_releases_everything(daemon, other):
    with bufbroker.Client(daemon.socket) as c:
        a = c.alloc(64)
        b = c.alloc(64, name="bbpy-ctx")
        ids = (a.id, b.id)
    assert c.closed and a.closed and b.closed
    a.close()  # no-op after the client closed
    with pytest.raises(ValueError):
        c.alloc(64)
    deadline = time.monotonic() + 5
    for id_ in ids:
        while True:
            try:
                other.stat(id_)
            except bufbroker.NotFound:
                break
            assert time.monotonic() < deadline, f"buffer {id_} outlived its client's close"
            time.sleep(0.02)


def test_buffers_cannot_be_pickled(client):
    import pickle

    with client.alloc(64) as buf:
        with pytest.raises(TypeError, match="take"):
            pickle.dumps(buf)
    with pytest.raises(TypeError):
        pickle.dumps(client)
