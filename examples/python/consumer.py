#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""consumer.py: receive a buffer from another process and check its bytes.

    consumer.py [--socket PATH] [--size BYTES] [--pattern BYTE]
                [--timeout-ms N] (TOKEN | --name NAME)

The Python twin of bb-consumer (examples/consumer.c), with the same flags,
output and exit status. Adopts the token a producer printed (or opens the
buffer by name), waits until the producer has set it READY, and verifies
every byte against the producer's pattern ((i*31 + pattern) & 0xff).
--size, when given, is the size the buffer must have. Exits 0 when every
byte matches, 1 otherwise, 2 on bad usage.
"""

import argparse
import sys
from typing import Callable, List, Optional

import bufbroker


def pattern_bytes(size: int, pattern: int) -> bytes:
    """Byte i is (i*31 + pattern) & 0xff, exactly as the producers write it."""
    period = bytes((i * 31 + pattern) & 0xFF for i in range(256))
    reps, rest = divmod(size, 256)
    return period * reps + period[:rest]


def number(what: str, minimum: int, maximum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text, 0)
        except ValueError:
            v = minimum - 1
        if v < minimum or v > maximum:
            raise argparse.ArgumentTypeError(f"bad {what} '{text}'")
        return v

    return parse


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="consumer.py", description=__doc__.splitlines()[0])
    ap.add_argument("--socket", help="the daemon's socket (default: $BUFBROKER_SOCKET or the default)")
    ap.add_argument("--name", help="open the buffer by name instead of adopting a token")
    ap.add_argument("--size", type=number("size", 1, 2**63 - 1), help="the size the buffer must have")
    ap.add_argument("--pattern", type=number("pattern", 0, 255), default=0)
    ap.add_argument("--timeout-ms", type=number("timeout", -(2**31), 2**31 - 1), default=10000,
                    help="how long to wait for READY (negative: forever; default 10000)")
    ap.add_argument("token", nargs="?", help="the token (32 hex digits) a producer printed")
    args = ap.parse_args(argv)
    if (args.token is None) == (args.name is None):  # exactly one of the two
        ap.print_usage(sys.stderr)
        return 2
    # A token travels as 32 hex digits; check it before connecting.
    if args.token is not None:
        t = args.token
        if len(t) != 2 * bufbroker.TOKEN_SIZE or any(ch not in "0123456789abcdefABCDEF" for ch in t):
            print(f"consumer.py: '{t}' is not a token (32 hex digits)", file=sys.stderr)
            return 2

    step = "connect"
    try:
        with bufbroker.Client(args.socket) as client:
            # Either way we now hold one reference. A token can be adopted
            # once, by anyone who has it; a name opens only if the share
            # policy admits us.
            if args.token is not None:
                step = "adopt"
                buf = client.adopt(args.token)
            else:
                step = "open"
                buf = client.open_name(args.name)
            with buf:
                # The producer may still be filling it.
                step = "wait"
                timeout = None if args.timeout_ms < 0 else args.timeout_ms / 1000
                state = buf.wait(timeout)
                # Fresh from the daemon: the buffer's name, and the producer's error.
                step = "stat"
                info = buf.stat()
                if state == "failed":
                    print(f"consumer.py: the producer failed buffer {info.id}: {info.error or ''}",
                          file=sys.stderr)
                    return 1
                if buf.kind != "host":
                    print(f"consumer.py: buffer {info.id} is not a host buffer", file=sys.stderr)
                    return 1
                if args.size is not None and args.size != buf.size:
                    print(f"consumer.py: buffer {info.id} has {buf.size} bytes, expected {args.size}",
                          file=sys.stderr)
                    return 1
                step = "map"
                mem = buf.view()
                want = pattern_bytes(buf.size, args.pattern)
                if mem != want:
                    i = next(i for i in range(buf.size) if mem[i] != want[i])
                    print(f"consumer.py: mismatch at offset {i}: got 0x{mem[i]:02x}, "
                          f"expected 0x{want[i]:02x}", file=sys.stderr)
                    return 1
                del mem
                named = f" ({info.name})" if info.name else ""
                print(f"consumer: verified {buf.size} bytes of buffer {info.id}{named}")
                return 0
            # Our reference goes with the with block; the buffer is freed
            # once no one else holds it.
    except bufbroker.BufbrokerError as e:
        print(f"consumer.py: {step}: {e.message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
