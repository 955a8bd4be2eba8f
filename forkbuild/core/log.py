"""Progress lines for long steps: elapsed time since the command started, to stderr."""

import sys
import time

_START = time.monotonic()


def step(message: str) -> None:
    elapsed = time.monotonic() - _START
    print(f"[forkbuild {elapsed:6.1f}s] {message}", file=sys.stderr, flush=True)
