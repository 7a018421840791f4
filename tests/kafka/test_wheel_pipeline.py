"""The wheel on its own: built from this checkout, installed into a fresh virtualenv outside the repository
(its dependencies from the package index), and run from a directory that is not the repository, against the
real broker: topics apply, produce, run, replay --topic and audit, with nothing of the checkout on the path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.kafka.pipeline import example_events

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "worked-example.jsonl"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The `settle` of a fresh virtualenv that has only the wheel and its dependencies."""
    root = tmp_path_factory.mktemp("wheel-venv")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(root / "dist"), str(REPO)],
                   check=True, capture_output=True, text=True, timeout=600)
    [wheel] = (root / "dist").glob("branch_settlement-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=120)
    pip = subprocess.run([str(root / "venv" / "bin" / "pip"), "install", "--quiet", str(wheel)],
                         capture_output=True, text=True, timeout=900)
    assert pip.returncode == 0, pip.stderr
    settle = root / "venv" / "bin" / "settle"
    assert settle.is_file()
    return settle


def test_the_installed_wheel_runs_the_pipeline(installed: Path, kafka_bootstrap: str, tmp_path: Path) -> None:
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SETTLE_", "PYTHON"))}
    env.update(SETTLE_BOOTSTRAP_SERVERS=kafka_bootstrap, SETTLE_TOPIC_PREFIX=f"wheel.{uuid.uuid4().hex[:8]}.")

    def settle(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([str(installed), *args], cwd=work, env=env, capture_output=True, text=True,
                              timeout=timeout_s)

    contract = settle("contract")  # the contract every --help points to, from the installed package
    assert contract.returncode == 0 and contract.stdout.startswith("# The settlement contract"), contract.stderr
    where = settle("topics", "apply", "--partitions", "2")
    assert where.returncode == 0, where.stdout + where.stderr
    events = example_events(EXAMPLE, work)  # the example's events: ledger time is the processor's own
    sent = settle("produce", str(events))
    assert sent.returncode == 0 and sent.stdout.startswith("published 13 events"), sent.stdout + sent.stderr
    group = f"wheel-{uuid.uuid4().hex[:8]}"
    log = open(tmp_path / "run.log", "wb")
    run = subprocess.Popen([str(installed), "run", "--state-dir", str(work / "state"), "--group-id", group,
                            "--worker-slot", "wheel", "--tick-interval-ms", "200"],
                           cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:  # until what the processor committed agrees with a re-fold of the input: all folded
            live = settle("replay", "--topic", "branch-events", "--group-id", group)
            if live.returncode == 0 and "NOT YET PROCESSED" not in live.stdout:  # caught up, not only lagging
                break
            assert run.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, live.stdout + live.stderr
            time.sleep(1)
    finally:
        run.send_signal(signal.SIGTERM)
        code = run.wait(60)
        log.close()
    assert code == 0, (tmp_path / "run.log").read_text()[-3000:]
    replay = settle("replay", "--topic", "branch-events", "--state-dir", str(work / "state"), "--group-id", group)
    assert replay.returncode == 0 and "AGREES" in replay.stdout, replay.stdout + replay.stderr
    story = settle("audit", "wf-42", "--topic", "branch-events")
    assert story.returncode == 0 and story.stdout.startswith("Parent wf-42"), story.stdout + story.stderr
    offline = settle("replay", str(events))
    assert offline.returncode == 0 and "13 events folded" in offline.stdout, offline.stdout + offline.stderr
