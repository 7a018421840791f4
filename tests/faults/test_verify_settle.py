"""The verifier's reads wait until no transaction is open (faults/verify.py settle): read_committed stops at a
partition's last stable offset, so a transaction left open would hide every commit after it from I2 and I8.
What it waited for is named; one never decided is reported as still open (and fails I5)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from faults.verify import open_transactions, settle, waited_for


@pytest.fixture
def admin(shared_bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": shared_bootstrap, "log_level": 0})


@pytest.fixture
def topic(admin: AdminClient):
    name = f"t.verify-settle.{uuid.uuid4().hex[:8]}"
    admin.create_topics([NewTopic(name, 2, 1)])[name].result(30)
    yield name
    admin.delete_topics([name])[name].result(30)


def _producer(bootstrap: str) -> Producer:
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"verify-settle-{uuid.uuid4().hex[:8]}",
                         "log_level": 0})
    producer.init_transactions(30)
    return producer


def _hold_open(producer: Producer, topic: str, partition: int) -> None:
    """A transaction begun with one record on `partition`, neither committed nor aborted."""
    producer.begin_transaction()
    producer.produce(topic, b"open", partition=partition)
    producer.flush(30)


@pytest.mark.kafka
def test_the_reads_wait_for_an_open_transaction_and_name_it(shared_bootstrap: str, admin: AdminClient,
                                                           topic: str) -> None:
    producer = _producer(shared_bootstrap)
    producer.begin_transaction()
    producer.produce(topic, b"committed", partition=0)
    producer.commit_transaction(30)
    # The commit returns once the coordinator has logged it; its markers follow (slowly on a broker just started),
    # and until then the partition's last stable offset is behind.
    deadline = time.monotonic() + 30
    while open_transactions(admin, [topic]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert open_transactions(admin, [topic]) == {}
    assert waited_for(settle(shared_bootstrap, [topic], timeout_s=30)) is None
    _hold_open(producer, topic, 1)
    held = open_transactions(admin, [topic])
    assert list(held) == [f"{topic}[1]"], held
    stable, end = held[f"{topic}[1]"]
    assert stable < end, held

    aborter = threading.Timer(2.0, producer.abort_transaction, args=(30,))
    aborter.start()
    began = time.monotonic()
    settled = settle(shared_bootstrap, [topic], timeout_s=30)
    aborter.join()
    assert time.monotonic() - began >= 1.5 and settled["waited_s"] >= 1.5, settled
    assert settled["open_at_start"] == {f"{topic}[1]": [stable, end]} and settled["still_open"] == {}, settled
    note = waited_for(settled)
    assert note is not None and f"{topic}[1]" in note and "still open" not in note, note
    assert open_transactions(admin, [topic]) == {}


@pytest.mark.kafka
def test_a_transaction_still_open_when_the_wait_ends_is_reported(shared_bootstrap: str, topic: str) -> None:
    producer = _producer(shared_bootstrap)
    _hold_open(producer, topic, 0)
    try:
        settled = settle(shared_bootstrap, [topic], timeout_s=1.0)
    finally:
        producer.abort_transaction(30)
    assert list(settled["still_open"]) == [f"{topic}[0]"], settled
    note = waited_for(settled)
    assert note is not None and f"still open after {settled['waited_s']} s" in note and f"{topic}[0]" in note, note
