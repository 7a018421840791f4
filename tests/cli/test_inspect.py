"""`settle inspect PARENT`: one parent's balances, children and loans from a projection, as tables (and the
same parent as JSON with --json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from branch_settlement.processors.cli import main as cli_main

pytestmark = pytest.mark.unit

BORROWING = Path(__file__).resolve().parents[2] / "examples" / "borrowing.jsonl"


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """The borrowing example folded into a projection where the processor of group g keeps partition 0."""
    assert cli_main.main(["replay", str(BORROWING), "--store", str(tmp_path / "state" / "g" / "partition-0")]) == 0
    return tmp_path / "state"


def test_inspect_shows_the_loans_of_a_parent_that_lent(state: Path, capsys) -> None:
    capsys.readouterr()
    assert cli_main.main(["inspect", "wf-7", "--state-dir", str(state), "--group-id", "g"]) == 0
    out = capsys.readouterr().out
    loans = out.split("loans (capacity lent to other workloads)\n")[1].splitlines()
    assert loans[0].split() == ["loan", "borrower", "state", "lent", "asked", "back", "used"]
    assert loans[1].split() == ["L1", "batch-7", "returned", "tokens", "30", "yes", "tokens", "10"]
    assert loans[2].split() == ["L2", "batch-9", "returned", "tokens", "5", "yes", "tokens", "2"]
    assert cli_main.main(["inspect", "wf-7", "--state-dir", str(state), "--group-id", "g", "--json"]) == 0
    parent = json.loads(capsys.readouterr().out)["parent"]
    assert [loan["loan_id"] for loan in parent["loans"]] == ["L1", "L2"]


def test_a_parent_that_never_lent_shows_no_loans(tmp_path: Path, capsys) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "worked-example.jsonl"
    assert cli_main.main(["replay", str(example), "--store", str(tmp_path / "state" / "g" / "partition-0")]) == 0
    parent = json.loads(example.read_text().splitlines()[1])["parent_id"]
    capsys.readouterr()
    assert cli_main.main(["inspect", parent, "--state-dir", str(tmp_path / "state"), "--group-id", "g"]) == 0
    out = capsys.readouterr().out
    assert "children" in out and "loans" not in out
