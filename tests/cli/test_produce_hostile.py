"""`settle produce` given hostile lines among good ones (docs/contract.md, "The JSON form"; docs/processor.md,
"Input limits"): each bad line is reported with its line number and its reason and not sent, the good lines
are published, no traceback, and the exit code is 1 as `settle produce --help` says. The lines: a negative
quantity, a lone surrogate (`\\ud800`) in an id, an id of 300 bytes, a quantity of 2**64 + 5 (beyond an Avro
long), a line nested 20,000 deep, a Tick, lines that are not objects. Against the real broker: produce asks it
for the topic's partitions before it reads a line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from branch_settlement.processors.kafka.clients import TICK_NOT_PRODUCIBLE
from branch_settlement.schemas.codec import default_codec
from branch_settlement.schemas.limits import MAX_QUANTITY
# the broker fixtures of tests/kafka, for this folder too
from tests.kafka.conftest import kafka_admin, kafka_bootstrap, kafka_topics, topic_prefix  # noqa: F401
from tests.kafka.pipeline import REPO, read_partitions

pytestmark = pytest.mark.kafka

POLICY = {"max_live_children": 4, "reconciliation_timeout_ms": 600_000, "lending_limit": {}}
T = 1_764_410_400_000


def child_reserved(key: str, child: str, quantities) -> dict:
    return {"type": "ChildReserved", "event_id": f"e-{key}", "idempotency_key": key, "parent_id": "wf-h",
            "occurred_at_ms": T, "child_id": child, "branch_id": child, "attempt_id": f"{child}1",
            "quantities": quantities}


def line(obj) -> str:
    return json.dumps(obj)


GOOD = {
    "wf-h/p": line({"type": "ParentReserved", "event_id": "e-p", "idempotency_key": "wf-h/p", "parent_id": "wf-h",
                    "occurred_at_ms": T, "capacity": {"tokens": {"quantity": 100, "kind": "logical"}},
                    "lease_ttl_ms": 3_600_000, "policy": POLICY}),
    "wf-h/A": line(child_reserved("wf-h/A", "A", {"tokens": 10})),
    "wf-h/C": line(child_reserved("wf-h/C", "C", {"tokens": 5})),
    "wf-h/D": line(child_reserved("wf-h/D", "D", {"tokens": MAX_QUANTITY})),  # at the limit: still an event
}

# (the line, what its reason must say)
HOSTILE = [
    (line(child_reserved("wf-h/neg", "N", {"tokens": -1})), "quantity must be an integer from 0 to"),
    (line(child_reserved("wf-h/sur", "S", {"tokens": 1})).replace('"child_id": "S"', '"child_id": "\\ud800"'),
     "not valid Unicode text: it holds a lone surrogate"),
    (line(child_reserved("wf-h/long", "L" * 300, {"tokens": 1})), "child_id must be non-empty, contain no NUL and "
                                                                  "take at most 200 bytes"),
    (line(child_reserved("wf-h/huge", "H", {"tokens": 2**64 + 5})), f"expected integer, got {2**64 + 5}"),
    (line(child_reserved("wf-h/deep", "Z", {"tokens": 1})).replace('{"tokens": 1}', "[" * 20_000 + "]" * 20_000),
     "nested too deeply"),
    (line({"type": "Tick", "event_id": "e-t", "idempotency_key": "tick/1", "parent_id": "", "occurred_at_ms": T,
           "now_ms": T}), TICK_NOT_PRODUCIBLE),
    (line(["ChildReserved", "wf-h"]), "expected a JSON object, got list"),
    (line("ParentClosed"), "expected a JSON object, got str"),
]


def jsonl(directory: Path) -> tuple[Path, dict[int, str]]:
    """Good and hostile lines interleaved, and a blank line (skipped, but counted in the line numbers); the
    hostile lines by their line number, with the reason each must get."""
    good, hostile = iter(GOOD.values()), iter(HOSTILE)
    lines: list[str] = []
    expected: dict[int, str] = {}
    for kind in "g_hhhghhhghhg":
        if kind == "h":
            text, reason = next(hostile)
            lines.append(text)
            expected[len(lines)] = reason
        else:
            lines.append(next(good) if kind == "g" else "")
    assert next(good, None) is None and next(hostile, None) is None
    path = directory / "hostile.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, expected


def settle(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "branch_settlement.processors.cli.main", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=300)


def test_produce_reports_each_hostile_line_and_publishes_the_good_ones(kafka_topics, tmp_path: Path) -> None:
    path, expected = jsonl(tmp_path)
    common = ("--topic-prefix", kafka_topics.prefix, "--bootstrap-servers", kafka_topics.bootstrap_servers)
    topic = kafka_topics.name("branch-events")
    partitions = kafka_topics.spec.topic("branch-events").partitions

    plain = settle("produce", str(path), *common)
    assert plain.returncode == 1, plain.stdout + plain.stderr
    assert "Traceback" not in plain.stdout + plain.stderr, plain.stderr[-3000:]
    assert plain.stdout == (f"published {len(GOOD)} events to {topic} ({partitions} partitions); "
                           f"{len(HOSTILE)} lines not sent\n")
    reported = [text for text in plain.stderr.splitlines() if ": not sent: " in text]
    assert len(reported) == len(HOSTILE), plain.stderr[-3000:]
    for number, reason in expected.items():
        [report] = [text for text in reported if text.startswith(f"line {number}: not sent: ")]
        assert reason in report, report

    as_json = settle("produce", str(path), *common, "--json")
    assert as_json.returncode == 1, as_json.stdout + as_json.stderr
    assert "Traceback" not in as_json.stdout + as_json.stderr, as_json.stderr[-3000:]
    document = json.loads(as_json.stdout)
    assert (document["topic"], document["partitions"], document["published"]) == (topic, partitions, len(GOOD))
    assert [refusal["line"] for refusal in document["not_sent"]] == sorted(expected)
    for refusal in document["not_sent"]:
        assert expected[refusal["line"]] in refusal["reason"], refusal

    # what reached the topic: the good events, once per run, and nothing of a refused line
    published = [event for records in read_partitions(kafka_topics.bootstrap_servers, topic).values()
                 for _, _, event in records]
    assert sorted(event["idempotency_key"] for event in published) == sorted([*GOOD, *GOOD])
    codec = default_codec()
    for event in published:  # each as its line says, field for field
        sent = codec.event_from_json(json.loads(GOOD[event["idempotency_key"]]))
        assert event == {field: value for field, value in sent.items() if field != "type"}
