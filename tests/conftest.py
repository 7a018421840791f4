from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The contract folder beside the repository (SPEC.md, examples/); SHARED_DIR overrides."""
    path = Path(os.environ.get("SHARED_DIR", REPO.parent / "shared"))
    assert (path / "examples" / "worked-example.jsonl").is_file(), f"no shared/ contract folder at {path}"
    return path


@pytest.fixture(scope="session")
def worked_example(shared_dir: Path) -> Path:
    return shared_dir / "examples" / "worked-example.jsonl"
