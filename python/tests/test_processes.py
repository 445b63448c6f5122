# SPDX-License-Identifier: Apache-2.0
"""Between processes: Python to Python (multiprocessing, spawn), and the
example programs, Python and C, in every pairing."""

import subprocess
import sys
import time

import numpy as np
import pytest

import bbchild
import bufbroker
from conftest import EXAMPLES_DIR, child_env, executable, run_child

def test_python_producer_hands_a_buffer_to_a_python_process(daemon, client):
    buf = client.alloc(1 << 20)
    np.frombuffer(buf.view(), dtype=np.uint8)[:] = bbchild.pattern(buf.size, 11)
    token = buf.ref().take()
    buf.set_ready()
    state, ok, refs, id_ = run_child(bbchild.consume, daemon.socket, token, 11)
    assert (state, ok, id_) == ("ready", True, buf.id)
    assert refs == 2, "the producer's connection and the consumer's"
    assert client.stat(buf.id).refs == 1, "the consumer's reference went with it"
    buf.close()
    with pytest.raises(bufbroker.NotFound):
        client.stat(buf.id)


def test_python_process_fills_a_buffer_the_parent_waits_for(daemon, client):
    with client.alloc(1 << 16) as buf:
        token = buf.ref().take()
        assert buf.stat().state == "pending"
        got_id = run_child(bbchild.fill, daemon.socket, token, 3)
        assert got_id == buf.id
        assert buf.wait(10) == "ready"
        assert np.array_equal(np.frombuffer(buf.view(), dtype=np.uint8), bbchild.pattern(buf.size, 3))


def test_a_process_that_dies_holding_a_buffer_gives_it_back(daemon, client):
    with client.alloc(4096) as buf:
        token = buf.ref().take()
        assert run_child(bbchild.adopt_and_die, daemon.socket, token) == 2
        deadline = time.monotonic() + 5
        while client.stat(buf.id).refs != 1:
            assert time.monotonic() < deadline, "the dead child's reference was not released"
            time.sleep(0.02)


# ---- the example programs ---------------------------------------------------------


def run(argv, **kw):
    return subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=60, **kw)


def py_producer(sock, *args):
    return [sys.executable, str(EXAMPLES_DIR / "producer.py"), "--socket", sock, *args]


def py_consumer(sock, *args):
    return [sys.executable, str(EXAMPLES_DIR / "consumer.py"), "--socket", sock, *args]


def c_producer(sock, *args):
    return [executable("BB_PRODUCER", "bb-producer"), "--socket", sock, *args]


def c_consumer(sock, *args):
    return [executable("BB_CONSUMER", "bb-consumer"), "--socket", sock, *args]


PAIRS = {
    "python-to-python": (py_producer, py_consumer),
    "c-to-python": (c_producer, py_consumer),
    "python-to-c": (py_producer, c_consumer),
}


@pytest.mark.parametrize("pair", list(PAIRS))
def test_examples_pass_a_buffer_by_token(pair, daemon, client):
    producer, consumer = PAIRS[pair]
    p = run(producer(daemon.socket, "--name", "bbpy-ex", "--size", "65536", "--pattern", "7"))
    assert p.returncode == 0, p.stderr
    token = p.stdout.strip()
    assert len(token) == 32 and int(token, 16) >= 0, p.stdout
    with client.open_name("bbpy-ex") as seen:
        info = seen.stat()
    assert (info.state, info.size, info.refs) == ("ready", 65536, 2), "the token's and ours"
    q = run(consumer(daemon.socket, "--size", "65536", "--pattern", "7", token))
    assert q.returncode == 0, q.stderr
    assert "verified 65536 bytes" in q.stdout and "bbpy-ex" in q.stdout
    with pytest.raises(bufbroker.NotFound):
        client.open_name("bbpy-ex")


@pytest.mark.parametrize("pair", list(PAIRS))
def test_examples_open_by_name(pair, daemon):
    producer, consumer = PAIRS[pair]
    p = run(producer(daemon.socket, "--name", "bbpy-byname", "--size", "8192", "--pattern", "9"))
    assert p.returncode == 0, p.stderr
    q = run(consumer(daemon.socket, "--size", "8192", "--pattern", "9", "--name", "bbpy-byname"))
    assert q.returncode == 0, q.stderr
    assert "verified 8192 bytes" in q.stdout


@pytest.mark.parametrize("pair", list(PAIRS))
def test_examples_consumer_rejects_a_wrong_pattern(pair, daemon):
    producer, consumer = PAIRS[pair]
    p = run(producer(daemon.socket, "--name", "bbpy-wrong", "--size", "4096", "--pattern", "3"))
    assert p.returncode == 0, p.stderr
    q = run(consumer(daemon.socket, "--pattern", "4", p.stdout.strip()))
    assert q.returncode == 1, (q.stdout, q.stderr)
    assert "mismatch" in q.stderr


def test_python_consumer_example_refuses_a_used_token_and_bad_usage(daemon):
    p = run(py_producer(daemon.socket, "--size", "1024"))
    token = p.stdout.strip()
    assert run(py_consumer(daemon.socket, token)).returncode == 0
    again = run(py_consumer(daemon.socket, token))
    assert again.returncode == 1 and "adopt" in again.stderr
    assert run(py_consumer(daemon.socket, "not-a-token")).returncode == 2
    assert run(py_consumer(daemon.socket)).returncode == 2
    assert run(py_producer(daemon.socket, "--pattern", "256")).returncode == 2


def test_c_producer_buffer_adopted_in_process_with_numpy(daemon, client):
    p = run(c_producer(daemon.socket, "--name", "bbpy-c", "--size", "100000", "--pattern", "200"))
    assert p.returncode == 0, p.stderr
    with client.adopt(p.stdout.strip()) as buf:
        assert buf.wait(10) == "ready"
        got = np.frombuffer(buf.view(), dtype=np.uint8)
        assert np.array_equal(got, bbchild.pattern(100000, 200))
        del got
