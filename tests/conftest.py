from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


WORKED_EXAMPLE = REPO / "examples" / "worked-example.jsonl"


@pytest.fixture(scope="session")
def worked_example() -> Path:
    """The worked example (docs: the contract's example), kept in the repository."""
    return WORKED_EXAMPLE
