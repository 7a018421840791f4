"""`settle run` end to end against the real broker: exactly once through duplicates, kill -9, crash points,
rebalances, a zombie and a deleted projection. Every test compares what the processors committed with the
committed input folded offline, partition by partition."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka import Producer

from branch_settlement.processors.kafka import demo
from branch_settlement.processors.kafka.clients import BranchEventProducer
from branch_settlement.processors.ledger.validation import validate
from branch_settlement.processors.replay.replayer import read_jsonl
from branch_settlement.processors.kafka.partition import INPUT_POSITION_KEY, input_position
from branch_settlement.processors.workload import write_jsonl
from branch_settlement.projections import keys
from branch_settlement.projections.store import RocksStore
from branch_settlement.schemas.codec import default_codec
from branch_settlement.processors.kafka.partition import store_path
from tests.kafka.pipeline import (REPO, ProcessorProcess, count_input_results, count_records, non_empty, offline,
                                  projection_ledgers, published, read_partitions, wait_for_results)

pytestmark = pytest.mark.kafka

GARBAGE = [b"not avro at all", b"\xc3\x01" + b"\x00" * 8 + b"unknown fingerprint", b""]


def produce_file(kafka_topics, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "branch_settlement.processors.cli.main", "produce", str(path), "--bootstrap-servers",
                           kafka_topics.bootstrap_servers, "--topic-prefix", kafka_topics.prefix],
                          capture_output=True, text=True, cwd=REPO, timeout=300)


def publish_garbage(kafka_topics) -> None:
    """The undecodable records (GARBAGE) onto the input topic."""
    producer = Producer({"bootstrap.servers": kafka_topics.bootstrap_servers})
    for i, raw in enumerate(GARBAGE):
        producer.produce(kafka_topics.name("branch-events"), value=raw, key=f"garbage-{i}".encode())
    assert producer.flush(30) == 0


def produce_workload(kafka_topics, tmp_path: Path, events: int, seed: int) -> int:
    """Publish a seeded workload (5% duplicate deliveries) plus undecodable records; return how many input
    records the processors will fold into results."""
    path = tmp_path / "workload.jsonl"
    write_jsonl(str(path), seed, events)
    run = produce_file(kafka_topics, path)
    assert run.returncode in (0, 1), run.stderr  # 1: the workload's malformed lines were refused, as they must be
    assert "published" in run.stdout
    publish_garbage(kafka_topics)
    total = count_records(kafka_topics.bootstrap_servers, kafka_topics.name("branch-events"))
    return total - len(GARBAGE)


def assert_exactly_once(kafka_topics) -> None:
    bootstrap = kafka_topics.bootstrap_servers
    want_results, want_releases, _, want_dead = offline(bootstrap, kafka_topics)
    got_results, got_releases, got_dead = published(bootstrap, kafka_topics)
    keys = [r[0] for recs in got_releases.values() for r in recs]
    assert len(keys) == len(set(keys)), "a release was published twice"
    assert non_empty(got_results) == non_empty(want_results)
    assert non_empty(got_releases) == non_empty(want_releases)
    assert non_empty(got_dead) == non_empty(want_dead)


def assert_ledgers_match(kafka_topics, state_dirs: list[Path], group: str = "g") -> None:
    """The projections the processors left (any instance's, newest wins per partition) equal the offline fold."""
    got = {}
    for state in state_dirs:
        for p, ledger in projection_ledgers(state, group).items():
            if ledger["parents"]:
                got.setdefault(p, []).append(ledger)
    want = {p: l for p, l in offline(kafka_topics.bootstrap_servers, kafka_topics)[2].items() if l["parents"]}
    assert set(got) == set(want)
    for p, ledgers in got.items():
        assert want[p] in ledgers, f"partition {p}: no projection equals the offline ledger"


def test_worked_example_end_to_end(kafka_topics, tmp_path: Path, worked_example: Path) -> None:
    """The worked example through the pipeline. Its two Tick lines are ledger time, which only the processor
    makes: they move the processor's clock file (demo.play), once what comes before them is folded."""
    clock = tmp_path / "clock"
    proc = ProcessorProcess(kafka_topics, tmp_path / "state", tmp_path / "run.log", slot="a", group="g",
                            extra_args=("--clock-file", str(clock), "--tick-interval-ms", "1"))
    partitions = kafka_topics.spec.topic("branch-events").partitions
    bootstrap = kafka_topics.bootstrap_servers

    def produce(path: Path) -> None:
        run = produce_file(kafka_topics, path)
        assert run.returncode == 0, run.stderr
        assert run.stdout.startswith("published "), run.stdout

    def committed() -> list[dict]:
        return [r for recs in read_partitions(bootstrap, kafka_topics.name("settlement-results")).values()
                for _, _, r in recs]

    try:
        assert demo.play(worked_example, tmp_path, clock, produce, committed, partitions) == 13
        wait_for_results(bootstrap, kafka_topics, 13, 90, [proc])
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]
    ticks = [r for r in committed() if r["event_type"] == "Tick"]
    assert sorted((r["input_partition"], r["ledger_time_ms"], r["result"]) for r in ticks) == sorted(
        (p, now, "ok") for p in range(partitions) for now in (1764410400000, 1764410461000))
    results = [r for recs in read_partitions(bootstrap, kafka_topics.name("settlement-results")).values()
               for _, _, r in recs if r["parent_id"] == "wf-42"]
    assert {r["event_id"]: r["result"] for r in results} == {
        **{f"we-{i:02d}": "ok" for i in range(2, 13)}, "we-dup": "duplicate", "we-14": "ok"}
    releases = [(r["child_id"], r["quantity"], r["destination"])
                for recs in read_partitions(bootstrap, kafka_topics.name("capacity-releases")).values()
                for _, _, r in recs]
    assert releases == [("B", 8, "parent"), ("C", 20, "parent"), ("D", 15, "parent")]
    [ledger] = [led for led in projection_ledgers(tmp_path / "state", "g").values() if led["parents"]]
    tokens = ledger["parents"]["wf-42"]["dimensions"]["tokens"]
    assert (tokens["committed"], tokens["outstanding"], tokens["pending"], tokens["available"]) == (37, 0, 0, 63)
    inspect = subprocess.run([sys.executable, "-m", "branch_settlement.processors.cli.main", "inspect", "wf-42", "--state-dir",
                              str(tmp_path / "state"), "--group-id", "g"], capture_output=True, text=True, cwd=REPO)
    assert inspect.returncode == 0 and "wf-42 (open)" in inspect.stdout, inspect.stderr
    assert_exactly_once(kafka_topics)


def test_workload_with_duplicates_matches_the_offline_fold(kafka_topics, tmp_path: Path) -> None:
    expected = produce_workload(kafka_topics, tmp_path, 20_000, seed=11)
    proc = ProcessorProcess(kafka_topics, tmp_path / "state", tmp_path / "run.log", slot="a", group="g")
    try:
        wait_for_results(kafka_topics.bootstrap_servers, kafka_topics, expected, 300, [proc])
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]
    assert_exactly_once(kafka_topics)
    want_ledgers = offline(kafka_topics.bootstrap_servers, kafka_topics)[2]
    got_ledgers = projection_ledgers(tmp_path / "state", "g")
    assert {p: l for p, l in got_ledgers.items() if l["parents"]} == {p: l for p, l in want_ledgers.items()
                                                                      if l["parents"]}


def test_checkpoints_by_buffered_records(kafka_topics, tmp_path: Path) -> None:
    """With the event count out of reach and a long interval (which commits the tail), the buffered records
    (outputs and ledger changes) trigger the checkpoints while the backlog lasts, mid-batch too: small
    transactions, the same outputs."""
    expected = produce_workload(kafka_topics, tmp_path, 3_000, seed=18)
    proc = ProcessorProcess(kafka_topics, tmp_path / "state", tmp_path / "run.log", slot="a", group="g",
                            extra_args=("--commit-interval-ms", "5000", "--commit-events", "1000000",
                                        "--commit-records", "300", "--log-level", "DEBUG"))
    try:
        wait_for_results(kafka_topics.bootstrap_servers, kafka_topics, expected, 300, [proc])
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]
    events = [int(n) for n in re.findall(r"checkpoint committed: (\d+) events", proc.output())]
    # Checked after each event and each consume batch (at most 500 records): without the trigger, a checkpoint
    # would take everything of 5 s, the whole backlog.
    assert len(events) >= 5 and max(events) <= 500, events
    assert_exactly_once(kafka_topics)


def wait_assigned(proc: ProcessorProcess, log: Path, since: int, timeout_s: float = 120) -> None:
    """Until the processor started when `log` had `since` bytes owns its partitions: its restore is done, so its
    projections are as current as the changelog (an earlier instance killed between a commit and its RocksDB
    batch leaves them behind it)."""
    deadline = time.monotonic() + timeout_s
    while not log.exists() or b"assigned partitions" not in log.read_bytes()[since:]:
        assert time.monotonic() < deadline and proc.proc.poll() is None, proc.output()[-3000:]
        time.sleep(0.2)


class PacedPublisher(threading.Thread):
    """A seeded workload published as an orchestrator would, `rate` events a second (the lines `settle produce`
    sends: valid, and not a Tick), then the undecodable records: the stream still arrives while processors are killed.
    `sent`: how many so far; `total`: how many input records the processors will fold once it is done."""

    def __init__(self, kafka_topics, tmp_path: Path, events: int, seed: int, rate: int) -> None:
        super().__init__(daemon=True)
        path = tmp_path / "workload.jsonl"
        write_jsonl(str(path), seed, events)
        codec = default_codec()
        self.events = [item.event for item in read_jsonl(path, codec)
                       if item.event is not None and validate(item.event) is None and item.event["type"] != "Tick"]
        self.producer = BranchEventProducer({"bootstrap.servers": kafka_topics.bootstrap_servers},
                                            kafka_topics.name("branch-events"), codec)
        self.kafka_topics, self.rate, self.sent, self.error = kafka_topics, rate, 0, None
        self.total = len(self.events)

    def run(self) -> None:
        try:
            began, step = time.monotonic(), max(1, self.rate // 20)
            for start in range(0, len(self.events), step):
                for event in self.events[start:start + step]:
                    self.producer.publish(event)
                self.producer.flush()
                self.sent = min(start + step, len(self.events))
                time.sleep(max(0.0, began + self.sent / self.rate - time.monotonic()))
            publish_garbage(self.kafka_topics)
        except BaseException as exc:  # the test reads it when it joins
            self.error = exc

    def finish(self, timeout_s: float = 120) -> int:
        """Wait until everything is published; the input records the processors will fold."""
        self.join(timeout_s)
        assert not self.is_alive(), "the paced publisher did not finish"
        if self.error is not None:
            raise self.error
        total = count_records(self.kafka_topics.bootstrap_servers, self.kafka_topics.name("branch-events"))
        assert total == self.total + len(GARBAGE)
        return self.total


def test_kill_9_mid_stream_loses_nothing_and_repeats_nothing(kafka_topics, tmp_path: Path) -> None:
    """Three processors killed with SIGKILL, each once it has committed work of its own while the input still
    arrives (paced: on an input published at once, a processor folds it all in a second or two, before a kill
    comes), then a last one finishes the stream."""
    publisher = PacedPublisher(kafka_topics, tmp_path, 20_000, seed=12, rate=500)
    log = tmp_path / "run.log"
    publisher.start()
    for _ in range(3):
        since = log.stat().st_size if log.exists() else 0
        proc = ProcessorProcess(kafka_topics, tmp_path / "state", log, slot="a", group="g")
        wait_assigned(proc, log, since)
        before = count_input_results(kafka_topics.bootstrap_servers, kafka_topics)
        wait_for_results(kafka_topics.bootstrap_servers, kafka_topics, before + 800, 300, [proc])
        proc.kill()
        # mid-stream: the processor had work still coming (else this test would only kill idle processors)
        assert publisher.is_alive() and publisher.sent < publisher.total, (publisher.sent, publisher.error)
    since = log.stat().st_size
    proc = ProcessorProcess(kafka_topics, tmp_path / "state", log, slot="a", group="g")
    try:
        expected = publisher.finish()
        wait_for_results(kafka_topics.bootstrap_servers, kafka_topics, expected, 300, [proc])
        wait_assigned(proc, log, since)  # its restore done: the projections as current as the changelog
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]
    assert_exactly_once(kafka_topics)
    assert_ledgers_match(kafka_topics, [tmp_path / "state"])


@pytest.mark.parametrize("point", ["after_produce:4", "after_send_offsets:4", "after_commit:4"])
def test_crash_at_each_step_of_the_commit_sequence(kafka_topics, tmp_path: Path, point: str) -> None:
    expected = produce_workload(kafka_topics, tmp_path, 4_000, seed=13)
    log = tmp_path / "run.log"
    crashing = ProcessorProcess(kafka_topics, tmp_path / "state", log, slot="a", group="g",
                                extra_env={"SETTLE_CRASH_AT": point}, extra_args=("--commit-events", "200"))
    assert crashing.wait(120) == 137, crashing.output()[-3000:]
    assert f"crash point {point.split(':')[0]} reached" in crashing.output()
    proc = ProcessorProcess(kafka_topics, tmp_path / "state", log, slot="a", group="g")
    try:
        wait_for_results(kafka_topics.bootstrap_servers, kafka_topics, expected, 300, [proc])
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]
    assert_exactly_once(kafka_topics)
    assert_ledgers_match(kafka_topics, [tmp_path / "state"])


def test_two_instances_with_one_bounced(kafka_topics, tmp_path: Path) -> None:
    expected = produce_workload(kafka_topics, tmp_path, 20_000, seed=14)
    a = ProcessorProcess(kafka_topics, tmp_path / "a", tmp_path / "a.log", slot="a", group="g")
    b = ProcessorProcess(kafka_topics, tmp_path / "b", tmp_path / "b.log", slot="b", group="g")
    try:
        wait_for_results(kafka_topics.bootstrap_servers, kafka_topics, int(expected * 0.3), 300, [a, b])
        assert b.stop() == 0, b.output()[-3000:]
        wait_for_results(kafka_topics.bootstrap_servers, kafka_topics, int(expected * 0.6), 300, [a])
        b = ProcessorProcess(kafka_topics, tmp_path / "b", tmp_path / "b.log", slot="b", group="g")
        wait_for_results(kafka_topics.bootstrap_servers, kafka_topics, expected, 300, [a, b])
    finally:
        assert b.stop() == 0, b.output()[-3000:]
        assert a.stop() == 0, a.output()[-3000:]
    assert "revoked partitions" in a.output()
    assert_exactly_once(kafka_topics)
    assert_ledgers_match(kafka_topics, [tmp_path / "a", tmp_path / "b"])


def process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_zombie_commits_nothing(kafka_topics, tmp_path: Path) -> None:
    """The zombie stops itself holding a checkpoint's worth of folded, produced, uncommitted work, just
    before it would send its offsets; another instance takes over; then the zombie resumes and tries."""
    expected = produce_workload(kafka_topics, tmp_path, 10_000, seed=15)
    zombie = ProcessorProcess(kafka_topics, tmp_path / "a", tmp_path / "a.log", slot="a", group="g",
                              extra_env={"SETTLE_PAUSE_AT": "before_send_offsets:5"},
                              extra_args=("--transaction-timeout-ms", "10000", "--commit-events", "300"))
    successor = None
    try:
        deadline = time.monotonic() + 120
        while process_state(zombie.proc.pid) != "T":
            assert time.monotonic() < deadline and zombie.proc.poll() is None, zombie.output()[-3000:]
            time.sleep(0.2)
        before = count_input_results(kafka_topics.bootstrap_servers, kafka_topics)
        assert before < expected
        successor = ProcessorProcess(kafka_topics, tmp_path / "b", tmp_path / "b.log", slot="b", group="g")
        wait_for_results(kafka_topics.bootstrap_servers, kafka_topics, expected, 300, [successor])
        zombie.signal(signal.SIGCONT)
        deadline = time.monotonic() + 60
        while not any(s in zombie.output() for s in ("checkpoint aborted", "fenced", "lost partitions")):
            assert time.monotonic() < deadline, zombie.output()[-3000:]
            time.sleep(0.5)
        time.sleep(3)
        assert count_input_results(kafka_topics.bootstrap_servers, kafka_topics) == expected
    finally:
        zombie.signal(signal.SIGCONT)
        if successor is not None:
            assert successor.stop() == 0, successor.output()[-3000:]
        zombie.stop()
    assert "pause point before_send_offsets reached" in zombie.output()
    assert_exactly_once(kafka_topics)


def process_workload(kafka_topics, tmp_path: Path, events: int, seed: int) -> Path:
    """One processor through a seeded workload to its end; its state directory."""
    expected = produce_workload(kafka_topics, tmp_path, events, seed=seed)
    state = tmp_path / "state"
    proc = ProcessorProcess(kafka_topics, state, tmp_path / "run.log", slot="a", group="g")
    try:
        wait_for_results(kafka_topics.bootstrap_servers, kafka_topics, expected, 300, [proc])
    finally:
        assert proc.stop() == 0
    return state


def restart_until_assigned(kafka_topics, state: Path, log_path: Path) -> str:
    """A processor started on `state`, stopped once its restore is done and it owns partitions; its log."""
    since = log_path.stat().st_size if log_path.exists() else 0
    proc = ProcessorProcess(kafka_topics, state, log_path, slot="a", group="g")
    try:
        wait_assigned(proc, log_path, since)
    finally:
        assert proc.stop() == 0
    return proc.output()


def test_a_deleted_projection_is_restored_from_the_changelog(kafka_topics, tmp_path: Path) -> None:
    state = process_workload(kafka_topics, tmp_path, 5_000, seed=16)
    before = projection_ledgers(state, "g")
    shutil.rmtree(state)
    log = restart_until_assigned(kafka_topics, state, tmp_path / "run2.log")
    applied = [int(n) for n in re.findall(r"restored: (\d+) changelog records applied", log)]
    assert sum(applied) > 0, log[-3000:]
    assert projection_ledgers(state, "g") == before
    want = offline(kafka_topics.bootstrap_servers, kafka_topics)[2]
    assert {p: l for p, l in before.items() if l["parents"]} == {p: l for p, l in want.items() if l["parents"]}


def test_a_projection_ahead_of_the_committed_offsets_is_rebuilt(kafka_topics, tmp_path: Path) -> None:
    """What a broker that loses an acknowledged commit in an unclean restart leaves behind (docs/faults.md,
    finding 2): a projection written after the commit, while the changelog and the offsets were rolled back.
    The processor rebuilds it from the changelog by itself, and nothing is published twice."""
    state = process_workload(kafka_topics, tmp_path, 3_000, seed=17)
    before = projection_ledgers(state, "g")
    partition = next(p for p, ledger in sorted(before.items()) if ledger["parents"])
    store = RocksStore(store_path(str(state), "g", partition))
    try:  # the lost transaction's batch: a parent changed, the input position moved on
        parent_key = next(key for key, _ in store.scan(keys.prefix(keys.PARENT)))
        ahead = input_position(store) + 500
        store.write([(parent_key, None), (INPUT_POSITION_KEY, b"%d" % ahead)], store.changelog_offset() + 7)
    finally:
        store.close()
    assert projection_ledgers(state, "g")[partition] != before[partition]

    log = restart_until_assigned(kafka_topics, state, tmp_path / "run2.log")
    assert f"partition {partition}: the projection covers input offset {ahead}, beyond the committed" in log, log[-3000:]
    assert "rebuilding" in log
    assert projection_ledgers(state, "g") == before
    assert_exactly_once(kafka_topics)
