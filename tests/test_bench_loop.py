"""bench/loop.py, the processor's loop in one process without a broker, still runs the real Processor to the last
commit (it raises if an input offset is left uncommitted) and reports what it says it reports."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent


def test_the_loop_benchmark_folds_everything_and_reports_per_input_record() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "loop.py"), "--events", "3000", "--repeat", "1",
                           "--split"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    records = int(re.search(r"^([\d,]+) input records", out, re.M).group(1).replace(",", ""))
    assert records > 3000  # the generator's events and its malformed records
    assert float(re.search(r"main thread: ([\d.]+) CPU µs per input record", out).group(1)) > 0
    produced = dict(re.findall(r"([a-z-]+) ([\d.]+)", out.split("records produced per input record: ")[1]
                               .splitlines()[0]))
    assert float(produced["settlement-results"]) > 0.9  # a result for (nearly) every event
    assert {"ledger-changelog", "settlement-audit"} <= set(produced)
    assert "RocksStore.write" in out and "LedgerStats.apply" in out
