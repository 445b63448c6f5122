#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""producer.py: make a buffer, fill it, and hand it to another process.

    producer.py [--socket PATH] [--name NAME] [--size BYTES] [--pattern BYTE]

The Python twin of bb-producer (examples/producer.c), with the same flags,
output and byte pattern, so either consumer reads either producer's buffer.
Allocates a named host buffer through bufbrokerd, fills it (byte i is
(i*31 + pattern) & 0xff), and prints a token (32 hex digits) on stdout. The
token holds a reference of its own, so the buffer outlives this process
until a consumer adopts the token or the daemon's token TTL passes:

    tok=$(python3 producer.py) && python3 consumer.py "$tok"

Needs the bufbroker package on PYTHONPATH (python/ in the source tree) and
libbufbroker (or $BUFBROKER_LIBRARY naming it).
"""

import argparse
import sys
from typing import Callable, List, Optional

import bufbroker


def pattern_bytes(size: int, pattern: int) -> bytes:
    """The buffer's expected contents: byte i is (i*31 + pattern) & 0xff.
    It repeats every 256 bytes (31*256 is a multiple of 256)."""
    period = bytes((i * 31 + pattern) & 0xFF for i in range(256))
    reps, rest = divmod(size, 256)
    return period * reps + period[:rest]


def number(what: str, maximum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text, 0)
        except ValueError:
            v = -1
        if v < 0 or v > maximum:
            raise argparse.ArgumentTypeError(f"bad {what} '{text}'")
        return v

    return parse


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="producer.py", description=__doc__.splitlines()[0])
    ap.add_argument("--socket", help="the daemon's socket (default: $BUFBROKER_SOCKET or the default)")
    ap.add_argument("--name", default="example", help="the buffer's name (default: example)")
    ap.add_argument("--size", type=number("size", 2**64 - 1), default=1 << 20)
    ap.add_argument("--pattern", type=number("pattern", 255), default=0)
    args = ap.parse_args(argv)  # bad usage exits 2, like bb-producer

    step = "connect"
    try:
        # One connection; everything it holds goes when it closes, except
        # what we put into tokens.
        with bufbroker.Client(args.socket) as client:
            step = "alloc"
            with client.alloc(args.size, kind="host", name=args.name, share="uid") as buf:
                # Host buffers map straight into this process: no copy.
                step = "map"
                buf.view()[:] = pattern_bytes(args.size, args.pattern)
                # take() gives a reference away to the token; take it from
                # a ref() so that buf stays usable for set_ready below.
                step = "take"
                token = buf.ref().take()
                print(token, flush=True)  # the reader may be waiting on a pipe
                # A consumer may adopt the token already; its wait returns
                # once the buffer is READY.
                step = "set_ready"
                buf.set_ready()
            # Our own reference went with the with block; the token's keeps
            # the buffer alive.
    except bufbroker.BufbrokerError as e:
        print(f"producer.py: {step}: {e.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
