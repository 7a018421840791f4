"""`settle audit PARENT -`: the events from standard input, like replay and produce (processors/cli/inputs.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "worked-example.jsonl"


def settle(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "branch_settlement.processors.cli.main", *args], input=stdin,
                          capture_output=True, cwd=REPO, timeout=120)


def test_audit_reads_standard_input_as_it_reads_the_file(tmp_path: Path) -> None:
    from_file = settle("audit", "wf-42", str(EXAMPLE))
    from_stdin = settle("audit", "wf-42", "-", "--html", str(tmp_path / "report.html"), stdin=EXAMPLE.read_bytes())
    assert from_file.returncode == 0 and from_stdin.returncode == 0, from_stdin.stderr
    assert from_stdin.stdout.startswith(from_file.stdout) and b"HTML report written" in from_stdin.stdout
    assert "standard input" in (tmp_path / "report.html").read_text()


def test_an_export_file_on_standard_input(tmp_path: Path) -> None:
    """An Avro container on standard input is told apart by its first bytes, as a file is."""
    from branch_settlement.processors.replay import export_format
    from branch_settlement.processors.replay.replayer import read_events
    from branch_settlement.schemas.codec import default_codec

    codec = default_codec()
    export = tmp_path / "events.avro"
    export_format.write_export(str(export), ((0, item, None) for item in read_events(EXAMPLE, codec)), codec, 1)
    run = settle("audit", "wf-42", "-", stdin=export.read_bytes())
    assert run.returncode == 0, run.stderr
    assert run.stdout == settle("audit", "wf-42", str(export)).stdout


def test_nothing_on_standard_input_names_no_parent() -> None:
    run = settle("audit", "wf-42", "-", stdin=b"")
    assert run.returncode == 2 and b"no event names parent 'wf-42' (0 inputs read)" in run.stderr, run.stderr
    assert b"Traceback" not in run.stderr
