"""Named crash points for fault-injection tests. Inert unless the environment variable that only the tests
set names the point: SETTLE_CRASH_AT=<point>[:<n>] crashes (os._exit, like kill -9: no cleanup, no flush)
the n-th time (default 1st) the point is reached."""

from __future__ import annotations

import os
import sys

CRASH_ENV = "SETTLE_CRASH_AT"
CRASH_EXIT_CODE = 137
POINTS = ("after_produce", "after_send_offsets", "after_commit", "mid_restore")

_counts: dict[str, int] = {}


def crash_point(name: str) -> None:
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    point, _, nth = spec.partition(":")
    if point != name:
        return
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] == int(nth or 1):
        sys.stderr.write(f"settle: crash point {name} reached ({CRASH_ENV}); exiting like kill -9\n")
        sys.stderr.flush()
        os._exit(CRASH_EXIT_CODE)
