"""The independent verifier. It trusts nothing the processors say about themselves: it reads what was
committed (read_committed), folds the committed input offline partition by partition (the same fold,
outside the exactly-once plumbing under test), and checks:

I1  no release_key appears twice; no child releases more than it reserved (per dimension);
I2  the releases committed equal the offline fold's, partition by partition, in order (and so do the results
    and dead letters: every input gets exactly one of them);
I3  the final ledger of the processor's projections (RocksDB, read-only), and the ledger rebuilt from the
    committed changelog, equal the offline fold's; every projection covers the whole input;
I4  the consumer that read (read_committed) while the faults happened saw no release_key and no input
    offset twice, and saw everything;
I5  no transaction is left open: a marker written transactionally at the end to every partition of every
    output topic and the changelog is readable with read_committed on each of them;
I6  a fenced zombie committed nothing (counted by the scenario: committed records before and after it
    resumed, and what its log says);
I7  SPEC §3 holds for every parent of the final projections: every term >= 0 and
    available + outstanding + pending + awaiting_confirmation + lent + returned_to_pool + committed
    == capacity + overdrawn.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections import Counter
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition

from faults.kafka_io import OUTPUT_TOPICS, Topics, read_partitions
from branch_settlement.processors.kafka.partition import input_position, store_path
from branch_settlement.processors.replay.replayer import Input, ledger_snapshot, replay
from branch_settlement.projections import model
from branch_settlement.projections.store import MemoryStore, RocksStore
from branch_settlement.schemas.codec import CodecError, default_codec

MARKER_TIMEOUT_S = 60.0
_offline_cache: dict[bytes, tuple] = {}


def _release(r: dict) -> tuple:
    return (r["release_key"], r["parent_id"], r["child_id"], r["dimension"], r["quantity"], r["destination"],
            r["input_offset"])


def _result(r: dict) -> tuple:
    return (r["event_id"], r["result"], r["input_offset"])


def fold_partition(records: list, partition: int) -> tuple:
    """(results, releases, ledger, dead letter offsets) of one input partition folded offline. Cached by the
    digest of its committed bytes: scenarios that publish the same stream share one fold."""
    digest = hashlib.blake2b(digest_size=20)
    for offset, _, value in records:
        digest.update(b"%d:%d:" % (offset, len(value or b"")))
        digest.update(value or b"")
    key = digest.digest() + bytes([partition])
    if key in _offline_cache:
        return _offline_cache[key]
    codec = default_codec()
    items = []
    for offset, _, value in records:
        try:
            items.append(Input(offset, codec.decode_event(value or b"")))
        except CodecError as exc:
            items.append(Input(offset, None, str(exc)))
    result, store = replay(items, codec=codec, partition=partition)
    folded = ([_result(r) for r in result.outputs.results], [_release(r) for r in result.outputs.releases],
              ledger_snapshot(store, codec), [letter["offset"] for letter in result.dead_letters])
    _offline_cache[key] = folded
    return folded


def changelog_ledgers(bootstrap: str, topic: str) -> dict[int, tuple[dict, int | None]]:
    """Each partition's ledger rebuilt from the committed changelog alone, with the input position it
    records."""
    codec = default_codec()
    ledgers = {}
    for partition, records in read_partitions(bootstrap, topic, decode=False).items():
        store = MemoryStore()
        store.write([(key, value) for _, key, value in records if key != b"__faults_marker__"], len(records) - 1)
        ledgers[partition] = (ledger_snapshot(store, codec), input_position(store))
    return ledgers


def projection_ledgers(state_dir: Path, group: str, partitions: int) -> dict[int, tuple[dict, int | None]]:
    codec = default_codec()
    ledgers = {}
    for partition in range(partitions):
        path = store_path(str(state_dir), group, partition)
        if not path.exists():
            continue
        store = RocksStore(path, read_only=True)
        try:
            ledgers[partition] = (ledger_snapshot(store, codec), input_position(store))
        finally:
            store.close()
    return ledgers


def invariant_violations(ledger: dict) -> list[str]:
    problems = []
    for parent_id, parent in ledger["parents"].items():
        for dim, b in parent["dimensions"].items():
            negative = [t for t in model.BALANCE_TERMS if b[t] < 0]
            held = sum(b[t] for t in model.HELD_TERMS)
            if negative or held != b["capacity"] + b["overdrawn"]:
                problems.append(f"{parent_id}/{dim}: {b}")
    return problems


def over_released(releases: list[tuple], ledger: dict) -> list[str]:
    totals: Counter = Counter()
    for key, parent_id, child_id, dim, quantity, _, _ in releases:
        if child_id:
            totals[(parent_id, child_id, dim)] += quantity
    problems = []
    for (parent_id, child_id, dim), released in totals.items():
        child = ledger["children"].get(f"{parent_id}/{child_id}")
        reserved = child["reserved"].get(dim, 0) if child else 0
        if released > reserved:
            problems.append(f"{parent_id}/{child_id}/{dim}: released {released} > reserved {reserved}")
    return problems


def _diff(want: list, got: list) -> tuple[int, int]:
    """(missing, extra) between two ordered lists, as multisets."""
    w, g = Counter(want), Counter(got)
    return sum((w - g).values()), sum((g - w).values())


def verify(topics: Topics, final_state: Path, group: str, reader=None, zombie: dict | None = None,
           write_marker: bool = True) -> dict:
    bootstrap = topics.bootstrap
    inputs = read_partitions(bootstrap, topics.name("branch-events"), decode=False)
    results = read_partitions(bootstrap, topics.name("settlement-results"))
    releases_topic = read_partitions(bootstrap, topics.name("capacity-releases"))
    dlq = read_partitions(bootstrap, topics.name("branch-events-dlq"))
    projections = projection_ledgers(final_state, group, topics.partitions)
    from_changelog = changelog_ledgers(bootstrap, topics.name("ledger-changelog"))

    counts = Counter()
    notes: list[str] = []
    all_got_releases: list[tuple] = []
    invariant_problems: list[str] = []
    child_problems: list[str] = []
    ledger_mismatch: list[str] = []
    for p in range(topics.partitions):
        want_results, want_releases, want_ledger, want_dead = fold_partition(inputs.get(p, []), p)
        got_results = [_result(r) for _, _, r in results.get(p, []) if isinstance(r, dict)]
        got_releases = [_release(r) for _, _, r in releases_topic.get(p, []) if isinstance(r, dict) and "release_key" in r]
        got_dead = [r["offset"] for _, _, r in dlq.get(p, []) if isinstance(r, dict)]
        all_got_releases.extend(got_releases)
        counts["input_records"] += len(inputs.get(p, []))
        counts["results_expected"] += len(want_results)
        counts["results_observed"] += len(got_results)
        counts["releases_expected"] += len(want_releases)
        counts["releases_observed"] += len(got_releases)
        counts["dead_letters_expected"] += len(want_dead)
        counts["dead_letters_observed"] += len(got_dead)
        for name, want, got in (("results", want_results, got_results), ("releases", want_releases, got_releases),
                                ("dead letters", want_dead, got_dead)):
            missing, extra = _diff(want, got)
            counts[f"{name.replace(' ', '_')}_missing"] += missing
            counts[f"{name.replace(' ', '_')}_extra"] += extra
            if want != got and not missing and not extra:
                counts[f"{name.replace(' ', '_')}_out_of_order"] += 1
            if want != got:
                notes.append(f"partition {p}: {name} differ from the offline fold ({missing} missing, {extra} extra)")
        counts["duplicate_results"] += sum(n - 1 for n in Counter(r[2] for r in got_results).values() if n > 1)
        end = inputs[p][-1][0] + 1 if inputs.get(p) else 0
        for source, ledgers in (("projection", projections), ("changelog", from_changelog)):
            ledger, position = ledgers.get(p, (None, None))
            if ledger is None and want_ledger["parents"]:
                ledger_mismatch.append(f"partition {p}: no {source} ledger")
            elif ledger is not None and ledger != want_ledger:
                ledger_mismatch.append(f"partition {p}: {source} ledger differs from the offline fold's")
            if ledger is not None and end and position != end:
                ledger_mismatch.append(f"partition {p}: {source} covers input offset {position}, input ends at {end}")
        if p in projections:
            invariant_problems += invariant_violations(projections[p][0])
        child_problems += over_released(got_releases, want_ledger)
    key_counts = Counter(r[0] for r in all_got_releases)
    counts["duplicate_releases"] = sum(n - 1 for n in key_counts.values() if n > 1)
    invariants = {
        "I1": {"ok": counts["duplicate_releases"] == 0 and not child_problems,
               "duplicate_release_keys": counts["duplicate_releases"], "children_over_released": child_problems[:5]},
        "I2": {"ok": not any(counts[k] for k in ("releases_missing", "releases_extra", "releases_out_of_order",
                                                  "results_missing", "results_extra", "results_out_of_order",
                                                  "dead_letters_missing", "dead_letters_extra",
                                                  "dead_letters_out_of_order")),
               "releases_expected": counts["releases_expected"], "releases_observed": counts["releases_observed"],
               "results_expected": counts["results_expected"], "results_observed": counts["results_observed"]},
        "I3": {"ok": not ledger_mismatch, "mismatches": ledger_mismatch[:10],
               "partitions_compared": sorted(projections)},
        "I7": {"ok": not invariant_problems, "violations": invariant_problems[:10],
               "parents": sum(len(l["parents"]) for l, _ in projections.values())},
    }
    if reader is not None:
        invariants["I4"] = check_reader(reader, counts["results_expected"], counts["releases_expected"])
    if zombie is not None:
        invariants["I6"] = zombie
    if write_marker:
        invariants["I5"] = check_no_open_transaction(topics)
    open_transactions = 0 if invariants.get("I5", {"ok": True})["ok"] else len(invariants["I5"]["unreadable"])
    summary = {
        "releases_expected": counts["releases_expected"],
        "releases_observed": counts["releases_observed"],
        "results_expected": counts["results_expected"],
        "results_observed": counts["results_observed"],
        "dead_letters": counts["dead_letters_observed"],
        "duplicates": counts["duplicate_releases"] + counts["duplicate_results"] + counts["releases_extra"]
        + counts["results_extra"] + counts["dead_letters_extra"]
        + (invariants.get("I4", {}).get("duplicates_seen", 0)),
        "missing": counts["releases_missing"] + counts["results_missing"] + counts["dead_letters_missing"],
        "mismatches": len(ledger_mismatch) + counts["releases_out_of_order"] + counts["results_out_of_order"]
        + counts["dead_letters_out_of_order"] + len(child_problems) + len(invariant_problems),
        "open_transactions": open_transactions,
    }
    return {"ok": all(v["ok"] for v in invariants.values()), "summary": summary, "invariants": invariants,
            "notes": notes[:20]}


def check_reader(reader, results_expected: int, releases_expected: int, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while (reader.results < results_expected or reader.releases < releases_expected) and time.monotonic() < deadline:
        time.sleep(0.2)
    dups = len(reader.duplicate_releases) + len(reader.duplicate_results)
    return {"ok": dups == 0 and reader.results == results_expected and reader.releases == releases_expected,
            "duplicates_seen": dups, "results_seen": reader.results, "releases_seen": reader.releases,
            "refetched_after_reconnect": reader.refetched,
            "examples": (reader.duplicate_releases[:3] + [str(d) for d in reader.duplicate_results[:3]])}


def check_no_open_transaction(topics: Topics) -> dict:
    """I5: a fresh transactional producer commits a marker to every partition of every output topic and
    the changelog; each must become readable (read_committed) past every earlier record. A transaction left
    open before it would hold the last stable offset back and keep the marker invisible. Run last: the
    markers are not events (the topics are deleted afterwards)."""
    bootstrap = topics.bootstrap
    names = [topics.name(t) for t in (*OUTPUT_TOPICS, "ledger-changelog")]
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"faults-marker-{uuid.uuid4().hex[:8]}",
                         "enable.idempotence": True, "acks": "all", "log_level": 0})
    producer.init_transactions(30)
    producer.begin_transaction()
    marker = f"faults-marker-{uuid.uuid4().hex}".encode()
    offsets: dict[tuple[str, int], int] = {}

    def delivered(err, msg) -> None:
        if err is None:
            offsets[(msg.topic(), msg.partition())] = msg.offset()

    for name in names:
        for p in range(topics.partitions):
            producer.produce(name, key=b"__faults_marker__", value=marker, partition=p, on_delivery=delivered)
    producer.flush(30)
    producer.commit_transaction(30)
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"faults-i5-{uuid.uuid4().hex[:6]}",
                         "enable.auto.commit": False, "isolation.level": "read_committed", "log_level": 0})
    pending = set(offsets)
    try:
        consumer.assign([TopicPartition(t, p, offset) for (t, p), offset in offsets.items()])
        deadline = time.monotonic() + MARKER_TIMEOUT_S
        while pending and time.monotonic() < deadline:
            for message in consumer.consume(num_messages=1000, timeout=0.5):
                if message.error() is None and message.value() == marker:
                    pending.discard((message.topic(), message.partition()))
    finally:
        consumer.close()
    return {"ok": not pending and len(offsets) == len(names) * topics.partitions,
            "partitions_checked": len(offsets), "unreadable": sorted(f"{t}[{p}]" for t, p in pending)}
