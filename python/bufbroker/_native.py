# SPDX-License-Identifier: Apache-2.0
"""Load libbufbroker and declare its C API for ctypes.

Everything here mirrors include/bufbroker/bufbroker.h; nothing else in the
package touches ctypes prototypes. The library is loaded on first use, so
``import bufbroker`` works (constants, exceptions, docs) even where the
library is not installed.
"""

import ctypes
import ctypes.util
import os
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

# Sizes from the header.
IPC_HANDLE_SIZE = 64
TOKEN_SIZE = 16
NAME_MAX = 127

# bb_kind, bb_state and BB_SHARE_*.
KIND_HOST = 1
KIND_CUDA = 2
STATE_PENDING = 0
STATE_READY = 1
STATE_FAILED = 2
SHARE_UID = 0
SHARE_GID = 1
SHARE_ANY = 2
CUDA_HANDLE_DEFAULT = 0
CUDA_HANDLE_AUTO = 1
CUDA_HANDLE_LEGACY = 2
CUDA_HANDLE_VMM = 3


class bb_token(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * TOKEN_SIZE)]


class bb_alloc_opts(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("kind", ctypes.c_int),  # bb_kind
        ("device", ctypes.c_int),
        ("name", ctypes.c_char_p),
        ("share", ctypes.c_int),
    ]


class bb_reconnect_opts(ctypes.Structure):
    _fields_ = [
        ("enabled", ctypes.c_int),
        ("timeout_ms", ctypes.c_uint32),
        ("backoff_ms", ctypes.c_uint32),
        ("max_backoff_ms", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32 * 4),
    ]


class bb_info(ctypes.Structure):
    _fields_ = [
        ("id", ctypes.c_uint64),
        ("size", ctypes.c_size_t),
        ("kind", ctypes.c_int),  # bb_kind
        ("device", ctypes.c_int),
        ("state", ctypes.c_int),  # bb_state
        ("refs", ctypes.c_uint64),
        ("name", ctypes.c_char * (NAME_MAX + 1)),
        ("error", ctypes.c_char * 256),
    ]


class bb_cuda_ipc(ctypes.Structure):
    _fields_ = [
        ("handle", ctypes.c_ubyte * IPC_HANDLE_SIZE),
        ("offset", ctypes.c_uint64),
        ("size", ctypes.c_size_t),
        ("device_uuid", ctypes.c_ubyte * 16),
    ]


class bb_cuda_vmm(ctypes.Structure):
    _fields_ = [
        ("fd", ctypes.c_int),
        ("allocation", ctypes.c_uint64),
        ("allocation_size", ctypes.c_size_t),
        ("offset", ctypes.c_uint64),
        ("size", ctypes.c_size_t),
        ("device_uuid", ctypes.c_ubyte * 16),
    ]


_client_p = ctypes.c_void_p  # bb_client *
_buf_p = ctypes.c_void_p  # bb_buf *
_P = ctypes.POINTER

# name: (restype, argtypes)
_PROTOTYPES: Dict[str, Tuple[Any, List[Any]]] = {
    "bb_connect": (ctypes.c_int, [ctypes.c_char_p, _P(_client_p)]),
    "bb_disconnect": (None, [_client_p]),
    "bb_client_set_reconnect": (ctypes.c_int, [_client_p, _P(bb_reconnect_opts)]),
    "bb_client_resumes": (ctypes.c_uint64, [_client_p]),
    "bb_alloc": (ctypes.c_int, [_client_p, _P(bb_alloc_opts), _P(_buf_p)]),
    "bb_open": (ctypes.c_int, [_client_p, ctypes.c_uint64, _P(_buf_p)]),
    "bb_open_name": (ctypes.c_int, [_client_p, ctypes.c_char_p, _P(_buf_p)]),
    "bb_import_fd": (ctypes.c_int, [_client_p, ctypes.c_int, _P(bb_alloc_opts), _P(_buf_p)]),
    "bb_ref": (_buf_p, [_buf_p]),
    "bb_unref": (None, [_buf_p]),
    "bb_take": (ctypes.c_int, [_buf_p, _P(bb_token)]),
    "bb_adopt": (ctypes.c_int, [_client_p, _P(bb_token), _P(_buf_p)]),
    "bb_token_format": (None, [_P(bb_token), ctypes.c_char_p]),
    "bb_token_parse": (ctypes.c_int, [ctypes.c_char_p, _P(bb_token)]),
    "bb_set_ready": (ctypes.c_int, [_buf_p]),
    "bb_set_error": (ctypes.c_int, [_buf_p, ctypes.c_char_p]),
    "bb_wait": (ctypes.c_int, [_buf_p, ctypes.c_int, _P(ctypes.c_int)]),
    "bb_map": (ctypes.c_int, [_buf_p, _P(ctypes.c_void_p)]),
    "bb_cuda_ipc_of": (ctypes.c_int, [_buf_p, _P(bb_cuda_ipc)]),
    "bb_alloc_cuda": (ctypes.c_int, [_client_p, _P(bb_alloc_opts), ctypes.c_int, _P(_buf_p)]),
    "bb_cuda_handle_of": (ctypes.c_int, [_buf_p]),
    "bb_cuda_vmm_of": (ctypes.c_int, [_buf_p, _P(bb_cuda_vmm)]),
    "bb_id": (ctypes.c_uint64, [_buf_p]),
    "bb_size": (ctypes.c_size_t, [_buf_p]),
    "bb_buf_kind": (ctypes.c_int, [_buf_p]),
    "bb_stat": (ctypes.c_int, [_client_p, ctypes.c_uint64, _P(bb_info)]),
    "bb_retain": (ctypes.c_int, [_client_p, ctypes.c_uint64, ctypes.c_uint32]),
    "bb_release": (ctypes.c_int, [_client_p, ctypes.c_uint64, ctypes.c_uint32]),
    "bb_strerror": (ctypes.c_char_p, [ctypes.c_int]),
    "bb_last_error": (ctypes.c_char_p, []),
}

#: The library's soname: the ABI this package is written for.
SONAME = "libbufbroker.so.0"

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None


def library_candidates() -> List[str]:
    """The names ``lib()`` tries, in order: $BUFBROKER_LIBRARY (alone, when
    set); else ``libbufbroker.so.0`` through the dynamic loader's search
    (``LD_LIBRARY_PATH``, the ``ldconfig`` cache, the system's library
    directories: where the installed library is), then what
    ``ctypes.util.find_library("bufbroker")`` finds when that is another
    name (it may run ``ldconfig`` and the compiler: ``lib()`` asks it only
    when the soname does not load)."""
    env = os.environ.get("BUFBROKER_LIBRARY")
    if env:
        return [env]
    names = [SONAME]
    found = ctypes.util.find_library("bufbroker")
    if found and found not in names:
        names.append(found)
    return names


def _candidates() -> Iterator[str]:
    """library_candidates(), lazily: find_library only when needed."""
    env = os.environ.get("BUFBROKER_LIBRARY")
    if env:
        yield env
        return
    yield SONAME
    found = ctypes.util.find_library("bufbroker")
    if found and found != SONAME:
        yield found


def lib() -> ctypes.CDLL:
    """The loaded libbufbroker with its prototypes declared; loads it on the
    first call. Raises OSError naming every path tried when none loads."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        errors = []
        for name in _candidates():
            try:
                handle = ctypes.CDLL(name)
            except OSError as e:
                errors.append(f"{name}: {e}")
                continue
            try:
                for fn, (restype, argtypes) in _PROTOTYPES.items():
                    f = getattr(handle, fn)
                    f.restype = restype
                    f.argtypes = argtypes
            except AttributeError as e:
                errors.append(f"{name}: not a libbufbroker: {e}")
                continue
            _lib = handle
            return _lib
        raise OSError(
            "cannot load libbufbroker (set BUFBROKER_LIBRARY to its path): " + "; ".join(errors)
        )


def last_error() -> str:
    """bb_last_error() as text: the calling thread's last failure."""
    raw: Optional[bytes] = lib().bb_last_error()
    return raw.decode("utf-8", "replace") if raw else ""


def strerror(code: int) -> str:
    """bb_strerror(code) as text."""
    raw: Optional[bytes] = lib().bb_strerror(code)
    return raw.decode("utf-8", "replace") if raw else ""


def cuda_ordinal(uuid: bytes) -> int:
    """This process's ordinal of the CUDA device with this UUID, as the
    driver libbufbroker loads ($BUFBROKER_CUDA_LIBRARY, default
    libcuda.so.1; the same instance, so the same visible devices) numbers
    them. OSError when the driver cannot be loaded or asked, LookupError
    when no visible device has that UUID."""
    name = os.environ.get("BUFBROKER_CUDA_LIBRARY") or "libcuda.so.1"
    drv = ctypes.CDLL(name)
    get_uuid = getattr(drv, "cuDeviceGetUuid_v2", None) or drv.cuDeviceGetUuid

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise OSError(f"{name}: {what} failed: CUresult {rc}")

    check(drv.cuInit(0), "cuInit")
    count = ctypes.c_int()
    check(drv.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    for ordinal in range(count.value):
        dev = ctypes.c_int()
        raw = (ctypes.c_ubyte * 16)()
        check(drv.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
        check(get_uuid(raw, dev), "cuDeviceGetUuid")
        if bytes(raw) == uuid:
            return ordinal
    raise LookupError(f"no CUDA device in this process has UUID {uuid.hex()}")
