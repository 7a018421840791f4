"""The stability watch against a real broker: another producer holds an open transaction on every partition of
settlement-results, so nothing the processor commits there is readable; the processor must say so (log,
gauge), go on, and say so again when the partition clears. The same view a hanging transaction would give a
downstream consumer (docs/faults.md, finding 2), without needing a broker crash to make one."""

from __future__ import annotations

import socket
import time
import urllib.request
from pathlib import Path

import pytest
from confluent_kafka import Producer

from tests.kafka.pipeline import ProcessorProcess, example_events, is_input_result, read_partitions
from tests.kafka.test_processor import produce_file

pytestmark = pytest.mark.kafka


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_line(proc: ProcessorProcess, needle: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = [line for line in proc.output().splitlines() if needle in line]
        if lines:
            return lines[0]
        assert proc.proc.poll() is None, proc.output()[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"no {needle!r} in {timeout_s:.0f} s:\n{proc.output()[-3000:]}")


def unreadable_gauges(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in body.splitlines()
            if line.startswith("settle_unreadable_partition{")}


def test_a_partition_held_by_another_transaction_is_reported_and_so_is_its_release(
        kafka_topics, tmp_path: Path, worked_example: Path) -> None:
    results = kafka_topics.name("settlement-results")
    holder = Producer({"bootstrap.servers": kafka_topics.bootstrap_servers,
                       "transactional.id": f"{kafka_topics.prefix}holder", "transaction.timeout.ms": 600_000})
    holder.init_transactions(30)
    holder.begin_transaction()
    for p in range(kafka_topics.spec.topic("settlement-results").partitions):
        holder.produce(results, value=b"held open", partition=p)
    assert holder.flush(30) == 0

    metrics_port = free_port()
    # Transaction timeout 5 s: the watch reports a partition held for 10 s (twice that), asking every 5 s.
    proc = ProcessorProcess(kafka_topics, tmp_path / "state", tmp_path / "run.log", slot="a", group="g",
                            extra_args=("--transaction-timeout-ms", "5000", "--metrics-port", str(metrics_port)))
    try:
        run = produce_file(kafka_topics, example_events(worked_example, tmp_path))
        assert run.returncode == 0, run.stderr
        alert = wait_for_line(proc, "IS NOT READABLE", 90)
        assert f"{results}[" in alert and "kafka-transactions.sh" in alert, alert
        held = alert.split(f"{results}[", 1)[1].split("]", 1)[0]
        gauges = unreadable_gauges(metrics_port)
        assert gauges[f'settle_unreadable_partition{{partition="{held}",topic="{results}"}}'] == 1.0, gauges
        assert read_partitions(kafka_topics.bootstrap_servers, results) == {}  # nothing readable past the hold

        holder.abort_transaction(30)
        cleared = wait_for_line(proc, "is readable again", 60)
        assert f"{results}[{held}] is readable again" in cleared, cleared
        assert unreadable_gauges(metrics_port)[
            f'settle_unreadable_partition{{partition="{held}",topic="{results}"}}'] == 0.0
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]
    committed = read_partitions(kafka_topics.bootstrap_servers, results)
    # every result of the example's events, none of the held ones
    assert sum(is_input_result(r) for records in committed.values() for _, _, r in records) == 13
