# SPDX-License-Identifier: Apache-2.0
"""Errors: classes by BB_ERR code, code and message carried, the daemon gone,
library loading, forked children."""

import ctypes
import gc
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import bufbroker
from bufbroker import _native, errors
from conftest import child_env

CODES = {
    bufbroker.ERR_INVALID: bufbroker.InvalidArgument,
    bufbroker.ERR_NOT_FOUND: bufbroker.NotFound,
    bufbroker.ERR_DENIED: bufbroker.Denied,
    bufbroker.ERR_NO_MEMORY: bufbroker.NoMemory,
    bufbroker.ERR_TIMEOUT: bufbroker.Timeout,
    bufbroker.ERR_DISCONNECTED: bufbroker.Disconnected,
    bufbroker.ERR_PROTOCOL: bufbroker.ProtocolError,
    bufbroker.ERR_FAILED: bufbroker.BufferFailed,
    bufbroker.ERR_UNSUPPORTED: bufbroker.Unsupported,
    bufbroker.ERR_STATE: bufbroker.StateError,
    bufbroker.ERR_EXISTS: bufbroker.Exists,
    bufbroker.ERR_SYSTEM: bufbroker.SystemFailure,
}


def test_every_code_has_its_exception_class():
    assert sorted(CODES) == list(range(-12, 0))
    for code, cls in CODES.items():
        assert bufbroker.error_class(code) is cls
        assert issubclass(cls, bufbroker.BufbrokerError)
        e = cls(code, "")
        assert e.code == code
        assert e.message == bufbroker.strerror(code), "an empty message falls back to bb_strerror"
    assert bufbroker.error_class(-99) is bufbroker.BufbrokerError


def c_status_table():
    """[(code, name, sentence)] for every code libbufbroker knows, from its
    own table (common/status.c) through bb_err_name and bb_strerror."""
    so = ctypes.CDLL(_native.lib()._name)  # its own prototypes, not the package's
    so.bb_err_name.restype = ctypes.c_char_p
    so.bb_err_name.argtypes = [ctypes.c_int]
    rows = []
    for code in range(0, -256, -1):
        name = so.bb_err_name(code).decode()
        if name != "UNKNOWN":
            rows.append((code, name, bufbroker.strerror(code)))
    return rows


def test_errors_py_has_every_code_of_the_c_table_and_no_other():
    rows = c_status_table()
    assert rows[0][:2] == (0, "OK") and len(rows) > 1
    constants = {k: v for k, v in vars(errors).items() if k == "OK" or k.startswith("ERR_")}
    for code, name, sentence in rows:
        const = "OK" if code == 0 else "ERR_" + name
        assert constants.get(const) == code, f"errors.py needs {const} = {code}"
        assert getattr(bufbroker, const) == code and const in bufbroker.__all__, f"bufbroker.{const}"
        assert errors._STRERROR.get(code) == sentence, f"errors.py's sentence for {const}"
        if code:
            cls = errors.error_class(code)
            assert cls.default_code == code, f"no exception class for {const}"
            assert cls.__doc__.startswith(f"BB_ERR_{name}:"), f"{cls.__name__}'s docstring"
    c_codes = {code for code, _, _ in rows}
    assert set(constants.values()) == c_codes, "errors.py has codes the library does not"
    assert set(errors._STRERROR) == c_codes


BUILTINS = {
    bufbroker.InvalidArgument: ValueError,
    bufbroker.NotFound: LookupError,
    bufbroker.Denied: PermissionError,
    bufbroker.NoMemory: MemoryError,
    bufbroker.Timeout: TimeoutError,
    bufbroker.Disconnected: ConnectionError,
}


def test_exceptions_are_also_the_builtins_that_fit():
    for cls, builtin in BUILTINS.items():
        assert issubclass(cls, builtin), f"{cls.__name__} is not a {builtin.__name__}"
        e = cls(cls.default_code, "why")
        assert isinstance(e, builtin) and isinstance(e, bufbroker.BufbrokerError)
        assert (e.code, e.message, str(e), e.args) == (cls.default_code, "why", "why", ("why",))
        again = pickle.loads(pickle.dumps(e))
        assert type(again) is cls and (again.code, again.message) == (e.code, e.message)
        with pytest.raises(builtin):
            raise e


def test_a_missing_daemon_is_a_connection_error(tmp_path):
    with pytest.raises(ConnectionError) as ei:
        bufbroker.Client(str(tmp_path / "nothing.sock"))
    assert type(ei.value) is bufbroker.Disconnected and ei.value.code == bufbroker.ERR_DISCONNECTED


def test_a_pending_buffer_wait_is_a_timeout_error(client):
    with client.alloc(64) as buf, pytest.raises(TimeoutError) as ei:
        buf.wait(0)
    assert type(ei.value) is bufbroker.Timeout


def test_a_refused_socket_is_a_permission_error(daemon, tmp_path):
    # A process the socket's permissions refuse: as root, a child as
    # nobody (the daemon's directory is 0700 and root's), given its own
    # copy of the package and library, which the checkout may hide from
    # it; otherwise a child of this user, with the socket file's
    # permissions taken away.
    code = (
        "import sys, bufbroker\n"
        "try:\n"
        "    bufbroker.Client(sys.argv[1])\n"
        "except PermissionError as e:\n"
        "    assert type(e) is bufbroker.Denied and e.code == bufbroker.ERR_DENIED, repr(e)\n"
        "    print('denied')\n"
    )
    env = child_env()
    if os.getuid() == 0:
        assert os.stat(daemon.dir).st_mode & 0o777 == 0o700
        shared = tempfile.mkdtemp(prefix="bbpy-nobody-", dir="/tmp")
        try:
            os.chmod(shared, 0o755)
            shutil.copytree(Path(bufbroker.__file__).parent, os.path.join(shared, "bufbroker"))
            shutil.copy(_native.lib()._name, os.path.join(shared, "libbufbroker.so.0"))
            for root, dirs, files in os.walk(shared):
                for name in dirs + files:
                    os.chmod(os.path.join(root, name), 0o755)
            env.update(PYTHONPATH=shared, BUFBROKER_LIBRARY=os.path.join(shared, "libbufbroker.so.0"))
            out = subprocess.run(
                [sys.executable, "-c", code, daemon.socket],
                env=env,
                cwd="/",
                preexec_fn=lambda: os.setuid(65534),
                capture_output=True,
                text=True,
                timeout=60,
            )
        finally:
            shutil.rmtree(shared, ignore_errors=True)
    else:
        os.chmod(daemon.socket, 0)
        out = subprocess.run(
            [sys.executable, "-c", code, daemon.socket], env=env, capture_output=True, text=True, timeout=60
        )
    assert out.returncode == 0 and out.stdout.strip() == "denied", out.stdout + out.stderr


def test_a_refused_alloc_over_a_limit_is_a_memory_error(start_daemon):
    d = start_daemon(args=["--uid-host-bytes", "65536"])
    with bufbroker.Client(d.socket) as c, pytest.raises(MemoryError) as ei:
        c.alloc(1 << 20)
    assert type(ei.value) is bufbroker.NoMemory and ei.value.code == bufbroker.ERR_NO_MEMORY
    assert ei.value.message


def test_exceptions_survive_pickling():
    e = pickle.loads(pickle.dumps(bufbroker.NotFound(bufbroker.ERR_NOT_FOUND, "no buffer with id 7")))
    assert type(e) is bufbroker.NotFound
    assert (e.code, e.message, str(e)) == (bufbroker.ERR_NOT_FOUND, "no buffer with id 7", "no buffer with id 7")


def test_daemon_errors_carry_code_and_message(client):
    with pytest.raises(bufbroker.NotFound) as ei:
        client.open(987654321)
    e = ei.value
    assert e.code == bufbroker.ERR_NOT_FOUND
    assert "987654321" in e.message, "the daemon's own sentence"
    assert str(e) == e.message
    assert isinstance(e, LookupError)


def test_library_errors_carry_code_and_message(client):
    with pytest.raises(bufbroker.InvalidArgument) as ei:
        client.alloc(0)
    assert ei.value.code == bufbroker.ERR_INVALID
    assert ei.value.message
    assert isinstance(ei.value, ValueError)


def test_python_side_argument_checks_raise_invalid_argument(client):
    for call in (
        lambda: client.alloc(-1),
        lambda: client.alloc(64, kind="gpu"),
        lambda: client.alloc(64, share="everyone"),
        lambda: client.alloc(64, name=5),
        lambda: client.open(-3),
        lambda: client.retain(1, 2**32),
    ):
        with pytest.raises(bufbroker.InvalidArgument) as ei:
            call()
        assert ei.value.code == bufbroker.ERR_INVALID and ei.value.message


def test_connecting_to_a_missing_socket_fails_with_a_code(tmp_path):
    with pytest.raises(bufbroker.BufbrokerError) as ei:
        bufbroker.Client(str(tmp_path / "nothing.sock"))
    assert ei.value.code in CODES
    assert ei.value.message


def test_calls_after_the_daemon_is_gone_raise_disconnected(start_daemon):
    d = start_daemon()
    c = bufbroker.Client(d.socket)
    buf = c.alloc(64)
    assert d.stop() == 0
    with pytest.raises(bufbroker.Disconnected) as ei:
        c.stat(buf.id)
    assert ei.value.code == bufbroker.ERR_DISCONNECTED
    with pytest.raises(bufbroker.Disconnected):
        buf.wait(1)
    buf.close()
    c.close()


def test_a_missing_library_is_a_clear_oserror():
    code = (
        "import bufbroker\n"
        "try:\n"
        "    bufbroker.Client('/nonexistent.sock')\n"
        "except OSError as e:\n"
        "    assert 'BUFBROKER_LIBRARY' in str(e) and '/nonexistent/libbb.so' in str(e), e\n"
        "    print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(BUFBROKER_LIBRARY="/nonexistent/libbb.so"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_forked_child_cannot_use_or_release_its_parents_handles(client):
    buf = client.alloc(64)
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        status = 1
        try:
            try:
                client.stat(buf.id)
            except RuntimeError:
                status = 0
            try:
                buf.set_ready()
                status = 1
            except RuntimeError:
                pass
            buf.close()  # must not send the parent's release
            gc.collect()
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child could use its parent's client"
    info = client.stat(buf.id)
    assert info.refs == 1 and info.state == "pending"
    buf.close()
