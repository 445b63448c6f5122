# SPDX-License-Identifier: Apache-2.0
"""Fixtures: a real bufbrokerd on a temporary socket, and clients of it.

Where things are found (ctest sets the variables; see tests/integration/python.sh):
  $BUFBROKERD                   else $BB_BUILD_DIR/bufbrokerd
  $BB_PRODUCER, $BB_CONSUMER    else $BB_BUILD_DIR/bb-producer, bb-consumer
  $BUFBROKER_LIBRARY            else $BB_BUILD_DIR/libbufbroker.so.0 when it exists
  $BB_BUILD_DIR                 else <repository>/build
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD_DIR = Path(os.environ.get("BB_BUILD_DIR") or REPO / "build")
PYTHON_DIR = REPO / "python"
EXAMPLES_DIR = REPO / "examples" / "python"

# Make the package and the library findable before anything imports them.
if str(PYTHON_DIR) not in sys.path:
    sys.path.insert(0, str(PYTHON_DIR))
if not os.environ.get("BUFBROKER_LIBRARY") and (BUILD_DIR / "libbufbroker.so.0").exists():
    os.environ["BUFBROKER_LIBRARY"] = str(BUILD_DIR / "libbufbroker.so.0")

import bufbroker  # noqa: E402


def executable(env_var, name):
    """The program $env_var names, else BUILD_DIR/name; fails the test if
    it is not an executable file."""
    path = os.environ.get(env_var) or str(BUILD_DIR / name)
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(f"{name} not found: set ${env_var} or $BB_BUILD_DIR (tried {path})")
    return path


def slow():
    """How much slower than usual this run is: $BBT_SLOW, a whole factor, as
    tests/integration/harness.h reads it (1 when unset or not a number from
    1 to 1000). A test's own bounds on how long something may take are
    multiplied by it; a delay the daemon must honour never is."""
    try:
        factor = int(os.environ.get("BBT_SLOW", "1"))
    except ValueError:
        return 1
    return factor if 1 <= factor <= 1000 else 1


def parked_waits(daemon):
    """The waits parked in the daemon (ServerStatus.waits, all connections),
    asked through the CLI ($BUFBROKER_CLI, else BUILD_DIR/bufbroker)."""
    cli = executable("BUFBROKER_CLI", "bufbroker")
    out = subprocess.run(
        [cli, "--socket", daemon.socket, "--json", "status"],
        capture_output=True,
        text=True,
        timeout=10 * slow(),
    )
    if out.returncode != 0:
        pytest.fail(f"bufbroker status exited {out.returncode}: {out.stderr}")
    return json.loads(out.stdout)["waits"]


def wait_until_parked(daemon, want, timeout=5):
    """Return once the daemon has exactly want parked waits; fail the test
    when it has not after timeout seconds (times slow()). How a test knows
    that a wait in another thread is parked, rather than sleeping."""
    deadline = time.monotonic() + timeout * slow()
    while True:
        have = parked_waits(daemon)
        if have == want:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the daemon has {have} parked waits after {timeout * slow()} s, want {want}")
        time.sleep(0.005)


def run_child(target, *args):
    """Run target(*args, conn) in a child process (multiprocessing, spawn)
    and return the one thing it sends on conn; fails the test unless it
    sends within 60 s and exits 0. target lives in an importable module
    (bbchild)."""
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")
    # A pipe, not a Queue: a Queue's feeder thread dies with os._exit.
    mine, theirs = spawn.Pipe()
    p = spawn.Process(target=target, args=(*args, theirs))
    p.start()
    theirs.close()
    try:
        assert mine.poll(60), "the child sent nothing in 60 s"
        got = mine.recv()
    finally:
        p.join(60)
    assert p.exitcode == 0, f"the child exited {p.exitcode}"
    return got


def child_env(**extra):
    """The environment for child processes: this one, with the package on
    PYTHONPATH and the library named."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(PYTHON_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env.update(extra)
    return env


class Daemon:
    """A bufbrokerd on a socket in a fresh temporary directory."""

    def __init__(self, exe, extra_env=None, args=()):
        # Not pytest's tmp_path: a socket path must fit in 108 bytes.
        self.dir = tempfile.mkdtemp(prefix="bbpy-", dir="/tmp")
        self.socket = os.path.join(self.dir, "bb.sock")
        self.log_path = os.path.join(self.dir, "daemon.log")
        self.returncode = None
        env = dict(os.environ)
        env.pop("BUFBROKER_SOCKET", None)
        env.update(extra_env or {})
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [exe, "--socket", self.socket, "--token-ttl", "120000", "--log-level", "debug", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        # The socket file appears at bind(), a little before listen():
        # ready means a connect succeeds.
        deadline = time.monotonic() + 10
        while not self._accepts():
            if self.proc.poll() is not None:
                pytest.fail(f"bufbrokerd exited {self.proc.returncode} during start-up:\n{self.log()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"bufbrokerd made no socket in 10 s:\n{self.log()}")
            time.sleep(0.01)

    def _accepts(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.connect(self.socket)
            return True
        except OSError:
            return False
        finally:
            s.close()

    def log(self, lines=40):
        """The last lines of the daemon's log."""
        try:
            with open(self.log_path, "r", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self):
        """SIGTERM, and the exit status (None if it did not stop in 10 s)."""
        if self.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.returncode = self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.returncode

    def cleanup(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _start(extra_env=None, args=()):
    return Daemon(executable("BUFBROKERD", "bufbrokerd"), extra_env, args)


def _finish(d):
    try:
        rc = d.stop()
        assert rc == 0, f"bufbrokerd exited {rc} after SIGTERM, want 0:\n{d.log()}"
        log = d.log(lines=100000)
        for bad in ("Sanitizer", "runtime error:"):
            assert bad not in log, f"the daemon's log has a sanitizer report:\n{log}"
    finally:
        d.cleanup()


@pytest.fixture
def daemon():
    """A running bufbrokerd; after the test it must stop on SIGTERM with 0."""
    d = _start()
    yield d
    _finish(d)


@pytest.fixture
def start_daemon():
    """A factory for daemons with extra environment (e.g. a CUDA driver)
    and extra command-line arguments; each is stopped like the daemon
    fixture's."""
    started = []

    def start(extra_env=None, args=()):
        d = _start(extra_env, args)
        started.append(d)
        return d

    yield start
    for d in started:
        _finish(d)


@pytest.fixture
def client(daemon):
    """A Client of the daemon fixture's bufbrokerd."""
    with bufbroker.Client(daemon.socket) as c:
        yield c


@pytest.fixture
def other(daemon):
    """A second, independent connection to the same daemon."""
    with bufbroker.Client(daemon.socket) as c:
        yield c
