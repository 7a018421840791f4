"""A command's input file, or `-` for standard input: spooled to a temporary file first, so that every way a
file is read (told apart by its first bytes, decoded aside, folded in shards) reads standard input too."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from typing import Iterator

from branch_settlement.errors import SettlementError

STDIN = "-"


@contextlib.contextmanager
def input_file(path: str) -> Iterator[str]:
    """`path` itself once it is known to be a file, or, for `-`, a temporary copy of standard input."""
    if path != STDIN:
        if not os.path.isfile(path):
            raise SettlementError(f"no such file: {path}")
        yield path
        return
    spool = tempfile.NamedTemporaryFile(prefix="settle-stdin-", delete=False)
    try:
        with spool:
            shutil.copyfileobj(sys.stdin.buffer, spool, 1 << 20)
        yield spool.name
    finally:
        os.unlink(spool.name)
