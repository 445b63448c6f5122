#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""tensors.py: share a float32 matrix between two connections through numpy
and DLPack, with no copy.

    tensors.py [--socket PATH] [--rows N] [--cols N]

The producer side allocates a host buffer, views it as a rows x cols
float32 tensor (``buf.as_tensor``), fills it through ``numpy.asarray`` and
hands a token on; the consumer side (another connection, as another process
would) adopts the token and reads the same memory through
``numpy.from_dlpack``. It prints "verified ROWSxCOLS float32" and exits 0,
or says what differs and exits 1.

A torch or CuPy user writes the same three lines for CUDA buffers::

    buf = client.alloc(nbytes, kind="cuda")
    x = torch.from_dlpack(buf.as_tensor(torch.float16, (rows, cols)))
    y = cupy.from_dlpack(buf.as_tensor("float16", (rows, cols)))

Needs the bufbroker package (pip install ./python, or python/ on
PYTHONPATH), libbufbroker.so.0, numpy and a running bufbrokerd. The package
is typed: ``mypy --strict`` checks this file against it.
"""

import argparse
import sys
from typing import List, Optional

import numpy as np
import numpy.typing as npt

import bufbroker


def expected(rows: int, cols: int) -> npt.NDArray[np.float32]:
    """Element (r, c) is r + c / 1000."""
    r = np.arange(rows, dtype=np.float32)[:, None]
    c = np.arange(cols, dtype=np.float32)[None, :]
    return r + c / np.float32(1000)


def produce(client: bufbroker.Client, rows: int, cols: int) -> str:
    """A READY buffer holding the matrix; returns a token for it."""
    with client.alloc(rows * cols * 4) as buf:
        tensor: bufbroker.Tensor = buf.as_tensor("float32", (rows, cols))
        matrix = np.asarray(tensor)  # the shared memory itself
        matrix[:] = expected(rows, cols)
        del matrix
        token = buf.ref().take()
        buf.set_ready()
    return token


def consume(client: bufbroker.Client, token: str, rows: int, cols: int) -> bool:
    """Adopt the token and compare the matrix, read through DLPack."""
    with client.adopt(token) as buf:
        if buf.wait(timeout=5) != "ready":
            print(f"tensors.py: the buffer failed: {buf.stat().error}", file=sys.stderr)
            return False
        seen = np.from_dlpack(buf.as_tensor(np.float32, (rows, cols)))
        ok = bool(np.array_equal(seen, expected(rows, cols)))
        if not ok:
            bad = np.argwhere(seen != expected(rows, cols))[0]
            print(f"tensors.py: mismatch at {tuple(bad)}", file=sys.stderr)
        return ok


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="tensors.py", description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--socket", help="the daemon's socket (default: $BUFBROKER_SOCKET or the default)")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=512)
    args = ap.parse_args(argv)
    if args.rows <= 0 or args.cols <= 0:
        ap.error("--rows and --cols must be > 0")
    try:
        with bufbroker.Client(args.socket) as producer, bufbroker.Client(args.socket) as consumer:
            token = produce(producer, args.rows, args.cols)
            if not consume(consumer, token, args.rows, args.cols):
                return 1
    except bufbroker.BufbrokerError as e:
        print(f"tensors.py: {e.message}", file=sys.stderr)
        return 1
    print(f"verified {args.rows}x{args.cols} float32")
    return 0


if __name__ == "__main__":
    sys.exit(main())
