"""Progress of the long commands: a tqdm bar on stderr when it is a terminal (a pty here), a plain line every
few seconds elsewhere, nothing with --no-progress; stdout the same bytes whichever."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from branch_settlement.processors.crosscheck.progress import AUTO, BAR, OFF, Progress, count_lines
from branch_settlement.processors.workload import write_jsonl
from tests.cli.terminal import only_progress, settle, settle_on_terminal

pytestmark = pytest.mark.unit


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("progress") / "workload.jsonl"
    write_jsonl(str(path), 7, 6_000)
    return path


def test_a_bar_on_a_terminal_a_plain_line_elsewhere_nothing_when_off() -> None:
    terminal = Terminal()
    with Progress(10_000, stream=terminal, mode=AUTO) as progress:
        progress(4_000)
        progress.update(10_000)
    assert "replayed: 100%" in terminal.getvalue() and "10000/10000" in terminal.getvalue()
    log = io.StringIO()
    with Progress(10_000, stream=log, mode=AUTO, every_s=0) as progress:
        progress(2_500)
    assert log.getvalue() == log.getvalue().splitlines()[0] + "\n"  # one plain line, no bar
    assert log.getvalue().startswith("replayed 2,500/10,000 events, ") and "ETA" in log.getvalue()
    done = io.StringIO()
    with Progress(10_000, stream=done, mode=AUTO, every_s=0) as progress:
        progress.complete()  # done: the command says so, not a progress line
    assert done.getvalue() == ""
    quiet = io.StringIO()
    with Progress(10_000, stream=quiet, mode=AUTO, every_s=3600) as progress:
        progress(2_500)  # within the first few seconds: nothing
    assert quiet.getvalue() == ""
    off = Terminal()
    with Progress(10_000, stream=off, mode=OFF) as progress:
        progress(10_000)
        progress.write("line 3: not sent")
    assert off.getvalue() == "line 3: not sent\n"
    forced = io.StringIO()
    with Progress(None, stream=forced, mode=BAR, unit="records") as progress:
        progress(5)
    assert "5 records" in forced.getvalue()


def test_count_lines(tmp_path: Path) -> None:
    for text, lines in (("", 0), ("a\n", 1), ("a\nb", 2), ("a\n\nb\n", 3)):
        (tmp_path / "f").write_text(text)
        assert count_lines(str(tmp_path / "f")) == lines


@pytest.mark.parametrize("extra", [(), ("--json",), ("--jobs", "1")], ids=["text", "json", "one process"])
def test_file_replay_shows_a_bar_on_a_terminal_and_keeps_stdout(workload: Path, extra) -> None:
    plain = settle("replay", str(workload), *extra)
    assert plain.returncode == 0 and only_progress(plain.stderr), plain.stderr  # not a terminal: no bar
    code, stdout, shown = settle_on_terminal("replay", str(workload), *extra)
    assert code == 0 and stdout == plain.stdout
    lines = count_lines(str(workload))
    assert b"replayed: 100%" in shown and f"{lines}/{lines}".encode() in shown, shown[-500:]
    code, stdout, shown = settle_on_terminal("replay", str(workload), *extra, "--no-progress")
    assert code == 0 and stdout == plain.stdout and shown == b""


def test_a_terminal_that_tells_no_size_still_shows_the_bar(workload: Path) -> None:
    code, _, shown = settle_on_terminal("replay", str(workload), columns=0)
    assert code == 0 and b"replayed: 100%" in shown, shown[-300:]


def test_a_replay_of_standard_input(workload: Path) -> None:
    plain = settle("replay", "-", stdin=workload.read_bytes())
    code, stdout, shown = settle_on_terminal("replay", "-", stdin=workload.read_bytes())
    assert code == 0 and stdout == plain.stdout and b"replayed: 100%" in shown


def test_the_plain_line_of_a_long_run_goes_to_stderr_only(workload: Path) -> None:
    """Not a terminal: at most a plain line every few seconds, on stderr; the JSON on stdout stays whole."""
    run = settle("replay", str(workload), "--json", "--jobs", "1")
    assert json.loads(run.stdout)["results"]
    assert only_progress(run.stderr), run.stderr
