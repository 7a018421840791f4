"""`settle audit`: one parent's history from a replay, as text and as a self-contained HTML report.

The worked example (SPEC §13) is the reference: its snapshots must equal the ledger of the same prefix of
events, its timelines must show D passing through expired and reconciling, its releases B 8, C 20, D 15.
The HTML report must carry the same numbers as chart data, and render in headless Chromium (Debian's
package, installed here when missing; the test fails, never skips, when it cannot be).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
import zlib
from pathlib import Path

import pytest

from branch_settlement.processors.cli import audit
from branch_settlement.processors.audit.chart import TERM_COLOURS
from branch_settlement.errors import SettlementError
from branch_settlement.processors.replay.replayer import Input, ledger_snapshot, read_events, replay
from branch_settlement.processors.workload import write_jsonl
from branch_settlement.projections import model
from branch_settlement.schemas.codec import default_codec
from tests.debian import debian_binary, run

pytestmark = pytest.mark.unit

ARTIFACT = Path(__file__).resolve().parent / "artifacts" / "audit-worked-example.png"
CHROMIUM = Path("/usr/bin/chromium")
T0 = 1_764_410_400_000
CLOSE = {"type": "ParentClosed", "event_id": "we-15", "idempotency_key": "wf-42/ParentClosed/1",
         "parent_id": "wf-42", "occurred_at_ms": 1764410400150, "outcome": "succeeded"}
LATE = {"type": "ChildReserved", "event_id": "we-16", "idempotency_key": "wf-42/E/E1/reserve", "parent_id": "wf-42",
        "occurred_at_ms": 1764410400160, "child_id": "E", "branch_id": "E", "attempt_id": "E1",
        "quantities": {"tokens": 5}}
HELD_TERMS = ("available", "outstanding", "pending", "awaiting_confirmation", "lent", "returned_to_pool", "committed")


def history_of(path: Path, parent_id: str = "wf-42") -> audit.History:
    codec = default_codec()
    return audit.parent_history(read_events(path, codec), parent_id, codec)


def ledger_of(inputs: list[Input], parent_id: str = "wf-42") -> dict:
    codec = default_codec()
    _, store = replay(inputs, codec=codec)
    return ledger_snapshot(store, codec)["parents"][parent_id]


@pytest.fixture(scope="module")
def history(worked_example: Path) -> audit.History:
    return history_of(worked_example)


@pytest.fixture
def closed_example(worked_example: Path, tmp_path: Path) -> Path:
    path = tmp_path / "closed.jsonl"
    path.write_text(worked_example.read_text() + json.dumps(CLOSE) + "\n" + json.dumps(LATE) + "\n")
    return path


def chart_json(html: str) -> dict:
    found = re.search(r'<script type="application/json" id="chart-data">(.*?)</script>', html, re.S)
    assert found, "no chart-data script element"
    return json.loads(found.group(1))


# -- the history --------------------------------------------------------------------------------------------


def test_final_snapshot_equals_the_ledger(history: audit.History, worked_example: Path) -> None:
    codec = default_codec()
    ledger = ledger_of(list(read_events(worked_example, codec)))
    final = history.points[-1].balances
    assert final == ledger["dimensions"]
    assert final["tokens"] == {"capacity": 100, "available": 63, "outstanding": 0, "pending": 0,
                               "awaiting_confirmation": 0, "lent": 0, "returned_to_pool": 0, "committed": 37,
                               "overdrawn": 0}
    assert history.status == ledger["status"] == "open"
    assert {dim: {t: b[t] for t in model.BALANCE_TERMS} for dim, b in history.dimensions.items()} == final


def test_every_snapshot_equals_the_ledger_of_its_prefix(history: audit.History, worked_example: Path) -> None:
    codec = default_codec()
    inputs = list(read_events(worked_example, codec))
    for step in history.points:
        prefix = [item for item in inputs if item.offset <= step.offset]
        assert step.balances == ledger_of(prefix)["dimensions"], f"offset {step.offset}"
        for balance in step.balances.values():
            assert sum(balance[t] for t in HELD_TERMS) == balance["capacity"] + balance["overdrawn"]


def test_steps_are_the_parents_events_and_ticks_while_it_lives(history: audit.History) -> None:
    # Offset 0 is the partition's first tick, before wf-42 was reserved: not part of its story.
    assert [s.offset for s in history.steps] == list(range(1, 15))
    assert [s.event_type for s in history.steps if s.is_tick] == ["Tick"]
    results = {s.event_id: s.result for s in history.steps}
    assert results.pop("we-dup") == "duplicate"
    assert set(results.values()) == {"ok"}
    tick = next(s for s in history.steps if s.is_tick)
    assert tick.ledger_time_ms == T0 + 61_000 and not tick.quiet
    assert [(a["child_id"], a["new_state"]) for a in tick.audits] == [("D", "expired"), ("D", "reconciling")]


def test_d_passes_through_expired_and_reconciling_to_released(history: audit.History) -> None:
    d = history.timelines["D"]
    assert d.states() == ["reserved", "activated", "expired", "reconciling", "released"]
    spans = [(s.state, s.start_offset, s.start_fraction, s.start_ms, s.end_offset) for s in d.segments]
    assert spans == [("reserved", 5, 0.0, T0, 8), ("activated", 8, 0.0, T0, 13),
                     ("expired", 13, 0.0, T0 + 61_000, 13), ("reconciling", 13, 0.5, T0 + 61_000, 14),
                     ("released", 14, 0.0, T0 + 61_000, None)]
    assert {seg.attempt_id for seg in d.segments} == {"D1"}
    assert [seg.lease_generation for seg in d.segments] == [0, 1, 1, 1, 1]
    assert history.timelines["C"].states() == ["reserved", "released"]
    assert history.timelines["A"].state == "committed"
    assert history.timelines[""].states() == ["open"]


def test_releases_b8_c20_d15_to_the_parent(history: audit.History) -> None:
    assert [(r["child_id"], r["dimension"], r["quantity"], r["destination"], r["reason"])
            for r in history.releases] == [("B", "tokens", 8, "parent", "completed"),
                                           ("C", "tokens", 20, "parent", "skipped"),
                                           ("D", "tokens", 15, "parent", "final_usage")]
    assert history.settled is None
    committed = [(a["child_id"], a["quantity"]) for a in history.audits if a["note"] == "usage committed"]
    assert committed == [("A", 20), ("B", 12), ("D", 5)]


def test_closing_sends_63_to_the_pool_and_late_events_are_shown(closed_example: Path) -> None:
    history = history_of(closed_example)
    assert history.status == "closed" and history.outcome == "succeeded"
    assert history.timelines[""].states() == ["open", "closing", "closed"]
    assert history.releases[-1]["destination"] == "global_pool" and history.releases[-1]["quantity"] == 63
    assert history.settled["dimensions"]["tokens"]["returned_to_pool"] == 63
    last = history.steps[-1]
    assert (last.event_id, last.result) == ("we-16", "parent_closed")
    assert history.points[-1].balances["tokens"]["returned_to_pool"] == 63


def test_ticks_of_a_workload_are_kept_only_while_the_parent_lives(tmp_path: Path) -> None:
    path = tmp_path / "workload.jsonl"
    write_jsonl(str(path), 11, 1500)
    codec = default_codec()
    inputs = list(read_events(path, codec))
    parent_id = next(i.event["parent_id"] for i in inputs if i.event and i.event["type"] == "ParentReserved")
    history = audit.parent_history(inputs, parent_id, codec)
    assert history.status == "closed"
    settled_at = history.settled["input_offset"]
    reserved_at = next(s.offset for s in history.steps if s.event_type == "ParentReserved")
    ticks = [s for s in history.steps if s.is_tick]
    assert ticks and all(reserved_at < s.offset <= settled_at for s in ticks)
    named = [i.offset for i in inputs if i.event and i.event["parent_id"] == parent_id]
    assert [s.offset for s in history.steps if not s.is_tick] == named
    assert history.points[-1].balances == ledger_of(inputs, parent_id)["dimensions"]
    assert history.dead_letters == sum(1 for i in inputs if i.event is None)


def test_avro_input_gives_the_same_history(history: audit.History, worked_example: Path, tmp_path: Path) -> None:
    codec = default_codec()
    avro = tmp_path / "events.avro"
    codec.write_container(avro, [item.event for item in read_events(worked_example, codec)])
    assert audit.render_text(history_of(avro)) == audit.render_text(history)


def test_an_unknown_parent_is_a_clear_error(worked_example: Path) -> None:
    with pytest.raises(audit.UnknownParentError, match="no event names parent 'wf-43'") as caught:
        history_of(worked_example, "wf-43")
    assert isinstance(caught.value, SettlementError)


def test_a_parent_named_but_never_reserved_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "orphan.jsonl"
    path.write_text(json.dumps({**LATE, "parent_id": "ghost", "idempotency_key": "ghost/E/E1/reserve"}) + "\n")
    with pytest.raises(audit.UnknownParentError, match="'ghost' was never reserved: 1 events name it, "
                                                       "with results unknown_parent"):
        history_of(path, "ghost")


# -- the text report ----------------------------------------------------------------------------------------


def test_text_report_has_the_key_lines(history: audit.History) -> None:
    text = audit.render_text(history)
    lines = text.splitlines()
    assert lines[0] == "Parent wf-42  status open, outcome -"
    assert "ledger time 2025-11-29T10:00:00.000Z → 2025-11-29T10:01:01.000Z" in lines
    assert any(line.split() == ["tokens", "100", "63", "0", "0", "0", "0", "0", "37", "0"] for line in lines)
    assert any(line.split()[:4] == ["D", "D1", "1", "released"]
               and line.endswith("reserved → activated → expired → reconciling → released") for line in lines)
    for expected in ("D/D1: activated → expired → reconciling (reconciling after lease expiry)",
                     "release tokens 8 → parent (completed)", "release tokens 20 → parent (skipped)",
                     "release tokens 15 → parent (final_usage)", "tokens: available 48→63, pending 20→0, committed 32→37",
                     "original event we-11 had result ok", "total: tokens 43 → parent"):
        assert expected in text, expected


def test_text_event_table_is_aligned(history: audit.History) -> None:
    lines = audit.render_text(history).splitlines()
    head = lines.index(next(line for line in lines if line.lstrip().startswith("offset  ledger time")))
    columns = [lines[head].index(name) for name in ("ledger time", "event", "child/attempt", "result", "what changed")]
    rows = lines[head + 1:lines.index("", head)]
    assert len(rows) > len(history.steps)
    for row in rows:
        if row[:columns[0]].strip():
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", row[columns[0]:columns[0] + 24]), row
            assert row[columns[1] - 2:columns[1]] == "  " and row[columns[1]] != " ", row
        else:
            assert row[:columns[4]].strip() == "" and row[columns[4]] != " ", row


def test_colour_only_on_request_and_it_keeps_the_columns(history: audit.History) -> None:
    plain = audit.render_text(history)
    coloured = audit.render_text(history, color=True)
    assert "\x1b[" not in plain and "\x1b[32m" in coloured
    assert re.sub(r"\x1b\[\d+m", "", coloured) == plain


# -- the HTML report ----------------------------------------------------------------------------------------


def test_chart_data_matches_the_snapshots_and_the_ledger(history: audit.History, worked_example: Path) -> None:
    data = chart_json(audit.render_html(history))
    assert (data["parent_id"], data["status"]) == ("wf-42", "open")
    tokens = data["dimensions"]["tokens"]
    assert [p["offset"] for p in tokens["points"]] == [s.offset for s in history.points]
    for point, step in zip(tokens["points"], history.points):
        assert {t: point[t] for t in model.BALANCE_TERMS} == step.balances["tokens"]
        assert point["ledger_time_ms"] == step.ledger_time_ms
    codec = default_codec()
    final = ledger_of(list(read_events(worked_example, codec)))["dimensions"]["tokens"]
    assert {t: tokens["points"][-1][t] for t in model.BALANCE_TERMS} == final
    d = next(t for t in data["timelines"] if t["child_id"] == "D")
    assert [s["state"] for s in d["segments"]] == ["reserved", "activated", "expired", "reconciling", "released"]


def test_html_is_self_contained_and_opens_with_the_chart(history: audit.History) -> None:
    html = audit.render_html(history, source="worked-example.jsonl")
    assert "://" not in html and not re.search(r"<(link|img|iframe)\b|\bsrc\s*=", html)
    body = html[html.index("<body"):]
    first_chart = body.index('<svg class="balance-chart by-event"')
    assert first_chart < body.index('<svg class="timeline-chart') < body.index("<table")
    assert "<h1>Parent <span class=\"id\">wf-42</span></h1>" in html
    for state in ("expired", "reconciling", "released", "committed"):
        assert f'data-state="{state}"' in html
    assert audit.render_html(history, source="worked-example.jsonl") == html  # deterministic


def test_html_escapes_what_the_events_say(tmp_path: Path, worked_example: Path) -> None:
    path = tmp_path / "odd.jsonl"
    text = worked_example.read_text().replace('"pruned by router"', '"<script>alert(1)</script> & co"')
    path.write_text(text)
    html = audit.render_html(history_of(path))
    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)&lt;/script&gt; &amp; co" in html


# -- the command ----------------------------------------------------------------------------------------------


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="settle")
    audit.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return args.run(args)


def test_cli_prints_the_report_and_writes_the_html(worked_example: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "report.html"
    assert run_cli("audit", "wf-42", str(worked_example), "--html", str(out)) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("Parent wf-42  status open") and "\x1b[" not in printed
    assert printed.rstrip().endswith(f"HTML report written to {out}")
    assert chart_json(out.read_text())["dimensions"]["tokens"]["points"][-1]["available"] == 63


def test_cli_errors_are_one_line_settlement_errors(worked_example: Path, tmp_path: Path) -> None:
    cases = [
        (("audit", "wf-43", str(worked_example)), "no event names parent 'wf-43'"),
        (("audit", "wf-42", str(tmp_path / "missing.jsonl")), "no such file"),
        (("audit", "wf-42", str(worked_example), "--html", str(tmp_path / "no" / "dir.html")), "no such directory"),
        (("audit", "wf-42", str(worked_example), "--partition", "-1"), "--partition must be >= 0"),
    ]
    for argv, message in cases:
        with pytest.raises(SettlementError, match=re.escape(message)) as caught:
            run_cli(*argv)
        assert "\n" not in str(caught.value)


def test_cli_help_explains(capsys) -> None:
    with pytest.raises(SystemExit):
        run_cli("audit", "--help")
    text = capsys.readouterr().out
    for words in ("PARENT_ID", "FILE", "--html OUT.html", "--partition N", "Avro object container",
                  "ticks", "chart-data"):
        assert words in text


# -- headless Chromium ------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def chromium() -> Path:
    """Debian's chromium, installed with apt-get when missing. Fails (never skips) when it cannot be."""
    return debian_binary(CHROMIUM, "chromium")


def headless(chromium: Path, profile: Path, *args: str) -> list[str]:
    return [str(chromium), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--hide-scrollbars", f"--user-data-dir={profile}", *args]


def png_rows(data: bytes, max_rows: int) -> tuple[int, list[bytes]]:
    """Width and the first `max_rows` rows of an 8-bit RGB or RGBA, non-interlaced PNG, as RGB bytes."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour_type, _, _, interlace = header
    assert depth == 8 and colour_type in (2, 6) and interlace == 0, header
    channels = 3 if colour_type == 2 else 4
    stride = width * channels
    raw = zlib.decompressobj().decompress(idat, (stride + 1) * min(height, max_rows))
    rows, prev = [], bytearray(stride)
    for y in range(min(height, max_rows)):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if kind == 1:
            for i in range(channels, stride):
                line[i] = (line[i] + line[i - channels]) & 0xFF
        elif kind == 2:
            line = bytearray((a + b) & 0xFF for a, b in zip(line, prev))
        elif kind == 3:
            for i in range(stride):
                left = line[i - channels] if i >= channels else 0
                line[i] = (line[i] + ((left + prev[i]) >> 1)) & 0xFF
        elif kind == 4:
            for i in range(stride):
                a = line[i - channels] if i >= channels else 0
                b, c = prev[i], prev[i - channels] if i >= channels else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        prev = line
        rows.append(bytes(line) if channels == 3 else bytes(v for i, v in enumerate(line) if i % 4 != 3))
    return width, rows


def test_the_worked_example_report_renders_in_headless_chromium(chromium: Path, history: audit.History,
                                                                tmp_path: Path) -> None:
    page = tmp_path / "audit.html"
    page.write_text(audit.render_html(history, source="worked-example.jsonl"), encoding="utf-8")
    shot = tmp_path / "audit.png"
    done = run(headless(chromium, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1280,1600",
                         page.as_uri()), 180)
    assert done.returncode == 0 and shot.is_file(), f"chromium failed ({done.returncode}): {done.stderr[-3000:]}"
    data = shot.read_bytes()
    assert len(data) > 20_000, f"screenshot is only {len(data)} bytes"
    width, rows = png_rows(data, 700)
    assert width == 1280
    pixels = {row[i:i + 3] for row in rows[::4] for i in range(0, len(row), 12)}
    assert len(pixels) > 100, f"the screenshot has only {len(pixels)} colours"
    # The balance chart is the first thing on the page: its committed and available areas are on screen
    # within the first 700 pixels.
    for term in ("committed", "available"):
        colour = bytes.fromhex(TERM_COLOURS[term][1:])
        near = [p for p in pixels if sum(abs(a - b) for a, b in zip(p, colour)) < 24]
        assert near, f"no {term} colour {colour.hex()} in the top of the screenshot"
    ARTIFACT.parent.mkdir(exist_ok=True)
    shutil.copyfile(shot, ARTIFACT)

    dom = run(headless(chromium, tmp_path / "profile", "--dump-dom", page.as_uri()), 180)
    assert dom.returncode == 0, dom.stderr[-3000:]
    chart = re.search(r'<svg class="balance-chart by-event"[^>]*>(.*?)</svg>', dom.stdout, re.S)
    assert chart, "no balance chart in the rendered DOM"
    areas = re.findall(r'<path d="(M[\d. LHZ-]+)" fill="#[0-9a-f]{6}" class="area term-(\w+)"', chart.group(1))
    assert {term for _, term in areas} == {"committed", "outstanding", "pending", "available"}
    assert all(len(re.findall(r"[\d.]+", d)) > 10 for d, _ in areas)
    assert chart_json(dom.stdout)["dimensions"]["tokens"]["points"][-1]["committed"] == 37
