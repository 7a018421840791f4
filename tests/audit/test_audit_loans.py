"""Explicit borrowing in `settle audit` and `settle replay --json`, on examples/borrowing.jsonl: parent wf-7 (100
tokens, lending at most 50) lends L1 (30) to batch-7; sibling B (45) is `awaiting_revocation` and L1 is asked
back; batch-7 returns it with 10 used (20 back); B's retry is `ok`; L2 (5) goes to batch-9; A completes with
25; the close asks L2 back and the parent stays closing until batch-9 returns it with 2 used (3 to the pool).
The report shows each loan (lent, asked back, returned, used) and keeps the loans' records out of the
parent's status row; the ledger JSON shows the loans of a parent that lent, and nothing new for one that did
not."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from branch_settlement.processors.audit.history import PARENT_ROW, parent_history
from branch_settlement.processors.audit.html import CHART_DATA_ID, chart_data, render_html
from branch_settlement.processors.audit.text import render_text
from branch_settlement.processors.replay.replayer import read_events
from branch_settlement.schemas.codec import default_codec

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "borrowing.jsonl"
WORKED = REPO / "examples" / "worked-example.jsonl"


def settle(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "branch_settlement.processors.cli.main", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=300)


@pytest.fixture(scope="module")
def history():
    codec = default_codec()
    return parent_history(read_events(EXAMPLE, codec), "wf-7", codec)


def test_the_parents_row_shows_its_status_alone(history) -> None:
    assert history.timelines[PARENT_ROW].states() == ["open", "closing", "closed"]
    assert set(history.timelines) == {PARENT_ROW, "A", "B"}


def test_each_loan_is_shown_lent_asked_back_and_returned(history) -> None:
    data = chart_data(history)
    assert data["loans"] == [
        {"loan_id": "L1", "borrower": "batch-7", "quantities": {"tokens": 30}, "state": "returned",
         "revocation_requested": True, "usage": {"tokens": 10}, "lent_offset": 3, "asked_offset": 4,
         "returned_offset": 5},
        {"loan_id": "L2", "borrower": "batch-9", "quantities": {"tokens": 5}, "state": "returned",
         "revocation_requested": True, "usage": {"tokens": 2}, "lent_offset": 7, "asked_offset": 10,
         "returned_offset": 11},
    ]
    assert [(r["loan_id"], r["reason"], r["child_id"]) for r in history.revocations] == [
        ("L1", "sibling_needs_capacity", "B"), ("L2", "parent_closed", "")]
    page = render_html(history, source="borrowing.jsonl")
    section = re.search(r'<section class="card loans">.*?</section>', page, re.S).group(0)
    assert "<th>L1</th><td>batch-7</td><td>tokens 30</td>" in section
    assert "asked back loan L1 of batch-7 (tokens 30): sibling_needs_capacity for B" in section
    assert "asked back loan L2 of batch-9 (tokens 5): parent_closed" in section
    embedded = re.search(rf'<script type="application/json" id="{CHART_DATA_ID}">(.*?)</script>', page, re.S)
    assert json.loads(embedded.group(1))["loans"] == data["loans"]
    # Every lent point of the chart is the ledger's.
    assert [p["lent"] for p in data["dimensions"]["tokens"]["points"]] == [0, 0, 30, 30, 0, 0, 5, 5, 5, 5, 0]


def test_the_text_report_names_the_loans(history) -> None:
    text = render_text(history)
    assert "LoanRequested   loan L1" in text
    assert "asked back loan L1 of batch-7 (tokens 30): sibling_needs_capacity for B" in text
    assert "release loan tokens 3 → global_pool (loan_returned)" in text
    assert re.search(r"\n\s+11 .*loan\s+tokens\s+3\s+global_pool\s+loan_returned", text)


def test_a_parent_without_loans_has_no_loans_section(tmp_path: Path) -> None:
    codec = default_codec()
    worked = parent_history(read_events(WORKED, codec), "wf-42", codec)
    assert 'class="card loans"' not in render_html(worked) and chart_data(worked)["loans"] == []


def test_the_ledger_json_shows_the_loans_of_a_parent_that_lent() -> None:
    run = settle("replay", str(EXAMPLE), "--json")
    assert run.returncode == 0, run.stdout + run.stderr
    doc = json.loads(run.stdout)
    parent = doc["parents"]["wf-7"]
    assert parent["status"] == "closed"
    assert parent["loans"]["L1"] == {"borrower": "batch-7", "quantities": {"tokens": 30}, "state": "returned",
                                     "revocation_requested": True, "usage": {"tokens": 10}}
    tokens = parent["dimensions"]["tokens"]
    assert (tokens["committed"], tokens["returned_to_pool"], tokens["lent"]) == (37, 63, 0)
    assert [r["result"] for r in doc["results"]][4] == "awaiting_revocation"
    assert [(r["child_id"], r["quantity"], r["destination"], r["reason"]) for r in doc["releases"]
            if r["reason"] == "loan_returned"] == [("", 20, "parent", "loan_returned"),
                                                   ("", 3, "global_pool", "loan_returned")]
    worked = json.loads(settle("replay", str(WORKED), "--json").stdout)
    assert all("loans" not in p for p in worked["parents"].values())
