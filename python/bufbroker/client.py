# SPDX-License-Identifier: Apache-2.0
"""Client (one connection to bufbrokerd) and Buffer (one handle to a buffer).

Lifetimes, and why they are safe:

* A ``_Connection`` owns the ``bb_client *``. The Client, every Buffer made
  through it and every memory export (host memory view, CUDA array
  interface) keeps it alive, so the connection closes only when nothing can
  reach its handles any more, or when ``Client.close()`` is called.
* Each Buffer object owns one local count of its ``bb_buf *`` (``bb_ref`` /
  ``bb_unref``); ``Buffer.ref()`` makes another object with another count.
* Each memory export owns a count of its own, so closing the Buffer never
  unmaps memory that a view still uses: the daemon reference is released
  when the last of the Buffer and its views goes. ``Client.close()`` with
  views alive closes the client for use at once and defers the disconnect
  (which would unmap) until the last view is gone.
* A Tensor (``Buffer.as_tensor``) is such an export, and so is every
  DLPack capsule it makes: the capsule's count goes when its consumer
  calls the tensor's deleter, or when the capsule dies unused.
* Every call that uses a handle holds a temporary count and pins the
  connection for its duration, so a close() on another thread cannot free
  a handle under a call in progress.
"""

import contextlib
import ctypes
import functools
import importlib
import math
import operator
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import (
    Any,
    Dict,
    Iterator,
    Mapping,
    NamedTuple,
    NoReturn,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    Union,
)

from . import _dlpack
from . import _native as _n
from ._dlpack import DTypeLike
from .errors import (
    ERR_INVALID,
    ERR_SYSTEM,
    ERR_TIMEOUT,
    BufbrokerError,
    InvalidArgument,
    SystemFailure,
    error_for,
)

_KINDS = {"host": _n.KIND_HOST, "cuda": _n.KIND_CUDA}
_CUDA_HANDLES = {
    "default": _n.CUDA_HANDLE_DEFAULT,
    "auto": _n.CUDA_HANDLE_AUTO,
    "legacy": _n.CUDA_HANDLE_LEGACY,
    "vmm": _n.CUDA_HANDLE_VMM,
}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}
_STATE_NAMES = {_n.STATE_PENDING: "pending", _n.STATE_READY: "ready", _n.STATE_FAILED: "failed"}
_SHARES = {"uid": _n.SHARE_UID, "gid": _n.SHARE_GID, "any": _n.SHARE_ANY}

_INT_MAX = 2**31 - 1
_UINT32_MAX = 2**32 - 1
_UINT64_MAX = 2**64 - 1
_SIZE_MAX = 2 ** (8 * ctypes.sizeof(ctypes.c_size_t)) - 1
# bb_wait is called in slices of at most this many ms, so that signal
# handlers (Ctrl-C) run while a long wait is in progress.
_WAIT_SLICE_MS = 1000

#: What names a kind (``"host"``, ``"cuda"`` or a ``KIND_*`` int).
Kind = Union[str, int]
#: What names a CUDA handle kind (``"default"``, ``"auto"``, ``"legacy"``,
#: ``"vmm"`` or a ``CUDA_HANDLE_*`` int).
CudaHandle = Union[str, int]
#: What names a share policy (``"uid"``, ``"gid"``, ``"any"`` or a ``SHARE_*`` int).
Share = Union[str, int]
#: Text the C API takes: str (UTF-8) or bytes.
Text = Union[str, bytes, bytearray]
#: A path: str, bytes or os.PathLike.
StrPath = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]


class HasFileno(Protocol):
    """An object with a file descriptor, e.g. a file or socket."""

    def fileno(self) -> int: ...


def _check(rc: int) -> None:
    """Raise the BufbrokerError for a non-zero libbufbroker return code."""
    if rc != 0:
        raise error_for(rc, _n.last_error())


def _invalid(message: str) -> InvalidArgument:
    return InvalidArgument(ERR_INVALID, message)


def _uint(what: str, value: object, maximum: int) -> int:
    # Any integer type (numpy's too: __index__), never a bool or a float.
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise _invalid(f"{what} must be an int, not {type(value).__name__}")
    value = operator.index(value)
    if value < 0 or value > maximum:
        raise _invalid(f"{what} {value} is out of range (0..{maximum})")
    return value


def _ms(what: str, seconds: Optional[float]) -> int:
    """Seconds (None: the default, 0) as the library's milliseconds."""
    if seconds is None:
        return 0
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise _invalid(f"{what} must be a number of seconds, not {type(seconds).__name__}")
    if not 0 < seconds <= 0xFFFFFFFF / 1000:
        raise _invalid(f"{what} {seconds} is out of range (above 0, at most 4294967 s)")
    return max(1, round(seconds * 1000))


def _choice(what: str, value: object, table: Mapping[str, int]) -> int:
    if isinstance(value, str):
        try:
            return table[value.lower()]
        except KeyError:
            pass
    elif isinstance(value, int) and not isinstance(value, bool) and value in table.values():
        return value
    names = ", ".join(repr(k) for k in table)
    raise _invalid(f"{what} must be one of {names}, not {value!r}")


def _text(what: str, value: object) -> Optional[bytes]:
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    raise _invalid(f"{what} must be a str, not {type(value).__name__}")


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def strerror(code: int) -> str:
    """The library's sentence for a BB_ERR_* code (bb_strerror)."""
    return _n.strerror(code)


@dataclass(frozen=True)
class Info:
    """A buffer as the daemon sees it now (``bb_stat``).

    Attributes:
        id: the buffer's id.
        size: its size in bytes.
        kind: ``"host"`` or ``"cuda"``.
        device: the CUDA device ordinal as the daemon numbers devices (0 for host).
        state: ``"pending"``, ``"ready"`` or ``"failed"``.
        refs: the daemon's count: one per connection holding it plus live tokens.
        name: its name, or None when unnamed.
        error: the message given to ``set_error``, or None.
    """

    id: int
    size: int
    kind: str
    device: int
    state: str
    refs: int
    name: Optional[str]
    error: Optional[str]


class CudaIpc(NamedTuple):
    """What ``Buffer.cuda_ipc()`` returns (``bb_cuda_ipc``)."""

    #: The 64 cudaIpcMemHandle_t bytes of the allocation holding the buffer.
    handle: bytes
    #: The buffer's offset inside that allocation.
    offset: int
    #: The buffer's size in bytes.
    size: int
    #: The device's 16 UUID bytes (cuDeviceGetUuid).
    device_uuid: bytes

#: What ``Buffer.cuda_vmm()`` returns (``bb_cuda_vmm``): a new file
#: descriptor of the VMM allocation holding the buffer (the caller closes
#: it), the allocation's identity and size, the buffer's offset inside it,
#: its size, and the device's UUID bytes.
class CudaVmm(NamedTuple):
    """What ``Buffer.cuda_vmm()`` returns (``bb_cuda_vmm``)."""

    #: A new file descriptor of the VMM allocation holding the buffer: the
    #: caller closes it (``os.close``).
    fd: int
    #: The allocation's identity (never reused by one daemon).
    allocation: int
    #: The allocation's bytes: map it whole.
    allocation_size: int
    #: The buffer's offset inside that allocation.
    offset: int
    #: The buffer's size in bytes.
    size: int
    #: The device's 16 UUID bytes (cuDeviceGetUuid).
    device_uuid: bytes


def _info_from(raw: _n.bb_info) -> Info:
    return Info(
        id=raw.id,
        size=raw.size,
        kind=_KIND_NAMES.get(raw.kind, str(raw.kind)),
        device=raw.device,
        state=_STATE_NAMES.get(raw.state, str(raw.state)),
        refs=raw.refs,
        name=_decode(raw.name) or None,
        error=_decode(raw.error) or None,
    )


# ---- the connection ----------------------------------------------------------


def _disconnect(ptr: int, pid: int) -> None:
    if os.getpid() == pid:
        _n.lib().bb_disconnect(ptr)


def _release_handle(conn: "_Connection", handle: int) -> None:
    """A Buffer's finalizer: give its local count back."""
    if os.getpid() != conn.pid:
        return  # a forked child: the handle is the parent's
    with conn.lock:
        if conn.closing:
            return  # the disconnect releases it
        conn.pins += 1
    try:
        _n.lib().bb_unref(handle)
    finally:
        conn.unpin()


def _export_gone(conn: "_Connection", handle: int) -> None:
    """A memory export's finalizer: its count and its pin go."""
    if os.getpid() != conn.pid:
        return
    _n.lib().bb_unref(handle)
    conn.unpin()


class _Connection:
    """One bb_client, shared by a Client, its Buffers and their exports."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr  # the bb_client * as an int
        self.pid = os.getpid()  # the process that may use it
        self.lock = threading.Lock()  # guards pins and closing
        self.pins = 0  # calls in flight plus live memory exports
        self.closing = False  # Client.close() was called
        self.buffers: "weakref.WeakSet[Buffer]" = weakref.WeakSet()  # detached on close
        self._finalizer = weakref.finalize(self, _disconnect, ptr, self.pid)
        # At interpreter exit the process's end releases everything; an
        # explicit disconnect then could unmap memory still in use.
        self._finalizer.atexit = False

    def pin(self) -> None:
        """Keep the connection open until unpin(); raises when it is closed
        or belongs to another process."""
        if os.getpid() != self.pid:
            raise RuntimeError(
                f"this bufbroker connection belongs to process {self.pid}; "
                "a forked child must make its own Client"
            )
        with self.lock:
            if self.closing:
                raise ValueError("the bufbroker Client is closed")
            self.pins += 1

    def unpin(self) -> None:
        with self.lock:
            self.pins -= 1
            last = self.closing and self.pins == 0
        if last:
            self._finalizer()

    @contextlib.contextmanager
    def pinned(self) -> Iterator[int]:
        self.pin()
        try:
            yield self.ptr
        finally:
            self.unpin()

    def close(self) -> None:
        with self.lock:
            if self.closing:
                return
            self.closing = True
            buffers = list(self.buffers)
        for b in buffers:
            b._detach()
        with self.lock:
            now = self.pins == 0
        if now:
            self._finalizer()

    @property
    def closed(self) -> bool:
        return self.closing


# ---- the client ----------------------------------------------------------------


class Client:
    """One connection to bufbrokerd (``bb_connect``).

    ``socket`` is the daemon's socket path; None uses ``$BUFBROKER_SOCKET``,
    else the default socket. Use it as a context manager, or call
    :meth:`close`; a Client that is simply dropped disconnects once no
    Buffer made through it is left. The connection is thread-safe. A child
    made by ``fork`` must not use its parent's Client: it makes its own.
    """

    def __init__(self, socket: Optional[StrPath] = None, *, reconnect: bool = True) -> None:
        path = None if socket is None else os.fsencode(socket)
        ptr = ctypes.c_void_p()
        _check(_n.lib().bb_connect(path, ctypes.byref(ptr)))
        assert ptr.value is not None
        self._conn = _Connection(ptr.value)
        #: The socket path given, or None for the default.
        self.socket = socket
        if not reconnect:
            self.set_reconnect(enabled=False)

    def set_reconnect(
        self,
        enabled: bool = True,
        *,
        timeout: Optional[float] = None,
        backoff: Optional[float] = None,
        max_backoff: Optional[float] = None,
    ) -> None:
        """How this client rides out a daemon restart (``bb_client_set_reconnect``).

        When the daemon keeps its state across restarts, a broken connection
        is reconnected and the session resumed on its own: buffers, counts,
        mappings and waits carry on, and calls made meanwhile wait. It gives
        up after ``timeout`` seconds (default 10) and then raises
        :class:`Disconnected`, as a client of a daemon that keeps no state
        does at once. ``backoff`` is the first pause between attempts
        (default 0.01 s), doubling up to ``max_backoff`` (default 0.5 s).
        ``enabled=False``, or ``BUFBROKER_RECONNECT=0`` in the environment
        when the Client is made, turns it off. None: the default."""
        opts = _n.bb_reconnect_opts()
        opts.enabled = 1 if enabled else 0
        opts.timeout_ms = _ms("timeout", timeout)
        opts.backoff_ms = _ms("backoff", backoff)
        opts.max_backoff_ms = _ms("max_backoff", max_backoff)
        with self._conn.pinned() as c:
            _check(_n.lib().bb_client_set_reconnect(c, ctypes.byref(opts)))

    @property
    def resumes(self) -> int:
        """How many times this client resumed its session after a daemon
        restart (``bb_client_resumes``)."""
        with self._conn.pinned() as c:
            return int(_n.lib().bb_client_resumes(c))

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<bufbroker.Client socket={self.socket!r} {state}>"

    def __reduce__(self) -> NoReturn:
        raise TypeError("a bufbroker Client cannot be pickled; make one in each process")

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._conn.closed

    def close(self) -> None:
        """Disconnect: release every buffer held through this client and
        close every Buffer object made through it (``bb_disconnect``).

        Idempotent. Memory views and CUDA exports that are still alive keep
        their memory: the disconnect waits until the last of them is gone
        (the Client and its Buffers are closed for use at once)."""
        self._conn.close()

    def _buffer(self, fn: Any, *args: Any) -> "Buffer":
        out = ctypes.c_void_p()
        with self._conn.pinned() as c:
            _check(fn(c, *args, ctypes.byref(out)))
            assert out.value is not None
            return Buffer._new(self._conn, out.value)

    @staticmethod
    def _opts(size: int, kind: Kind, device: int, name: Optional[Text], share: Share) -> _n.bb_alloc_opts:
        opts = _n.bb_alloc_opts()
        opts.size = _uint("size", size, _SIZE_MAX)
        opts.kind = _choice("kind", kind, _KINDS)
        if isinstance(device, bool) or not isinstance(device, int):
            raise _invalid(f"device must be an int, not {type(device).__name__}")
        if not -(2**31) <= device <= _INT_MAX:
            raise _invalid(f"device {device} is out of range")
        opts.device = device
        opts.name = _text("name", name)
        opts.share = _choice("share", share, _SHARES)
        return opts

    def alloc(
        self,
        size: int,
        kind: Kind = "host",
        device: int = 0,
        name: Optional[Text] = None,
        share: Share = "uid",
        cuda_handle: CudaHandle = "default",
    ) -> "Buffer":
        """A new PENDING buffer of ``size`` bytes (``bb_alloc``, or
        ``bb_alloc_cuda`` with a ``cuda_handle``).

        Args:
            size: bytes, > 0.
            kind: ``"host"`` (shared memory) or ``"cuda"`` (device memory).
            device: the CUDA device ordinal as the daemon numbers devices.
            name: None, or a name unique among live buffers (at most 127 bytes).
            share: who may open it by id or name: ``"uid"``, ``"gid"`` or ``"any"``.
            cuda_handle: how a CUDA buffer is shared: ``"default"`` (the
                daemon's default), ``"auto"``, ``"legacy"`` (a CUDA IPC
                handle) or ``"vmm"`` (a file descriptor, across containers).
                Host buffers take ``"default"`` only.

        Returns the :class:`Buffer`, holding one reference. Raises
        :class:`Exists` for a taken name, :class:`Unsupported` for a kind the
        daemon cannot make (a handle kind never falls back to the other),
        :class:`NoMemory` over a limit.
        """
        opts = self._opts(size, kind, device, name, share)
        handle = _choice("cuda_handle", cuda_handle, _CUDA_HANDLES)
        if handle == _n.CUDA_HANDLE_DEFAULT:
            return self._buffer(_n.lib().bb_alloc, ctypes.byref(opts))
        return self._buffer(_n.lib().bb_alloc_cuda, ctypes.byref(opts), handle)

    def open(self, id: int) -> "Buffer":
        """One more reference to buffer ``id`` (``bb_open``): a Buffer.

        Raises :class:`NotFound` or :class:`Denied`."""
        return self._buffer(_n.lib().bb_open, _uint("id", id, _UINT64_MAX))

    def open_name(self, name: Text) -> "Buffer":
        """One more reference to the buffer called ``name`` (``bb_open_name``).

        Raises :class:`NotFound` or :class:`Denied`."""
        if name is None:
            raise _invalid("name is required")
        return self._buffer(_n.lib().bb_open_name, _text("name", name))

    def import_fd(
        self,
        fd: Union[int, HasFileno],
        size: int,
        name: Optional[Text] = None,
        share: Share = "uid",
    ) -> "Buffer":
        """Hand memory you own to the broker (``bb_import_fd``).

        ``fd`` (an int, or an object with ``fileno()``) is a memfd made with
        ``MFD_ALLOW_SEALING``, opened read-write, at least ``size`` bytes
        and at most one page more (the buffer charges its owner ``size``),
        with no write seal. The daemon keeps its own duplicate and seals the
        file against growing and shrinking; you may close yours. Returns the
        new PENDING host :class:`Buffer`. An fd the daemon cannot seal, or a
        file of another size, is refused with :class:`InvalidArgument`."""
        if hasattr(fd, "fileno"):
            fd = fd.fileno()
        fd = _uint("fd", fd, _INT_MAX)
        opts = self._opts(size, "host", 0, name, share)
        return self._buffer(_n.lib().bb_import_fd, fd, ctypes.byref(opts))

    def adopt(self, token: Union[str, bytes, bytearray]) -> "Buffer":
        """Receive the reference a token holds (``bb_adopt``).

        ``token`` is the 32-hex-digit string :meth:`Buffer.take` returned
        (or its 16 raw bytes). A token works once; a second adopt, or an
        expired token, raises :class:`NotFound`."""
        tok = _n.bb_token()
        if isinstance(token, str):
            _check(_n.lib().bb_token_parse(token.encode("ascii", "replace"), ctypes.byref(tok)))
        elif isinstance(token, (bytes, bytearray)) and len(token) == _n.TOKEN_SIZE:
            ctypes.memmove(tok.bytes, bytes(token), _n.TOKEN_SIZE)
        else:
            raise _invalid(
                f"a token is a str of {2 * _n.TOKEN_SIZE} hex digits or {_n.TOKEN_SIZE} bytes"
            )
        return self._buffer(_n.lib().bb_adopt, ctypes.byref(tok))

    def stat(self, id: int) -> Info:
        """The buffer ``id`` fresh from the daemon (``bb_stat``): an :class:`Info`.

        Raises :class:`NotFound` once every holder has let it go."""
        raw = _n.bb_info()
        with self._conn.pinned() as c:
            _check(_n.lib().bb_stat(c, _uint("id", id, _UINT64_MAX), ctypes.byref(raw)))
        return _info_from(raw)

    def retain(self, id: int, count: int = 1) -> None:
        """Add ``count`` raw daemon references to ``id`` for this connection
        (``bb_retain``), for callers that manage references themselves."""
        with self._conn.pinned() as c:
            _check(
                _n.lib().bb_retain(
                    c, _uint("id", id, _UINT64_MAX), _uint("count", count, _UINT32_MAX)
                )
            )

    def release(self, id: int, count: int = 1) -> None:
        """Give back ``count`` raw daemon references to ``id`` (``bb_release``)."""
        with self._conn.pinned() as c:
            _check(
                _n.lib().bb_release(
                    c, _uint("id", id, _UINT64_MAX), _uint("count", count, _UINT32_MAX)
                )
            )


# ---- buffers -------------------------------------------------------------------


class Buffer:
    """A process-local handle to one buffer the daemon owns (``bb_buf``).

    Made by :class:`Client` (``alloc``, ``open``, ``adopt``...), never
    directly. It holds one reference: :meth:`close` (or leaving a ``with``
    block, or garbage collection) gives it back, and the daemon frees the
    buffer when its last holder lets go.

    Host memory: :meth:`view` returns a writable ``memoryview`` of the
    shared mapping with no copy; ``numpy.frombuffer(buf.view(), dtype)``
    wraps it as an array. (CPython before 3.12 has no way for a Python class
    to export the buffer protocol itself, so the view is a method; on 3.12+
    ``memoryview(buf)`` works too.) A view keeps its memory mapped after the
    Buffer is closed; the reference is released when the last view goes.

    CUDA memory: ``__cuda_array_interface__`` (version 3) lets CuPy, Numba
    and ``torch.as_tensor`` wrap the device memory; once it has been asked
    for, the Buffer object keeps the mapping until it is garbage collected,
    since those libraries keep the object, not a reference count.
    """

    _conn: Optional[_Connection]  # None once detached by Client.close()
    _handle: Optional[int]  # our bb_buf * (one local count); None when closed
    _lock: threading.Lock  # guards _handle and _exported
    _id: int
    _size: int
    _kind: int
    _exported: bool  # __cuda_array_interface__ was handed out
    _dl_device: Optional[Tuple[int, int]]  # __dlpack_device__, once known
    _finalizer: weakref.finalize

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("Buffers are made by a bufbroker.Client (alloc, open, adopt, ...)")

    @classmethod
    def _new(cls, conn: _Connection, handle: int) -> "Buffer":
        self = object.__new__(cls)
        lib = _n.lib()
        self._conn = conn  # None once detached by Client.close()
        self._handle = handle  # our bb_buf * (one local count); None when closed
        self._lock = threading.Lock()  # guards _handle and _exported
        self._id = lib.bb_id(handle)
        self._size = lib.bb_size(handle)
        self._kind = lib.bb_buf_kind(handle)
        self._exported = False  # __cuda_array_interface__ was handed out
        self._dl_device = None  # __dlpack_device__, once known
        self._finalizer = weakref.finalize(self, _release_handle, conn, handle)
        self._finalizer.atexit = False
        with conn.lock:  # Client.close() lists them under the same lock
            conn.buffers.add(self)
        return self

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<bufbroker.Buffer id={self._id} size={self._size} kind={self.kind} {state}>"

    def __reduce__(self) -> NoReturn:
        raise TypeError(
            "a bufbroker Buffer cannot be pickled; pass buf.take() (a token) "
            "and Client.adopt() it in the other process"
        )

    # -- identity

    @property
    def id(self) -> int:
        """The buffer's id (daemon-wide)."""
        return self._id

    @property
    def size(self) -> int:
        """The buffer's size in bytes."""
        return self._size

    @property
    def kind(self) -> str:
        """``"host"`` or ``"cuda"``."""
        return _KIND_NAMES.get(self._kind, str(self._kind))

    @property
    def closed(self) -> bool:
        """True once closed, taken, or closed with its Client."""
        return self._handle is None

    # -- references

    @contextlib.contextmanager
    def _use(self) -> Iterator[Tuple[int, _Connection]]:
        """(handle, connection), with a temporary count of the handle and
        the connection pinned until the block ends."""
        with self._lock:
            h = self._handle
            if h is None:
                raise ValueError("the bufbroker Buffer is closed")
            conn = self._conn
            assert conn is not None  # detached Buffers have no handle
            conn.pin()
            _n.lib().bb_ref(h)
        try:
            yield h, conn
        finally:
            _n.lib().bb_unref(h)
            conn.unpin()

    def _detach(self) -> None:
        """Closed by Client.close(): the disconnect releases our count."""
        with self._lock:
            self._handle = None
            self._finalizer.detach()
            self._conn = None

    def close(self) -> None:
        """Give this object's reference back (``bb_unref``). Idempotent.

        Views of the memory stay valid: the release waits for them."""
        with self._lock:
            h, self._handle = self._handle, None
        if h is not None:
            self._finalizer()

    def ref(self) -> "Buffer":
        """A new Buffer object with one more local count of the same handle
        (``bb_ref``: no round trip). Close each independently."""
        with self._use() as (h, conn):
            return Buffer._new(conn, _n.lib().bb_ref(h))

    def take(self) -> str:
        """Surrender this object's reference into a token (``bb_take``).

        Returns the token as 32 lowercase hex digits, which any process may
        pass to :meth:`Client.adopt` once. This object is closed by it (its
        count went into the token); take a ``ref()`` first to keep using the
        buffer. Unadopted tokens expire (the daemon's token TTL)."""
        tok = _n.bb_token()
        with self._lock:
            h = self._handle
            if h is None:
                raise ValueError("the bufbroker Buffer is closed")
            conn = self._conn
            assert conn is not None
            conn.pin()
            try:
                _check(_n.lib().bb_take(h, ctypes.byref(tok)))
                self._handle = None
                self._finalizer.detach()
            finally:
                conn.unpin()
        text = ctypes.create_string_buffer(2 * _n.TOKEN_SIZE + 1)
        _n.lib().bb_token_format(ctypes.byref(tok), text)
        return text.value.decode("ascii")

    # -- state

    def set_ready(self) -> None:
        """PENDING -> READY; wakes waiters (``bb_set_ready``).

        Raises :class:`StateError` when the buffer is not pending."""
        with self._use() as (h, _):
            _check(_n.lib().bb_set_ready(h))

    def set_error(self, message: Optional[Text] = "") -> None:
        """PENDING -> FAILED with ``message`` (kept up to 255 bytes), which
        ``stat().error`` shows (``bb_set_error``). Raises :class:`StateError`
        when the buffer is not pending."""
        msg = _text("message", message if message is not None else "")
        with self._use() as (h, _):
            _check(_n.lib().bb_set_error(h, msg))

    def wait(self, timeout: Optional[float] = None) -> str:
        """Wait until the buffer is no longer pending (``bb_wait``).

        ``timeout`` is in seconds (None: forever; 0: just look). Returns the
        state, ``"ready"`` or ``"failed"`` (a failed buffer is not an error
        here; ``stat().error`` says why). Raises :class:`Timeout` when it is
        still pending when the timeout passes. Long waits are made in
        slices of a second, so Ctrl-C interrupts them."""
        deadline: Optional[float]
        if timeout is None:
            deadline = None
        else:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                raise _invalid(f"timeout must be a number of seconds or None, not {timeout!r}")
            if math.isnan(timeout) or timeout < 0:
                raise _invalid(f"timeout must be >= 0 seconds, not {timeout!r}")
            deadline = time.monotonic() + timeout
        state = ctypes.c_int()
        with self._use() as (h, _):
            lib = _n.lib()
            while True:
                if deadline is None:
                    ms = _WAIT_SLICE_MS
                else:
                    left = deadline - time.monotonic()
                    ms = min(_WAIT_SLICE_MS, max(0, math.ceil(left * 1000)))
                rc = lib.bb_wait(h, ms, ctypes.byref(state))
                if rc == ERR_TIMEOUT and ms == _WAIT_SLICE_MS and (
                    deadline is None or deadline - time.monotonic() > 0
                ):
                    continue  # a slice passed, not the caller's timeout
                _check(rc)
                return _STATE_NAMES.get(state.value, str(state.value))

    def stat(self) -> Info:
        """This buffer fresh from the daemon: an :class:`Info`."""
        raw = _n.bb_info()
        with self._use() as (_, conn):
            _check(_n.lib().bb_stat(conn.ptr, self._id, ctypes.byref(raw)))
        return _info_from(raw)

    # -- memory

    def _export(self) -> Tuple[int, _Connection, int]:
        """(address, connection, handle) for a new export of the memory:
        the mapping's address, with one more local count of the handle and
        a pin of the connection, both given back by exactly one
        ``_export_gone(connection, handle)``."""
        with self._use() as (h, conn):
            addr = self._map(h)
            conn.pin()
            _n.lib().bb_ref(h)  # the export's own count
        return addr, conn, h

    def _map(self, h: int) -> int:
        p = ctypes.c_void_p()
        _check(_n.lib().bb_map(h, ctypes.byref(p)))
        if not p.value:
            raise BufbrokerError(0, f"bb_map gave a NULL pointer for buffer {self._id}")
        return int(p.value)

    def view(self) -> memoryview:
        """A writable ``memoryview`` (format ``"B"``, one byte per item) of
        a host buffer's shared memory: no copy. Writes are seen by every
        process that maps the buffer.

        The view keeps the memory mapped, and the buffer referenced, until
        the view (and everything made from it, e.g. a numpy array) is gone,
        even if this Buffer is closed first. Raises TypeError for a CUDA
        buffer (use ``__cuda_array_interface__``)."""
        if self._kind != _n.KIND_HOST:
            raise TypeError(
                f"buffer {self._id} is a {self.kind} buffer: it has no host memory; "
                "use __cuda_array_interface__"
            )
        addr, conn, h = self._export()
        try:
            arr = (ctypes.c_ubyte * self._size).from_address(addr)
            fin = weakref.finalize(arr, _export_gone, conn, h)
            fin.atexit = False
        except BaseException:
            _export_gone(conn, h)
            raise
        # ctypes exports format "<B", which memoryview cannot index; a cast
        # to "B" shares the same export (and so keeps arr alive).
        return memoryview(arr).cast("B")

    if sys.version_info >= (3, 12):

        def __buffer__(self, flags: int) -> memoryview:
            """PEP 688 (Python 3.12+): ``memoryview(buf)`` is ``buf.view()``."""
            return self.view()

    def _device_pointer(self) -> int:
        if self._kind != _n.KIND_CUDA:
            raise AttributeError(f"buffer {self._id} is a host buffer: use view()")
        with self._use() as (h, conn):
            ptr = self._map(h)
            with self._lock:
                if not self._exported:
                    # The libraries that read the interface keep this
                    # object, not a count: keep the mapping until it goes.
                    conn.pin()
                    _n.lib().bb_ref(h)
                    fin = weakref.finalize(self, _export_gone, conn, h)
                    fin.atexit = False
                    self._exported = True
        return ptr

    @property
    def cuda_handle(self) -> Optional[str]:
        """How a CUDA buffer is shared: ``"legacy"`` (a CUDA IPC handle,
        :meth:`cuda_ipc`) or ``"vmm"`` (a file descriptor,
        :meth:`cuda_vmm`); None for a host buffer."""
        with self._use() as (h, _):
            kind = int(_n.lib().bb_cuda_handle_of(h))
        return {_n.CUDA_HANDLE_LEGACY: "legacy", _n.CUDA_HANDLE_VMM: "vmm"}.get(kind)

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        """The CUDA Array Interface, version 3, of a CUDA buffer: a 1-D
        array of ``size`` unsigned bytes at the device pointer ``bb_map``
        gives (valid in this process's primary context of the buffer's
        device), the same for either :attr:`cuda_handle`. Host buffers have
        no such attribute."""
        ptr = self._device_pointer()
        return {
            "shape": (self._size,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }

    # -- tensors: numpy, DLPack

    def as_tensor(
        self, dtype: DTypeLike = "uint8", shape: Union[None, int, Sequence[int]] = None, *, offset: int = 0
    ) -> "Tensor":
        """A typed view of the memory: ``shape`` elements of ``dtype``,
        C-contiguous, from byte ``offset``. No copy.

        ``dtype`` is a name (``"float32"``, ``"bfloat16"``...), an array
        interface typestr (``"<f4"``), or a numpy, torch or Python type or
        dtype. ``shape`` None is one dimension over the rest of the buffer.
        The :class:`Tensor` hands the memory to numpy (``np.asarray``,
        ``np.from_dlpack``), torch (``torch.from_dlpack``), CuPy
        (``cupy.from_dlpack``) and any DLPack consumer, and keeps it mapped
        while it, or anything made from it, lives. Raises
        :class:`InvalidArgument` for a dtype, shape or offset that does not
        fit the buffer."""
        return Tensor._new(self, dtype, shape, offset)

    def __dlpack_device__(self) -> Tuple[int, int]:
        """DLPack's ``(device_type, device_id)``: ``(1, 0)`` (kDLCPU) for
        host memory, ``(2, ordinal)`` (kDLCUDA) for CUDA memory, with the
        ordinal this process gives the buffer's device (it may differ from
        the daemon's ``Info.device`` when CUDA_VISIBLE_DEVICES differs)."""
        if self._kind == _n.KIND_HOST:
            return (_dlpack.kDLCPU, 0)
        if self._dl_device is None:
            if self.cuda_handle == "vmm":
                vmm = self.cuda_vmm()
                os.close(vmm.fd)
                uuid = vmm.device_uuid
            else:
                uuid = self.cuda_ipc().device_uuid
            try:
                ordinal = _n.cuda_ordinal(uuid)
            except (OSError, LookupError) as e:
                raise SystemFailure(ERR_SYSTEM, f"buffer {self._id}: its CUDA device: {e}") from e
            self._dl_device = (_dlpack.kDLCUDA, ordinal)
        return self._dl_device

    def __dlpack__(
        self,
        stream: Optional[int] = None,
        *,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any:
        """The whole buffer as a DLPack tensor of ``size`` bytes (uint8):
        ``np.from_dlpack(buf)``. Use :meth:`as_tensor` for another dtype or
        shape; see :meth:`Tensor.__dlpack__`."""
        return self.as_tensor().__dlpack__(
            stream, max_version=max_version, dl_device=dl_device, copy=copy
        )

    @property
    def __array_interface__(self) -> Dict[str, Any]:
        """numpy's array interface (version 3) of a host buffer: ``size``
        bytes (``"|u1"``) over a fresh :meth:`view`, so ``np.asarray(buf)``
        is a writable uint8 array on the shared memory that keeps it mapped
        while it lives. CUDA buffers have no such attribute."""
        if self._kind != _n.KIND_HOST:
            raise AttributeError(f"buffer {self._id} is a {self.kind} buffer: it has no host memory")
        return {"shape": (self._size,), "typestr": "|u1", "data": self.view(), "version": 3}

    def __array__(self, dtype: Any = None, copy: Optional[bool] = None) -> Any:
        """``numpy.asarray`` of a host buffer (what ``__array_interface__``
        gives); for a CUDA buffer a TypeError that says what to use."""
        if self._kind != _n.KIND_HOST:
            raise TypeError(_no_numpy(f"buffer {self._id}"))
        return _to_numpy(self, dtype, copy)

    def cuda_ipc(self) -> CudaIpc:
        """The CUDA IPC description of a CUDA buffer (``bb_cuda_ipc_of``):
        a :data:`CudaIpc` ``(handle, offset, size, device_uuid)``, where
        ``handle`` is the 64-byte cudaIpcMemHandle_t of the allocation
        holding the buffer and ``offset`` the buffer's start inside it."""
        raw = _n.bb_cuda_ipc()
        with self._use() as (h, _):
            _check(_n.lib().bb_cuda_ipc_of(h, ctypes.byref(raw)))
        return CudaIpc(bytes(raw.handle), raw.offset, raw.size, bytes(raw.device_uuid))

    def cuda_vmm(self) -> "CudaVmm":
        """The VMM description of a VMM CUDA buffer (``bb_cuda_vmm_of``), for
        a framework that imports the allocation itself: a :data:`CudaVmm`
        ``(fd, allocation, allocation_size, offset, size, device_uuid)``.
        ``fd`` is a new file descriptor that the caller closes
        (``os.close``); importing it, mapping ``allocation_size`` bytes and
        adding ``offset`` gives the buffer. Raises :class:`Unsupported` for a
        legacy buffer (use :meth:`cuda_ipc`)."""
        raw = _n.bb_cuda_vmm()
        with self._use() as (h, _):
            _check(_n.lib().bb_cuda_vmm_of(h, ctypes.byref(raw)))
        return CudaVmm(
            raw.fd, raw.allocation, raw.allocation_size, raw.offset, raw.size, bytes(raw.device_uuid)
        )

# ---- tensors ---------------------------------------------------------------------


def _no_numpy(what: str) -> str:
    return (
        f"{what} is CUDA memory, which numpy cannot hold: use a CUDA library, "
        "e.g. cupy.from_dlpack(buf.as_tensor(dtype, shape)) or torch.from_dlpack(...)"
    )


def _to_numpy(obj: object, dtype: Any, copy: Optional[bool]) -> Any:
    np: Any = importlib.import_module("numpy")
    a = np.asarray(obj)  # through __array_interface__: no copy
    if dtype is not None:
        a = a.astype(dtype, copy=False)
    return a.copy() if copy else a


class Tensor:
    """A typed view of a buffer's memory (``Buffer.as_tensor``): ``shape``
    elements of ``dtype``, C-contiguous, from byte ``offset``. No copy.

    It exports the memory as DLPack (``__dlpack__``, ``__dlpack_device__``),
    and as numpy's ``__array_interface__`` (host) or the CUDA array
    interface (CUDA). It holds a local count of the buffer of its own, so
    the memory stays mapped while the Tensor lives, even if its Buffer is
    closed; numpy keeps the Tensor as its arrays' base, and every DLPack
    tensor holds a count of its own until its consumer calls its deleter.
    """

    dtype: str  #: the element type's name, e.g. ``"float32"``
    shape: Tuple[int, ...]  #: elements per dimension
    offset: int  #: bytes from the buffer's start
    nbytes: int  #: bytes the tensor covers
    itemsize: int  #: bytes per element
    kind: str  #: ``"host"`` or ``"cuda"``
    buffer_id: int  #: the buffer's id
    _dtype: _dlpack.DType
    _ptr: int  # the first element's address in this process
    _device: Tuple[int, int]  # __dlpack_device__
    _conn: _Connection
    _handle: int  # our bb_buf *, one local count the finalizer gives back
    _finalizer: weakref.finalize

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("Tensors are made by Buffer.as_tensor(dtype, shape)")

    @classmethod
    def _new(
        cls, buf: Buffer, dtype: DTypeLike, shape: Union[None, int, Sequence[int]], offset: int
    ) -> "Tensor":
        try:
            dt = _dlpack.dtype_of(dtype)
        except ValueError as e:
            raise _invalid(str(e)) from None
        offset = _uint("offset", offset, buf.size)
        if offset % dt.itemsize:
            raise _invalid(f"offset {offset} is not a multiple of {dt.name}'s {dt.itemsize} bytes")
        if shape is None:
            n, rest = divmod(buf.size - offset, dt.itemsize)
            if rest:
                raise _invalid(
                    f"{buf.size - offset} bytes from offset {offset} are not a whole number of "
                    f"{dt.name} elements: give the shape"
                )
            dims: Tuple[int, ...] = (n,)
        else:
            seq = (shape,) if hasattr(shape, "__index__") else tuple(shape)
            dims = tuple(_uint("a dimension", d, 2**63 - 1) for d in seq)
        nbytes = math.prod(dims) * dt.itemsize
        if offset + nbytes > buf.size:
            raise _invalid(
                f"{'x'.join(map(str, dims)) or 'a scalar'} of {dt.name} from offset {offset} is "
                f"{nbytes} bytes: more than the {buf.size - offset} the buffer has there"
            )
        device = buf.__dlpack_device__()
        addr, conn, h = buf._export()
        self = object.__new__(cls)
        self._finalizer = weakref.finalize(self, _export_gone, conn, h)
        self._finalizer.atexit = False
        self._conn, self._handle = conn, h
        self._dtype, self._ptr, self._device = dt, addr + offset, device
        self.dtype, self.shape, self.offset = dt.name, dims, offset
        self.nbytes, self.itemsize = nbytes, dt.itemsize
        self.kind, self.buffer_id = buf.kind, buf.id
        return self

    def __repr__(self) -> str:
        shape = "x".join(map(str, self.shape)) or "()"
        return f"<bufbroker.Tensor {self.dtype}[{shape}] of buffer {self.buffer_id} at offset {self.offset}>"

    def __reduce__(self) -> NoReturn:
        raise TypeError("a bufbroker Tensor cannot be pickled; pass its buffer's token")

    @property
    def data_ptr(self) -> int:
        """The first element's address in this process (a device pointer
        for CUDA memory)."""
        return self._ptr

    @property
    def strides(self) -> Tuple[int, ...]:
        """Bytes between elements along each dimension (C order)."""
        out = [self.itemsize] * len(self.shape)
        for i in range(len(self.shape) - 2, -1, -1):
            out[i] = out[i + 1] * self.shape[i + 1]
        return tuple(out)

    def __dlpack_device__(self) -> Tuple[int, int]:
        """``(1, 0)`` (kDLCPU) for host memory, ``(2, ordinal)`` (kDLCUDA)
        with this process's ordinal of the device for CUDA memory."""
        return self._device

    def __dlpack__(
        self,
        stream: Optional[int] = None,
        *,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any:
        """A DLPack capsule of this tensor (the DLPack Python specification):
        versioned (DLPack 1.0, ``"dltensor_versioned"``) when ``max_version``
        is (1, 0) or later, else the legacy ``"dltensor"``. Writable; data
        is the first element's address, strides are given, byte_offset 0.

        ``stream`` is accepted and needs no synchronization: the buffer is
        ready once the producer set it ready, and nothing here queues work.
        ``dl_device`` other than this tensor's, and ``copy=True``, raise
        BufferError (this export never copies). The tensor holds a count of
        the buffer until its consumer is done with it."""
        if stream is not None and (isinstance(stream, bool) or not isinstance(stream, int)):
            raise TypeError(f"stream must be an int or None, not {stream!r}")
        if dl_device is not None and tuple(dl_device) != self._device:
            raise BufferError(f"the tensor is on device {self._device}, not {tuple(dl_device)}: no copy is made")
        if copy:
            raise BufferError("bufbroker exports the shared memory itself: copy=True is not supported")
        versioned = max_version is not None and tuple(max_version)[0] >= _dlpack.VERSION[0]
        conn, h = self._conn, self._handle
        conn.pin()  # the capsule's own count, for as long as its consumer holds it
        _n.lib().bb_ref(h)
        return _dlpack.capsule(
            self._ptr,
            self._device,
            self._dtype,
            self.shape,
            versioned,
            functools.partial(_export_gone, conn, h),
        )

    def _interface(self) -> Dict[str, Any]:
        if self._dtype.typestr is None:
            raise TypeError(f"{self.dtype} has no array interface type: use DLPack")
        return {
            "shape": self.shape,
            "typestr": self._dtype.typestr,
            "data": (self._ptr, False),
            "strides": None,
            "version": 3,
        }

    @property
    def __array_interface__(self) -> Dict[str, Any]:
        """numpy's array interface (version 3) of a host tensor: numpy keeps
        the Tensor (and so the mapping) as its array's base. CUDA tensors
        have no such attribute."""
        if self.kind != "host":
            raise AttributeError("a CUDA tensor has no host memory: use __cuda_array_interface__")
        return self._interface()

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        """The CUDA Array Interface (version 3) of a CUDA tensor. Host
        tensors have no such attribute."""
        if self.kind != "cuda":
            raise AttributeError("a host tensor has no device memory: use __array_interface__")
        return self._interface()

    def __array__(self, dtype: Any = None, copy: Optional[bool] = None) -> Any:
        """``numpy.asarray`` of a host tensor; a TypeError for a CUDA one."""
        if self.kind != "host":
            raise TypeError(_no_numpy(repr(self)))
        return _to_numpy(self, dtype, copy)
