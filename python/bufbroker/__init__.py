# SPDX-License-Identifier: Apache-2.0
"""Python binding of bufbroker: buffers owned by bufbrokerd, shared across
processes with reference counts the daemon keeps.

Pure ctypes over libbufbroker (no compiled extension). The library is found
through ``$BUFBROKER_LIBRARY``, else as ``libbufbroker.so.0`` through the
dynamic loader, else by ``ctypes.util.find_library("bufbroker")``, and
loaded on first use.

A producer::

    import bufbroker, numpy as np

    with bufbroker.Client() as c:
        buf = c.alloc(1 << 20, name="frame")
        a = np.frombuffer(buf.view(), dtype=np.float32)   # no copy
        a[:] = 1.0
        token = buf.ref().take()    # a token holding its own reference
        print(token)                # send it to the consumer
        buf.set_ready()

A consumer, in another process::

    with bufbroker.Client() as c, c.adopt(token) as buf:
        if buf.wait(timeout=5) == "ready":
            data = np.frombuffer(buf.view(), dtype=np.float32)

Typed views for DLPack and numpy, no copy::

    x = np.from_dlpack(buf.as_tensor("float32", (rows, cols)))
    t = torch.from_dlpack(buf.as_tensor(torch.float16, (rows, cols)))

See python/README.md for the whole API and its lifetime rules.
"""

from ._native import (
    IPC_HANDLE_SIZE,
    KIND_CUDA,
    KIND_HOST,
    NAME_MAX,
    SHARE_ANY,
    SHARE_GID,
    SHARE_UID,
    STATE_FAILED,
    STATE_PENDING,
    STATE_READY,
    TOKEN_SIZE,
    library_candidates,
)
from .client import Buffer, Client, CudaIpc, CudaVmm, Info, Tensor, strerror
from .errors import (
    ERR_DENIED,
    ERR_DISCONNECTED,
    ERR_EXISTS,
    ERR_FAILED,
    ERR_INVALID,
    ERR_NO_MEMORY,
    ERR_NOT_FOUND,
    ERR_PROTOCOL,
    ERR_STATE,
    ERR_SYSTEM,
    ERR_TIMEOUT,
    ERR_UNSUPPORTED,
    OK,
    BufbrokerError,
    BufferFailed,
    Denied,
    Disconnected,
    Exists,
    InvalidArgument,
    NoMemory,
    NotFound,
    ProtocolError,
    StateError,
    SystemFailure,
    Timeout,
    Unsupported,
    error_class,
)

__version__ = "0.1.0"

__all__ = [
    "Client",
    "Buffer",
    "Tensor",
    "Info",
    "CudaIpc",
    "CudaVmm",
    "strerror",
    "error_class",
    "library_candidates",
    "BufbrokerError",
    "InvalidArgument",
    "NotFound",
    "Denied",
    "NoMemory",
    "Timeout",
    "Disconnected",
    "ProtocolError",
    "BufferFailed",
    "Unsupported",
    "StateError",
    "Exists",
    "SystemFailure",
    "OK",
    "ERR_INVALID",
    "ERR_NOT_FOUND",
    "ERR_DENIED",
    "ERR_NO_MEMORY",
    "ERR_TIMEOUT",
    "ERR_DISCONNECTED",
    "ERR_PROTOCOL",
    "ERR_FAILED",
    "ERR_UNSUPPORTED",
    "ERR_STATE",
    "ERR_EXISTS",
    "ERR_SYSTEM",
    "KIND_HOST",
    "KIND_CUDA",
    "STATE_PENDING",
    "STATE_READY",
    "STATE_FAILED",
    "SHARE_UID",
    "SHARE_GID",
    "SHARE_ANY",
    "TOKEN_SIZE",
    "NAME_MAX",
    "IPC_HANDLE_SIZE",
]
