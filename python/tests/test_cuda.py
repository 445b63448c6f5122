# SPDX-License-Identifier: Apache-2.0
"""CUDA buffers of both handle kinds (legacy IPC handles and VMM file
descriptors): __cuda_array_interface__, cuda_ipc() and cuda_vmm(), against
the fake driver ($BB_FAKECUDA, libfakecuda.so) or, with $BB_REAL_CUDA=1, the
real one."""

import gc
import os

import pytest

import bufbroker

FAKE = os.environ.get("BB_FAKECUDA")
REAL = os.environ.get("BB_REAL_CUDA") == "1"

pytestmark = pytest.mark.skipif(
    not (FAKE or REAL), reason="no CUDA driver to test with: $BB_FAKECUDA is not set (and $BB_REAL_CUDA is not 1)"
)


@pytest.fixture
def cuda_client(start_daemon, monkeypatch):
    """A client of a daemon that uses the fake (or real) driver; this
    process loads the same driver on its first CUDA bb_map. A daemon that
    answers Unsupported fails the test: the driver was set up for it, so
    no CUDA there is a regression, not a reason to skip."""
    env = {}
    if FAKE and not REAL:
        if not os.path.isfile(FAKE):
            pytest.fail(f"$BB_FAKECUDA names no file: {FAKE}")
        env["BUFBROKER_CUDA_LIBRARY"] = FAKE
        monkeypatch.setenv("BUFBROKER_CUDA_LIBRARY", FAKE)
    d = start_daemon(env)
    with bufbroker.Client(d.socket) as c:
        try:
            c.alloc(256, kind="cuda").close()
        except bufbroker.Unsupported as e:
            driver = "the real driver ($BB_REAL_CUDA=1)" if REAL else f"the fake driver {FAKE}"
            pytest.fail(f"the daemon was given {driver} but makes no CUDA buffers: {e.message}\n{d.log()}")
        yield c


def test_cuda_array_interface_describes_the_device_memory(cuda_client):
    with cuda_client.alloc(1 << 20, kind="cuda", device=0) as buf:
        assert buf.kind == "cuda" and buf.size == 1 << 20
        cai = buf.__cuda_array_interface__
        assert cai["version"] == 3
        assert cai["shape"] == (1 << 20,)
        assert cai["typestr"] == "|u1"
        assert cai["strides"] is None
        ptr, readonly = cai["data"]
        assert isinstance(ptr, int) and ptr != 0
        assert readonly is False
        assert buf.__cuda_array_interface__["data"][0] == ptr, "one mapping per handle"
        info = buf.stat()
        assert (info.kind, info.device, info.size) == ("cuda", 0, 1 << 20)


def test_cuda_ipc_describes_the_allocation(cuda_client):
    with cuda_client.alloc(4096, kind="cuda") as buf:
        ipc = buf.cuda_ipc()
        assert isinstance(ipc, bufbroker.CudaIpc)
        handle, offset, size, uuid = ipc
        assert len(handle) == bufbroker.IPC_HANDLE_SIZE and any(handle)
        assert offset % 256 == 0
        assert size == 4096
        assert len(uuid) == 16


def test_cuda_buffers_have_no_host_view(cuda_client):
    with cuda_client.alloc(4096, kind="cuda") as buf:
        with pytest.raises(TypeError):
            buf.view()


def test_exported_cuda_buffer_stays_referenced_until_collected(cuda_client):
    buf = cuda_client.alloc(4096, kind="cuda")
    id_ = buf.id
    buf.__cuda_array_interface__
    buf.close()
    assert cuda_client.stat(id_).refs == 1, "an array library may still use the pointer"
    del buf
    gc.collect()
    with pytest.raises(bufbroker.NotFound):
        cuda_client.stat(id_)


@pytest.mark.parametrize("handle", ["legacy", "vmm"])
def test_each_handle_kind_is_what_was_asked_for_and_has_its_own_description(cuda_client, handle):
    other = {"legacy": "vmm", "vmm": "legacy"}[handle]
    with cuda_client.alloc(4096, kind="cuda", cuda_handle=handle) as buf:
        assert buf.cuda_handle == handle
        if handle == "vmm":
            vmm = buf.cuda_vmm()
            assert isinstance(vmm, bufbroker.CudaVmm)
            try:
                assert vmm.fd >= 0 and os.fstat(vmm.fd)
                assert vmm.size == 4096 and vmm.offset + vmm.size <= vmm.allocation_size
                assert vmm.allocation != 0 and len(vmm.device_uuid) == 16
            finally:
                os.close(vmm.fd)
            with pytest.raises(bufbroker.Unsupported):
                buf.cuda_ipc()
        else:
            assert len(buf.cuda_ipc().handle) == bufbroker.IPC_HANDLE_SIZE
            with pytest.raises(bufbroker.Unsupported):
                buf.cuda_vmm()
        cai = buf.__cuda_array_interface__
        assert cai["shape"] == (4096,) and cai["typestr"] == "|u1" and cai["version"] == 3
        assert cai["data"][0] != 0 and cai["data"][1] is False
    with cuda_client.alloc(4096, kind="cuda", cuda_handle=other) as buf:
        assert buf.cuda_handle == other
    with cuda_client.alloc(4096) as host:
        assert host.cuda_handle is None
    with pytest.raises(bufbroker.InvalidArgument):
        cuda_client.alloc(4096, cuda_handle=handle)
    with pytest.raises(bufbroker.InvalidArgument):
        cuda_client.alloc(4096, kind="cuda", cuda_handle="ipc")


def _device_uuid(buf):
    if buf.cuda_handle == "vmm":
        vmm = buf.cuda_vmm()
        os.close(vmm.fd)
        return vmm.device_uuid
    return buf.cuda_ipc().device_uuid


@pytest.mark.skipif(not FAKE or REAL, reason="moves bytes through the fake driver's copy functions")
@pytest.mark.parametrize("handle", ["legacy", "vmm"])
def test_bytes_written_at_the_interface_pointer_reach_another_process(cuda_client, handle):
    import multiprocessing

    import bbchild

    drv = bbchild.FakeDriver(FAKE)
    with cuda_client.alloc(8192, kind="cuda", cuda_handle=handle) as buf:
        ptr = buf.__cuda_array_interface__["data"][0]
        uuid = _device_uuid(buf)
        assert drv.pointer_device(ptr) == uuid, "the pointer is in this process's mapping of that device"
        drv.use_device(uuid)
        data = bytes(bbchild.pattern(8192, 5))
        drv.htod(ptr, data)
        token = buf.ref().take()
        buf.set_ready()
        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=bbchild.cuda_read, args=(cuda_client.socket, token, FAKE, theirs))
        p.start()
        theirs.close()
        try:
            assert mine.poll(60), "the child sent nothing"
            state, got = mine.recv()
        finally:
            p.join(60)
        assert p.exitcode == 0
        assert state == "ready"
        assert got == data


def test_cuda_buffers_give_numpy_a_clear_error_not_an_object_array(cuda_client):
    import numpy as np

    with cuda_client.alloc(4096, kind="cuda") as buf:
        assert not hasattr(buf, "__array_interface__")
        with pytest.raises(TypeError, match="CUDA memory"):
            np.asarray(buf)
        t = buf.as_tensor("float32")
        assert not hasattr(t, "__array_interface__")
        with pytest.raises(TypeError, match="CUDA memory"):
            np.asarray(t)


def test_cuda_tensor_keeps_the_array_interface_v3_with_its_dtype(cuda_client):
    with cuda_client.alloc(1 << 16, kind="cuda") as buf:
        ptr = buf.__cuda_array_interface__["data"][0]
        t = buf.as_tensor("float16", (64, 8), offset=512)
        cai = t.__cuda_array_interface__
        assert cai == {"shape": (64, 8), "typestr": "<f2", "data": (ptr + 512, False), "strides": None, "version": 3}


@pytest.mark.parametrize("handle", ["legacy", "vmm"])
def test_cuda_capsule_fields_and_its_deleter(cuda_client, handle):
    import bbchild

    buf = cuda_client.alloc(1 << 16, kind="cuda", device=1, cuda_handle=handle)
    assert buf.cuda_handle == handle
    id_ = buf.id
    ptr = buf.__cuda_array_interface__["data"][0]
    t = buf.as_tensor("int32", (16, 4, 2), offset=1024)
    # This process sees every fake device in order: its ordinal is the daemon's.
    assert t.__dlpack_device__() == buf.__dlpack_device__() == (2, 1)
    for max_version in (None, (1, 0)):
        cap = t.__dlpack__(stream=7, max_version=max_version)
        f = bbchild.tensor_fields(cap)
        assert f["device"] == (2, 1), "kDLCUDA, device 1"
        assert f["data"] == ptr + 1024 and f["byte_offset"] == 0
        assert (f["ndim"], f["shape"], f["dtype"]) == (3, (16, 4, 2), (0, 32, 1))
        assert f["strides"] in (None, (8, 2, 1))
        spy = bbchild.CountedDeleter(cap)
        bbchild.consume_by_hand(cap)
        del cap
        assert spy.calls == 1
    cap = t.__dlpack__()
    spy = bbchild.CountedDeleter(cap)
    buf.close()
    del t, buf
    gc.collect()
    assert cuda_client.stat(id_).refs == 1, "the capsule holds the buffer"
    del cap
    assert spy.calls == 1
    gc.collect()
    with pytest.raises(bufbroker.NotFound):
        cuda_client.stat(id_)


def test_cuda_dlpack_device_is_the_ordinal_of_the_mapping_process(cuda_client, monkeypatch):
    import bbchild
    from conftest import run_child

    with cuda_client.alloc(8192, kind="cuda", device=0) as buf:
        token = buf.ref().take()
        # The child sees the daemon's device 0 as its device 1.
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
        ptr, tensor_device, buf_device, name, f = run_child(bbchild.cuda_capsule, cuda_client.socket, token)
        assert tensor_device == buf_device == (2, 1)
        assert name == "dltensor"
        assert f["device"] == (2, 1)
        assert f["data"] == ptr + 256 and f["byte_offset"] == 0
        assert (f["ndim"], f["shape"], f["dtype"]) == (2, (4, 8), (2, 32, 1))
        assert f["strides"] in (None, (8, 1))
