# SPDX-License-Identifier: Apache-2.0
"""Tensors without glue: numpy's array interface, DLPack capsules (read
back as a C consumer would), typed views, lifetimes, and two processes
sharing memory through numpy."""

import gc

import numpy as np
import pytest

import bbchild
import bufbroker
from bufbroker import _dlpack
from conftest import run_child

kDLCPU, kDLCUDA = 1, 2
kDLInt, kDLUInt, kDLFloat, kDLBfloat = 0, 1, 2, 4


def address(a):
    return a.__array_interface__["data"][0]


def test_np_asarray_of_a_host_buffer_is_a_writable_uint8_array_on_its_memory(client):
    with client.alloc(4096) as buf:
        a = np.asarray(buf)
        assert (a.dtype, a.shape, a.flags.writeable) == (np.uint8, (4096,), True)
        a[10:13] = [1, 2, 3]
        assert bytes(buf.view()[10:13]) == b"\x01\x02\x03", "the shared memory, not a copy"
        assert np.array(buf).dtype == np.uint8 and np.array(buf, dtype=np.int16).dtype == np.int16
        del a


def test_as_tensor_views_have_their_dtype_shape_and_offset(client):
    with client.alloc(1 << 16) as buf:
        raw = np.asarray(buf)
        t = buf.as_tensor("float32", (32, 64), offset=1024)
        assert (t.dtype, t.shape, t.offset, t.nbytes, t.strides) == ("float32", (32, 64), 1024, 8192, (256, 4))
        assert t.__dlpack_device__() == (kDLCPU, 0) == buf.__dlpack_device__()
        a = np.asarray(t)
        assert (a.dtype, a.shape, a.flags.writeable) == (np.float32, (32, 64), True)
        assert address(a) == address(raw) + 1024 == t.data_ptr
        a[0, 1] = 1.5
        assert raw[1028:1032].tobytes() == np.float32(1.5).tobytes()
        whole = np.asarray(buf.as_tensor(np.int64))
        assert whole.shape == ((1 << 16) // 8,)
        del a, raw, whole


def test_dtype_spellings_name_the_same_type(client):
    with client.alloc(64) as buf:
        for spec in ("float32", "<f4", "f4", np.float32, np.dtype("float32"), "torch.float32"):
            assert buf.as_tensor(spec).dtype == "float32", spec
        assert buf.as_tensor(float).dtype == "float64"
        assert buf.as_tensor(np.bool_).dtype == "bool"


def test_numpy_integers_give_shapes_and_offsets(client):
    with client.alloc(64) as buf:
        assert buf.as_tensor("uint8", np.int64(4)).shape == (4,)
        assert buf.as_tensor("uint8", (np.int32(2), 3), offset=np.uint8(1)).shape == (2, 3)


def test_bad_views_are_invalid_arguments(client):
    with client.alloc(4096) as buf:
        for call in (
            lambda: buf.as_tensor("float128"),
            lambda: buf.as_tensor("float32", (1025,)),
            lambda: buf.as_tensor("float32", (1024,), offset=4),
            lambda: buf.as_tensor("float32", offset=2),
            lambda: buf.as_tensor("uint8", offset=4097),
            lambda: buf.as_tensor("uint8", (-1,)),
            lambda: buf.as_tensor("uint8", (2.5,)),
            lambda: buf.as_tensor("float64", offset=4092),
        ):
            with pytest.raises(bufbroker.InvalidArgument) as ei:
                call()
            assert ei.value.code == bufbroker.ERR_INVALID and ei.value.message


def test_np_from_dlpack_shares_the_memory(client):
    with client.alloc(4096) as buf:
        raw = np.asarray(buf)
        raw[:] = np.arange(4096, dtype=np.uint32).astype(np.uint8)
        a = np.from_dlpack(buf.as_tensor("uint16", (4, 8), offset=512))
        assert (a.dtype, a.shape, a.strides) == (np.uint16, (4, 8), (16, 2))
        assert address(a) == address(raw) + 512
        assert np.array_equal(a, raw[512:576].view(np.uint16).reshape(4, 8))
        whole = np.from_dlpack(buf)
        assert (whole.dtype, whole.shape, address(whole)) == (np.uint8, (4096,), address(raw))
        del a, raw, whole


def test_bytes_written_through_numpy_are_read_through_dlpack_in_another_process(daemon, client):
    with client.alloc(4096) as buf:
        token = buf.ref().take()
        assert run_child(bbchild.tensor_fill, daemon.socket, token, 3) == buf.id
        assert buf.wait(0) == "ready"
        seen = np.from_dlpack(buf.as_tensor("uint32", (16, 32), offset=64))
        assert np.array_equal(seen, np.arange(16 * 32, dtype=np.uint32).reshape(16, 32) * 3)
        del seen


def test_bytes_written_through_numpy_here_are_read_through_dlpack_there(daemon, client):
    with client.alloc(4096) as buf:
        want = (np.arange(128, dtype=np.int16) - 64) * 7
        np.asarray(buf.as_tensor("int16", offset=128))[:128] = want
        token = buf.ref().take()
        buf.set_ready()
        state, dtype, shape, values = run_child(bbchild.tensor_read, daemon.socket, token)
        assert (state, dtype, shape) == ("ready", "<i2", (8, 16))
        assert values == want.reshape(8, 16).tolist()


def test_legacy_capsule_fields_are_the_tensor(client):
    with client.alloc(4096) as buf:
        t = buf.as_tensor("float32", (4, 8), offset=256)
        cap = t.__dlpack__()
        assert bbchild.capsule_name(cap) == "dltensor"
        f = bbchild.tensor_fields(cap)
        assert f["data"] == address(np.asarray(buf)) + 256 == t.data_ptr
        assert f["device"] == (kDLCPU, 0)
        assert (f["ndim"], f["shape"], f["dtype"]) == (2, (4, 8), (kDLFloat, 32, 1))
        assert f["strides"] in (None, (8, 1)), "in elements, row-major"
        assert f["byte_offset"] == 0
        assert f["deleter"]


def test_versioned_capsule_when_the_consumer_asks_for_dlpack_1(client):
    with client.alloc(4096) as buf:
        t = buf.as_tensor("bfloat16", (2, 3, 4))
        cap = t.__dlpack__(max_version=(1, 0))
        assert bbchild.capsule_name(cap) == "dltensor_versioned"
        m = bbchild.managed(cap)
        assert (m.major, m.minor) == (1, 0) and m.flags == 0, "DLPack 1.0, writable"
        f = bbchild.tensor_fields(cap)
        assert (f["dtype"], f["shape"], f["strides"]) == ((kDLBfloat, 16, 1), (2, 3, 4), (12, 4, 1))
        assert bbchild.capsule_name(t.__dlpack__(max_version=(0, 8))) == "dltensor"
        assert bbchild.capsule_name(t.__dlpack__(max_version=(2, 1))) == "dltensor_versioned"


def test_dlpack_keywords_as_the_specification_has_them(client):
    with client.alloc(64) as buf:
        t = buf.as_tensor()
        assert bbchild.capsule_name(t.__dlpack__(stream=None, dl_device=(kDLCPU, 0), copy=False)) == "dltensor"
        with pytest.raises(BufferError):
            t.__dlpack__(dl_device=(kDLCUDA, 0))
        with pytest.raises(BufferError):
            t.__dlpack__(copy=True)
        with pytest.raises(TypeError):
            t.__dlpack__(stream="default")


def test_deleter_runs_once_for_a_capsule_nobody_took(client):
    buf = client.alloc(4096)
    id_ = buf.id
    cap = buf.as_tensor("uint8").__dlpack__()
    spy = bbchild.CountedDeleter(cap)
    buf.close()
    gc.collect()
    assert client.stat(id_).refs == 1, "the capsule holds the buffer"
    del cap
    assert spy.calls == 1
    gc.collect()
    with pytest.raises(bufbroker.NotFound):
        client.stat(id_)


def test_deleter_runs_once_when_a_c_consumer_is_done(client):
    buf = client.alloc(4096)
    id_ = buf.id
    cap = buf.as_tensor("uint8").__dlpack__(max_version=(1, 0))
    spy = bbchild.CountedDeleter(cap)
    buf.close()
    gc.collect()
    bbchild.consume_by_hand(cap)
    assert spy.calls == 1
    assert bbchild.capsule_name(cap) == "used_dltensor_versioned"
    del cap  # a used capsule does not call the deleter again
    gc.collect()
    assert spy.calls == 1
    with pytest.raises(bufbroker.NotFound):
        client.stat(id_)


def test_numpy_array_from_dlpack_keeps_the_buffer_until_it_goes(client):
    before = _dlpack.live_exports()
    buf = client.alloc(4096)
    id_ = buf.id

    class Spied:
        """Gives numpy a capsule whose deleter the test watches."""

        def __init__(self, tensor):
            self.capsule = tensor.__dlpack__()
            self.spy = bbchild.CountedDeleter(self.capsule)

        def __dlpack__(self, **kwargs):
            capsule, self.capsule = self.capsule, None
            return capsule

        def __dlpack_device__(self):
            return (kDLCPU, 0)

    given = Spied(buf.as_tensor("uint32"))
    spy = given.spy
    a = np.from_dlpack(given)
    del given
    buf.close()
    gc.collect()
    assert a.sum() == 0
    assert client.stat(id_).refs == 1, "the array keeps the buffer"
    assert spy.calls == 0
    del a
    gc.collect()
    assert spy.calls == 1
    assert _dlpack.live_exports() == before
    with pytest.raises(bufbroker.NotFound):
        client.stat(id_)


def test_a_consumer_that_fails_still_frees_the_tensor(client, capfd):
    before = _dlpack.live_exports()
    with client.alloc(64) as buf:
        # numpy has no bfloat16: it drops the capsule with its error set,
        # which the capsule's destructor cannot hand back (numpy then
        # reports a SystemError); the destructor says what it was.
        with pytest.raises(Exception):
            np.from_dlpack(buf.as_tensor("bfloat16"))
        gc.collect()
        assert _dlpack.live_exports() == before
        assert "a DLPack consumer failed with the tensor unused" in capfd.readouterr().err


def test_numpy_array_and_tensor_keep_the_buffer_after_close(client):
    buf = client.alloc(4096)
    id_ = buf.id
    a = np.asarray(buf)
    t = buf.as_tensor("float64")
    b = np.asarray(buf.as_tensor("int32"))
    buf.close()
    gc.collect()
    a[0] = 9
    assert client.stat(id_).refs == 1
    del a, t
    gc.collect()
    assert client.stat(id_).refs == 1, "b's tensor still holds it"
    del b
    gc.collect()
    with pytest.raises(bufbroker.NotFound):
        client.stat(id_)


def test_other_code_setting_pythonapi_prototypes_does_not_break_the_capsules(client):
    # Libraries (TVM, MXNet, dlpack's own example) set prototypes on the
    # shared ctypes.pythonapi function objects; the package must not use those.
    import ctypes

    f = ctypes.pythonapi.PyCapsule_IsValid
    saved = (f.restype, f.argtypes)
    f.restype, f.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
    try:
        before = _dlpack.live_exports()
        with client.alloc(64) as buf:
            cap = buf.as_tensor().__dlpack__()
            assert _dlpack.live_exports() == before + 1
            del cap
            assert _dlpack.live_exports() == before, "the unused capsule's deleter ran"
    finally:
        f.restype, f.argtypes = saved
