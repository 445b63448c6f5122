# SPDX-License-Identifier: Apache-2.0
"""Host memory: views with no copy, numpy, lifetimes, imported memfds."""

import fcntl
import gc
import mmap
import os

import numpy as np
import pytest

import bufbroker


def test_view_is_a_writable_byte_memoryview_of_the_whole_buffer(client):
    with client.alloc(4096) as buf:
        mv = buf.view()
        assert isinstance(mv, memoryview)
        assert mv.format == "B" and mv.itemsize == 1
        assert mv.nbytes == len(mv) == 4096
        assert not mv.readonly
        assert mv.c_contiguous
        mv[0] = 0xAB
        mv[1:4] = b"xyz"
        assert mv[0] == 0xAB and bytes(mv[1:4]) == b"xyz"
        del mv


def test_numpy_writes_are_seen_through_memoryview_without_copy(client):
    with client.alloc(1 << 16) as buf:
        mv = buf.view()
        a = np.frombuffer(buf.view(), dtype=np.uint32)
        assert a.flags.writeable and a.size == (1 << 16) // 4
        a[:] = np.arange(a.size, dtype=np.uint32)
        # Read back through the other view: the same memory, not a copy.
        assert mv[4:8].tobytes() == (1).to_bytes(4, "little")
        assert np.array_equal(np.frombuffer(mv, dtype=np.uint32), np.arange(a.size))
        # And the other way round.
        mv[0:4] = (0xDEADBEEF).to_bytes(4, "little")
        assert a[0] == 0xDEADBEEF
        # Both wrap the mapping itself.
        assert np.shares_memory(a, np.frombuffer(mv, dtype=np.uint8))
        del a, mv


def test_bytes_written_by_one_connection_are_read_by_another(client, other):
    with client.alloc(8192, share="uid") as buf, other.open(buf.id) as seen:
        np.frombuffer(buf.view(), dtype=np.uint8)[:] = 7
        assert bytes(seen.view()) == bytes([7]) * 8192


def test_view_keeps_memory_and_reference_after_close(client):
    buf = client.alloc(4096)
    id_ = buf.id
    mv = buf.view()
    arr = np.frombuffer(mv, dtype=np.uint8)
    buf.close()
    assert buf.closed
    # Closed for use...
    with pytest.raises(ValueError):
        buf.view()
    # ...but the memory under the views is still mapped and still referenced.
    mv[:] = b"\x05" * 4096
    assert arr.sum() == 5 * 4096
    assert client.stat(id_).refs == 1
    del mv
    gc.collect()
    assert client.stat(id_).refs == 1, "the numpy array still holds the view"
    del arr
    gc.collect()
    with pytest.raises(bufbroker.NotFound):
        client.stat(id_)


def test_client_close_waits_for_views_before_disconnecting(daemon, other):
    c = bufbroker.Client(daemon.socket)
    buf = c.alloc(4096)
    id_ = buf.id
    mv = buf.view()
    c.close()
    assert c.closed and buf.closed
    with pytest.raises(ValueError):
        c.stat(id_)
    mv[0] = 42  # still mapped
    assert other.stat(id_).refs == 1
    del mv
    gc.collect()
    # The deferred disconnect happened; the daemon notices asynchronously.
    _wait_not_found(other, id_)


def _wait_not_found(c, id_, seconds=5.0):
    import time

    deadline = time.monotonic() + seconds
    while True:
        try:
            c.stat(id_)
        except bufbroker.NotFound:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"buffer {id_} still exists {seconds} s after its last holder went")
        time.sleep(0.02)


def test_cuda_only_attributes_are_absent_on_host_buffers(client):
    with client.alloc(64) as buf:
        assert not hasattr(buf, "__cuda_array_interface__")
        with pytest.raises(bufbroker.InvalidArgument):
            buf.cuda_ipc()


def test_import_memfd_shares_its_memory_and_gets_sealed(client):
    size = 1 << 16
    fd = os.memfd_create("bbpy-import", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        mine = mmap.mmap(fd, size)
        mine[:5] = b"hello"
        with client.import_fd(fd, size, name="bbpy-imported") as buf:
            assert buf.kind == "host" and buf.size == size
            info = buf.stat()
            assert (info.name, info.state, info.refs) == ("bbpy-imported", "pending", 1)
            mv = buf.view()
            assert bytes(mv[:5]) == b"hello"
            mv[5:10] = b"world"
            assert mine[:10] == b"helloworld"  # the same pages
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            assert seals & want == want, f"seals {seals:#x}"
            assert not seals & fcntl.F_SEAL_WRITE
            with pytest.raises(OSError):
                os.ftruncate(fd, size * 2)
            del mv
        mine.close()
    finally:
        os.close(fd)


def test_import_of_an_unsealable_memfd_is_refused(client):
    fd = os.memfd_create("bbpy-nosealing")  # no MFD_ALLOW_SEALING
    try:
        os.ftruncate(fd, 4096)
        with pytest.raises(bufbroker.InvalidArgument) as ei:
            client.import_fd(fd, 4096)
        assert ei.value.code == bufbroker.ERR_INVALID
        assert ei.value.message
    finally:
        os.close(fd)


def test_import_accepts_a_file_object(client):
    fd = os.memfd_create("bbpy-fileobj", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    with open(fd, "r+b") as f, client.import_fd(f, 4096) as buf:
        assert buf.size == 4096
