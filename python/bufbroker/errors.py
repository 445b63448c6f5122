# SPDX-License-Identifier: Apache-2.0
"""Error codes and the exceptions that carry them.

Every failing libbufbroker call raises a subclass of :class:`BufbrokerError`
chosen by its ``BB_ERR_*`` code; ``.code`` is that (negative) code and
``.message`` is ``bb_last_error()`` at the time of the failure, which holds
the daemon's own sentence when it gave one.
"""

from typing import Dict, Optional, Tuple, Type

# The codes, their sentences and classes mirror libbufbroker's table
# (common/status.c): python/tests/test_errors.py checks them against the
# library's bb_err_name and bb_strerror, so a code added there fails it
# until it is added here.
OK = 0
ERR_INVALID = -1
ERR_NOT_FOUND = -2
ERR_DENIED = -3
ERR_NO_MEMORY = -4
ERR_TIMEOUT = -5
ERR_DISCONNECTED = -6
ERR_PROTOCOL = -7
ERR_FAILED = -8
ERR_UNSUPPORTED = -9
ERR_STATE = -10
ERR_EXISTS = -11
ERR_SYSTEM = -12

# The sentences of bb_strerror, for when the library itself cannot be asked.
_STRERROR: Dict[int, str] = {
    OK: "success",
    ERR_INVALID: "invalid argument",
    ERR_NOT_FOUND: "no such buffer, name or token",
    ERR_DENIED: "permission denied",
    ERR_NO_MEMORY: "out of memory or over a limit",
    ERR_TIMEOUT: "timed out",
    ERR_DISCONNECTED: "disconnected from the daemon",
    ERR_PROTOCOL: "protocol error",
    ERR_FAILED: "the buffer is in the failed state",
    ERR_UNSUPPORTED: "not supported",
    ERR_STATE: "the buffer is in the wrong state",
    ERR_EXISTS: "the name is taken",
    ERR_SYSTEM: "a system call failed",
}


class BufbrokerError(Exception):
    """A libbufbroker call failed.

    Most subclasses are also the builtin exception a caller would catch for
    the same trouble (``InvalidArgument`` is a ``ValueError``, ``Timeout`` a
    ``TimeoutError``, ``Disconnected`` a ``ConnectionError``, ``Denied`` a
    ``PermissionError``, ``NoMemory`` a ``MemoryError``, ``NotFound`` a
    ``LookupError``).

    Attributes:
        code: the ``BB_ERR_*`` code (a negative int, see ``bufbroker.ERR_*``).
        message: what went wrong, as ``bb_last_error()`` said it.
    """

    #: The code this class stands for (None for the base class).
    default_code: Optional[int] = None

    def __init__(self, code: int, message: str = "") -> None:
        self.code = code
        self.message = message or _STRERROR.get(code, f"error {code}")
        # With an OSError base (TimeoutError, ConnectionError,
        # PermissionError) one argument leaves errno and strerror None.
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code}, message={self.message!r})"

    def __reduce__(self) -> Tuple[Type["BufbrokerError"], Tuple[int, str]]:
        # Rebuild from (code, message), e.g. across multiprocessing.
        return (type(self), (self.code, self.message))


class InvalidArgument(BufbrokerError, ValueError):
    """BB_ERR_INVALID: a bad argument (also a ValueError)."""

    default_code = ERR_INVALID


class NotFound(BufbrokerError, LookupError):
    """BB_ERR_NOT_FOUND: no such buffer, name or token (also a LookupError)."""

    default_code = ERR_NOT_FOUND


class Denied(BufbrokerError, PermissionError):
    """BB_ERR_DENIED: the share policy or the socket's permissions refuse it
    (also a PermissionError)."""

    default_code = ERR_DENIED


class NoMemory(BufbrokerError, MemoryError):
    """BB_ERR_NO_MEMORY: a quota, a limit or the device is full (also a
    MemoryError)."""

    default_code = ERR_NO_MEMORY


class Timeout(BufbrokerError, TimeoutError):
    """BB_ERR_TIMEOUT: the buffer was still pending when the timeout passed
    (also a TimeoutError)."""

    default_code = ERR_TIMEOUT


class Disconnected(BufbrokerError, ConnectionError):
    """BB_ERR_DISCONNECTED: the daemon is gone (or cannot be reached) (also
    a ConnectionError)."""

    default_code = ERR_DISCONNECTED


class ProtocolError(BufbrokerError):
    """BB_ERR_PROTOCOL: a malformed or unexpected message."""

    default_code = ERR_PROTOCOL


class BufferFailed(BufbrokerError):
    """BB_ERR_FAILED: the buffer is in the failed state."""

    default_code = ERR_FAILED


class Unsupported(BufbrokerError):
    """BB_ERR_UNSUPPORTED: e.g. a CUDA buffer where the daemon has no GPU."""

    default_code = ERR_UNSUPPORTED


class StateError(BufbrokerError):
    """BB_ERR_STATE: e.g. set_ready on a buffer that is not pending."""

    default_code = ERR_STATE


class Exists(BufbrokerError):
    """BB_ERR_EXISTS: the name is taken by a live buffer."""

    default_code = ERR_EXISTS


class SystemFailure(BufbrokerError):
    """BB_ERR_SYSTEM: an OS or driver call failed."""

    default_code = ERR_SYSTEM


_BY_CODE: Dict[Optional[int], Type[BufbrokerError]] = {
    cls.default_code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        Denied,
        NoMemory,
        Timeout,
        Disconnected,
        ProtocolError,
        BufferFailed,
        Unsupported,
        StateError,
        Exists,
        SystemFailure,
    )
}


def error_class(code: int) -> Type[BufbrokerError]:
    """The BufbrokerError subclass for a BB_ERR_* code (the base class for a
    code this version does not know)."""
    return _BY_CODE.get(code, BufbrokerError)


def error_for(code: int, message: str = "") -> BufbrokerError:
    """A new exception of the right class for code, carrying message."""
    return error_class(code)(code, message)
