# SPDX-License-Identifier: Apache-2.0
"""Code that tests run in child processes (multiprocessing, spawn): it must
live in an importable module, not in a test file."""

import os

import numpy as np

import bufbroker


def pattern(size, seed):
    """Byte i is (i*31 + seed) & 0xff, the examples' pattern."""
    return ((np.arange(size, dtype=np.uint64) * 31 + seed) & 0xFF).astype(np.uint8)


def consume(socket, token, seed, results):
    """Adopt the token, wait for READY, check every byte; report
    (state, matches, refs seen, id)."""
    with bufbroker.Client(socket) as c, c.adopt(token) as buf:
        state = buf.wait(10)
        data = np.frombuffer(buf.view(), dtype=np.uint8)
        ok = bool(np.array_equal(data, pattern(buf.size, seed)))
        del data
        results.send((state, ok, buf.stat().refs, buf.id))


def fill(socket, token, seed, results):
    """Adopt the token, write the pattern through numpy, set READY."""
    with bufbroker.Client(socket) as c, c.adopt(token) as buf:
        a = np.frombuffer(buf.view(), dtype=np.uint8)
        a[:] = pattern(buf.size, seed)
        del a
        buf.set_ready()
        results.send(buf.id)


def adopt_and_die(socket, token, results):
    """Adopt the token, report, and exit without releasing anything."""
    c = bufbroker.Client(socket)
    buf = c.adopt(token)
    results.send(buf.stat().refs)
    os._exit(0)  # no close, no disconnect, no finalizers


class FakeDriver:
    """Just enough of the CUDA driver API (here libfakecuda.so, which
    bufbroker's client library loaded too: same path, same instance) to move
    bytes to and from a device pointer."""

    def __init__(self, path):
        import ctypes

        self.c = ctypes
        self.lib = ctypes.CDLL(path)
        self._check(self.lib.cuInit(0), "cuInit")

    def _check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUresult {rc}")

    def use_device(self, uuid):
        """Make current the primary context of the device with this UUID."""
        c = self.c
        n = c.c_int()
        self._check(self.lib.cuDeviceGetCount(c.byref(n)), "cuDeviceGetCount")
        for i in range(n.value):
            dev = c.c_int()
            u = (c.c_ubyte * 16)()
            self._check(self.lib.cuDeviceGet(c.byref(dev), i), "cuDeviceGet")
            self._check(self.lib.cuDeviceGetUuid_v2(u, dev), "cuDeviceGetUuid_v2")
            if bytes(u) == uuid:
                ctx = c.c_void_p()
                self._check(self.lib.cuDevicePrimaryCtxRetain(c.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
                self._check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
                return
        raise RuntimeError(f"no device with UUID {uuid.hex()}")

    def pointer_device(self, ptr):
        u = (self.c.c_ubyte * 16)()
        rc = self.lib.fakecuda_pointer_device(self.c.c_ulonglong(ptr), u)
        return bytes(u) if rc == 0 else None

    def htod(self, ptr, data):
        self._check(
            self.lib.cuMemcpyHtoD_v2(self.c.c_ulonglong(ptr), data, self.c.c_size_t(len(data))),
            "cuMemcpyHtoD_v2",
        )

    def dtoh(self, ptr, n):
        out = self.c.create_string_buffer(n)
        self._check(self.lib.cuMemcpyDtoH_v2(out, self.c.c_ulonglong(ptr), self.c.c_size_t(n)), "cuMemcpyDtoH_v2")
        return out.raw


def cuda_read(socket, token, driver_path, results):
    """Adopt a CUDA buffer, wait for READY, and send back its bytes, read
    through the pointer in its __cuda_array_interface__."""
    with bufbroker.Client(socket) as c, c.adopt(token) as buf:
        state = buf.wait(10)
        ptr = buf.__cuda_array_interface__["data"][0]
        drv = FakeDriver(driver_path)
        if buf.cuda_handle == "vmm":
            vmm = buf.cuda_vmm()
            os.close(vmm.fd)
            uuid = vmm.device_uuid
        else:
            uuid = buf.cuda_ipc().device_uuid
        drv.use_device(uuid)
        results.send((state, drv.dtoh(ptr, buf.size)))


# ---- DLPack, read back as a consumer written in C would -----------------------
# dlpack.h's structs, transcribed here apart from the package's own (a
# mistake in those must not be mirrored by the test).

import ctypes  # noqa: E402


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
# Function objects of the test's own: pythonapi's attributes are shared.
_IsValid = ctypes.pythonapi["PyCapsule_IsValid"]
_IsValid.restype = ctypes.c_int
_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_GetPointer = ctypes.pythonapi["PyCapsule_GetPointer"]
_GetPointer.restype = ctypes.c_void_p
_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_SetName = ctypes.pythonapi["PyCapsule_SetName"]
_SetName.restype = ctypes.c_int
_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]


def capsule_name(capsule):
    """Which of the four DLPack names the capsule has (None: another)."""
    for name in (b"dltensor", b"used_dltensor", b"dltensor_versioned", b"used_dltensor_versioned"):
        if _IsValid(capsule, name):
            return name.decode()
    return None


def managed(capsule):
    """The DLManagedTensor[Versioned] a fresh capsule holds."""
    name = capsule_name(capsule)
    addr = _GetPointer(capsule, name.encode())
    cls = DLManagedTensorVersioned if name == "dltensor_versioned" else DLManagedTensor
    return cls.from_address(addr)


def tensor_fields(capsule):
    """The DLTensor of a fresh capsule as a dict of plain values."""
    m = managed(capsule)
    t = m.dl_tensor
    ndim = t.ndim
    return {
        "data": t.data,
        "device": (t.device.device_type, t.device.device_id),
        "ndim": ndim,
        "dtype": (t.dtype.code, t.dtype.bits, t.dtype.lanes),
        "shape": tuple(t.shape[i] for i in range(ndim)),
        "strides": None if not t.strides else tuple(t.strides[i] for i in range(ndim)),
        "byte_offset": t.byte_offset,
        "deleter": m.deleter,
    }


class CountedDeleter:
    """Puts a counting wrapper in place of a capsule's deleter (as a
    test's spy): .calls says how often the consumer side called it, and
    each call goes on to the real one."""

    def __init__(self, capsule):
        self.calls = 0
        m = managed(capsule)
        self.real = DELETER(m.deleter)

        def wrapper(addr):
            self.calls += 1
            self.real(addr)

        self.fn = DELETER(wrapper)
        m.deleter = ctypes.cast(self.fn, ctypes.c_void_p).value


# A capsule keeps the name's pointer, not a copy: names that live forever.
_USED = {"dltensor": b"used_dltensor", "dltensor_versioned": b"used_dltensor_versioned"}


def consume_by_hand(capsule):
    """What a C consumer does: take the tensor (rename the capsule), then
    call its deleter once when done."""
    m = managed(capsule)
    name = capsule_name(capsule)
    assert _SetName(capsule, _USED[name]) == 0
    DELETER(m.deleter)(ctypes.addressof(m))


def tensor_fill(socket, token, seed, results):
    """Adopt a host buffer, write uint32 rows through np.asarray of a typed
    view at byte offset 64, set READY."""
    with bufbroker.Client(socket) as c, c.adopt(token) as buf:
        a = np.asarray(buf.as_tensor("uint32", (16, 32), offset=64))
        a[:] = np.arange(16 * 32, dtype=np.uint32).reshape(16, 32) * seed
        del a
        buf.set_ready()
        results.send(buf.id)


def tensor_read(socket, token, results):
    """Adopt a host buffer, wait for READY, and send back what
    np.from_dlpack of a typed view (int16, 8 x 16, offset 128) reads."""
    with bufbroker.Client(socket) as c, c.adopt(token) as buf:
        state = buf.wait(10)
        a = np.from_dlpack(buf.as_tensor(np.int16, (8, 16), offset=128))
        results.send((state, a.dtype.str, a.shape, a.tolist()))


def cuda_capsule(socket, token, results):
    """Adopt a CUDA buffer and send back its bb_map pointer, the fields of
    a DLPack capsule of a float32 (4, 8) view at offset 256, and
    __dlpack_device__ (this process's CUDA_VISIBLE_DEVICES applies)."""
    with bufbroker.Client(socket) as c, c.adopt(token) as buf:
        ptr = buf.__cuda_array_interface__["data"][0]
        t = buf.as_tensor("float32", (4, 8), offset=256)
        cap = t.__dlpack__(stream=None)
        fields = tensor_fields(cap)
        del fields["deleter"]
        results.send((ptr, t.__dlpack_device__(), buf.__dlpack_device__(), capsule_name(cap), fields))
