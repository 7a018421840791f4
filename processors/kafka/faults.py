"""Named crash and pause points for fault-injection tests. Inert unless an environment variable that only
the tests set names the point: SETTLE_CRASH_AT=<point>[:<n>] crashes (os._exit, like kill -9: no cleanup,
no flush) the n-th time (default 1st) the point is reached; SETTLE_PAUSE_AT=<point>[:<n>] stops the
process there (SIGSTOP to itself), so a test can make it a zombie holding uncommitted work, then SIGCONT."""

from __future__ import annotations

import os
import signal
import sys

CRASH_ENV = "SETTLE_CRASH_AT"
PAUSE_ENV = "SETTLE_PAUSE_AT"
CRASH_EXIT_CODE = 137
POINTS = ("after_produce", "before_send_offsets", "after_send_offsets", "after_commit", "mid_restore")

_counts: dict[tuple[str, str], int] = {}


def _reached(env: str, name: str) -> bool:
    spec = os.environ.get(env)
    if not spec:
        return False
    point, _, nth = spec.partition(":")
    if point != name:
        return False
    _counts[(env, name)] = _counts.get((env, name), 0) + 1
    return _counts[(env, name)] == int(nth or 1)


def crash_point(name: str) -> None:
    if _reached(CRASH_ENV, name):
        sys.stderr.write(f"settle: crash point {name} reached ({CRASH_ENV}); exiting like kill -9\n")
        sys.stderr.flush()
        os._exit(CRASH_EXIT_CODE)


def pause_point(name: str) -> None:
    if _reached(PAUSE_ENV, name):
        sys.stderr.write(f"settle: pause point {name} reached ({PAUSE_ENV}); stopping until SIGCONT\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGSTOP)
