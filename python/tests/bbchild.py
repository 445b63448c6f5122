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
