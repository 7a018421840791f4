"""The independent verifier. It trusts nothing the processors say about themselves: it reads what was
committed (read_committed), folds the committed input offline partition by partition (the same fold,
outside the exactly-once plumbing under test), with the processors' committed ticks (ledger-ticks) merged
back in where they were folded (each before the first input at or past its anchor: what the processor
folded) and the input topic's partition count (an event is folded only in its parent's partition), and
checks:

I1  no release_key appears twice; no child releases more than it reserved (per dimension);
I2  the releases committed equal the offline fold's, partition by partition, in order (and so do the results
    and dead letters: every input gets exactly one of them);
I3  the final ledger of the processor's projections (RocksDB, read-only), and the ledger rebuilt from the
    committed changelog, equal the offline fold's; every projection covers the whole input;
I4  the consumer that read (read_committed) while the faults happened saw no release_key and no input
    offset twice, and saw everything;
I5  no transaction is left open: a marker written transactionally at the end to every partition of every
    output topic and the changelog is readable with read_committed on each of them. Before that, the reads wait
    for every transaction to be decided (read_committed stops at the last stable offset: an open transaction
    would hide every later commit from I2 and I8): what they waited for, and how long, is in I5 and the notes,
    and one still open after SETTLE_TIMEOUT_S fails I5;
I6  a fenced zombie committed nothing (counted by the scenario: committed records before and after it
    resumed, and what its log says);
I7  SPEC §3 holds for every parent of the final projections: every term >= 0 and
    available + outstanding + pending + awaiting_confirmation + lent + returned_to_pool + committed
    == capacity + overdrawn;
I8  every ledger-ticks record was committed once: each is a Tick keyed by an input offset, the anchors of a
    partition never decrease nor pass its input's end, no tick idempotency key appears twice, and every
    tick has exactly one result on settlement-results, in the partition and at the offset it was folded
    before, in the order of ledger-ticks (and no tick result is without its tick).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import Consumer, IsolationLevel, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from faults.kafka_io import OUTPUT_TOPICS, TICKS_TOPIC, Topics, is_processor_tick, read_partitions
from branch_settlement.processors.crosscheck.readers import tick_input
from branch_settlement.processors.kafka.partition import input_position, store_path
from branch_settlement.processors.replay.replayer import Input, ledger_snapshot, merge_ticks, replay
from branch_settlement.projections import model
from branch_settlement.projections.store import MemoryStore, RocksStore
from branch_settlement.schemas.codec import CodecError, default_codec

MARKER_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 90.0  # beyond the scenarios' transaction.timeout.ms (30 s) and the broker's abort of it
LEASE_EXPIRY_NOTE = "reconciling after lease expiry"  # the audit note of a child whose lease ran out
_offline_cache: dict[bytes, "Folded"] = {}


def _release(r: dict) -> tuple:
    return (r["release_key"], r["parent_id"], r["child_id"], r["dimension"], r["quantity"], r["destination"],
            r["input_offset"])


def _result(r: dict) -> tuple:
    return (r["event_id"], r["result"], r["input_offset"])


@dataclass
class Folded:
    """One input partition folded offline, with its committed ticks merged in."""

    results: list  # _result tuples, inputs' and ticks' in fold order
    input_results: list  # the inputs' only
    tick_results: list  # (event_id, idempotency key, input offset) of each tick's result, in order
    releases: list
    ledger: dict
    dead_letters: list  # input offsets
    lease_expiries: int  # children sent to reconciliation by an expired lease


def fold_partition(records: list, ticks: list, partition: int, partitions: int) -> Folded:
    """One input partition folded offline: its committed `records` (offset, key, value) with its committed
    `ticks` (ledger-ticks records) merged in at their anchors, as one partition of `partitions`. Cached by
    the digest of the bytes of both: scenarios that commit the same input and ticks share one fold."""
    digest = hashlib.blake2b(digest_size=20)
    for source in (records, ticks):
        digest.update(b"|")
        for offset, key, value in source:
            digest.update(b"%d:%d:%d:" % (offset, len(key or b""), len(value or b"")))
            digest.update(key or b"")
            digest.update(value or b"")
    cache_key = digest.digest() + bytes([partition, partitions])
    if cache_key in _offline_cache:
        return _offline_cache[cache_key]
    codec = default_codec()
    items = []
    for offset, _, value in records:
        try:
            items.append(Input(offset, codec.decode_event(value or b"")))
        except CodecError as exc:
            items.append(Input(offset, None, str(exc)))
    end = records[-1][0] + 1 if records else 0
    merged = merge_ticks(items, [tick_input(codec, offset, key, value) for offset, key, value in ticks], end)
    result, store = replay(merged, codec=codec, partition=partition, partitions=partitions)
    out = result.outputs
    folded = Folded(results=[_result(r) for r in out.results],
                    input_results=[_result(r) for r in out.results if not is_processor_tick(r)],
                    tick_results=[(r["event_id"], r["idempotency_key"], r["input_offset"]) for r in out.results
                                  if is_processor_tick(r)],
                    releases=[_release(r) for r in out.releases], ledger=ledger_snapshot(store, codec),
                    dead_letters=[letter["offset"] for letter in result.dead_letters],
                    lease_expiries=sum(1 for a in out.audits if a["note"] == LEASE_EXPIRY_NOTE))
    _offline_cache[cache_key] = folded
    return folded


def check_ticks(ticks: dict[int, list], results: dict[int, list], input_ends: dict[int, int]) -> dict:
    """I8 over the committed ledger-ticks records (offset, key, raw value) and the decoded committed results
    of each partition."""
    codec = default_codec()
    problems: list[str] = []
    keys: Counter = Counter()
    committed = 0
    for p in sorted(set(ticks) | set(results)):
        previous = 0
        want = []
        at = {}  # each tick's offset on ledger-ticks, to name the ones without a result
        for offset, key, value in ticks.get(p, []):
            committed += 1
            item = tick_input(codec, offset, key, value)
            if item.event is None:
                problems.append(f"partition {p}: {item.reason}")
                continue
            if item.offset < previous:
                problems.append(f"partition {p}: the tick at ledger-ticks offset {offset} is anchored at input "
                                f"offset {item.offset}, before the previous tick's {previous}")
            if item.offset > input_ends.get(p, 0):
                problems.append(f"partition {p}: the tick at ledger-ticks offset {offset} is anchored at input "
                                f"offset {item.offset}, past the input's end {input_ends.get(p, 0)}")
            previous = max(previous, item.offset)
            keys[item.event["idempotency_key"]] += 1
            want.append((item.event["event_id"], item.event["idempotency_key"], item.offset))
            at[want[-1]] = offset
        got = [(r["event_id"], r["idempotency_key"], r["input_offset"]) for _, _, r in results.get(p, [])
               if isinstance(r, dict) and is_processor_tick(r)]
        if got != want:
            missing, extra = _diff(want, got)
            problems.append(f"partition {p}: {len(want)} ticks on ledger-ticks, {len(got)} tick results on "
                            f"settlement-results ({missing} without a result, {extra} without a tick"
                            + (", out of order" if not missing and not extra else "") + ")"
                            + (f"; without a result: ledger-ticks offsets "
                               f"{sorted(at[w] for w in set(want) - set(got))[:10]}" if missing else ""))
    twice = sorted(k for k, n in keys.items() if n > 1)
    if twice:
        problems.append(f"{len(twice)} tick idempotency keys committed more than once, e.g. {twice[:3]}")
    return {"ok": not problems, "ticks_committed": committed, "problems": problems[:10]}


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


def open_transactions(admin: AdminClient, names: list[str]) -> dict[str, tuple[int, int]]:
    """The partitions of these topics with a transaction open now: "topic[p]" -> (last stable offset, end): the
    latest offset read_committed and read_uncommitted (ListOffsets, as the processor's stability watch asks)."""
    topics = admin.list_topics(timeout=30).topics
    request = {TopicPartition(name, p): OffsetSpec.latest() for name in names for p in topics[name].partitions}

    def latest(level: IsolationLevel) -> dict[str, int]:
        futures = admin.list_offsets(request, isolation_level=level, request_timeout=30)
        return {f"{tp.topic}[{tp.partition}]": future.result().offset for tp, future in futures.items()}

    ends, stable = latest(IsolationLevel.READ_UNCOMMITTED), latest(IsolationLevel.READ_COMMITTED)
    return {tp: (stable[tp], end) for tp, end in ends.items() if stable[tp] < end}


def settle(bootstrap: str, names: list[str], timeout_s: float = SETTLE_TIMEOUT_S) -> dict:
    """Wait until no transaction is open on these topics (or `timeout_s`): what was open when it began, for how
    long, and what still is."""
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    began = time.monotonic()
    first = still = open_transactions(admin, names)
    while still and time.monotonic() - began < timeout_s:
        time.sleep(0.5)
        still = open_transactions(admin, names)
    return {"open_at_start": {tp: list(v) for tp, v in sorted(first.items())},
            "waited_s": round(time.monotonic() - began, 1),
            "still_open": {tp: list(v) for tp, v in sorted(still.items())}}


def waited_for(settled: dict) -> str | None:
    """What `settle` found, in words: None where nothing was open when the verification began."""
    if not settled["open_at_start"]:
        return None
    return (f"the verification waited {settled['waited_s']} s for transactions open when it began, every processor "
            f"stopped (topic[partition]: [last stable offset, end]): {settled['open_at_start']}"
            + (f"; still open after {settled['waited_s']} s: {settled['still_open']}" if settled["still_open"] else ""))


def verify(topics: Topics, final_state: Path, group: str, reader=None, zombie: dict | None = None,
           write_marker: bool = True) -> dict:
    bootstrap = topics.bootstrap
    settled = settle(bootstrap, [topics.name(t) for t in (*OUTPUT_TOPICS, "ledger-changelog", TICKS_TOPIC)])
    inputs = read_partitions(bootstrap, topics.name("branch-events"), decode=False)
    ticks = read_partitions(bootstrap, topics.name(TICKS_TOPIC), decode=False)
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
    input_ends: dict[int, int] = {}
    for p in range(topics.partitions):
        want = fold_partition(inputs.get(p, []), ticks.get(p, []), p, topics.partitions)
        got_all = [r for _, _, r in results.get(p, []) if isinstance(r, dict)]
        got_results = [_result(r) for r in got_all]
        got_input_results = [_result(r) for r in got_all if not is_processor_tick(r)]
        got_releases = [_release(r) for _, _, r in releases_topic.get(p, []) if isinstance(r, dict) and "release_key" in r]
        got_dead = [r["offset"] for _, _, r in dlq.get(p, []) if isinstance(r, dict)]
        all_got_releases.extend(got_releases)
        counts["input_records"] += len(inputs.get(p, []))
        counts["results_expected"] += len(want.input_results)
        counts["results_observed"] += len(got_input_results)
        counts["tick_results_expected"] += len(want.tick_results)
        counts["tick_results_observed"] += len(got_all) - len(got_input_results)
        counts["releases_expected"] += len(want.releases)
        counts["releases_observed"] += len(got_releases)
        counts["dead_letters_expected"] += len(want.dead_letters)
        counts["dead_letters_observed"] += len(got_dead)
        counts["lease_expiries"] += want.lease_expiries
        # The results compared together, the ticks' among the inputs' where they were folded.
        for name, want_list, got in (("results", want.results, got_results), ("releases", want.releases, got_releases),
                                     ("dead letters", want.dead_letters, got_dead)):
            missing, extra = _diff(want_list, got)
            counts[f"{name.replace(' ', '_')}_missing"] += missing
            counts[f"{name.replace(' ', '_')}_extra"] += extra
            if want_list != got and not missing and not extra:
                counts[f"{name.replace(' ', '_')}_out_of_order"] += 1
            if want_list != got:
                notes.append(f"partition {p}: {name} differ from the offline fold ({missing} missing, {extra} extra)")
        counts["duplicate_results"] += sum(n - 1 for n in Counter(r[2] for r in got_input_results).values() if n > 1)
        end = input_ends[p] = inputs[p][-1][0] + 1 if inputs.get(p) else 0
        for source, ledgers in (("projection", projections), ("changelog", from_changelog)):
            ledger, position = ledgers.get(p, (None, None))
            if ledger is None and want.ledger["parents"]:
                ledger_mismatch.append(f"partition {p}: no {source} ledger")
            elif ledger is not None and ledger != want.ledger:
                ledger_mismatch.append(f"partition {p}: {source} ledger differs from the offline fold's")
            if ledger is not None and end and position != end:
                ledger_mismatch.append(f"partition {p}: {source} covers input offset {position}, input ends at {end}")
        if p in projections:
            invariant_problems += invariant_violations(projections[p][0])
        child_problems += over_released(got_releases, want.ledger)
    key_counts = Counter(r[0] for r in all_got_releases)
    counts["duplicate_releases"] = sum(n - 1 for n in key_counts.values() if n > 1)
    ticks_checked = check_ticks(ticks, results, input_ends)
    invariants = {
        "I1": {"ok": counts["duplicate_releases"] == 0 and not child_problems,
               "duplicate_release_keys": counts["duplicate_releases"], "children_over_released": child_problems[:5]},
        "I2": {"ok": not any(counts[k] for k in ("releases_missing", "releases_extra", "releases_out_of_order",
                                                  "results_missing", "results_extra", "results_out_of_order",
                                                  "dead_letters_missing", "dead_letters_extra",
                                                  "dead_letters_out_of_order")),
               "releases_expected": counts["releases_expected"], "releases_observed": counts["releases_observed"],
               "results_expected": counts["results_expected"], "results_observed": counts["results_observed"],
               "tick_results_expected": counts["tick_results_expected"],
               "tick_results_observed": counts["tick_results_observed"]},
        "I3": {"ok": not ledger_mismatch, "mismatches": ledger_mismatch[:10],
               "partitions_compared": sorted(projections)},
        "I7": {"ok": not invariant_problems, "violations": invariant_problems[:10],
               "parents": sum(len(l["parents"]) for l, _ in projections.values())},
        "I8": ticks_checked,
    }
    if reader is not None:
        invariants["I4"] = check_reader(reader, counts["results_expected"], counts["releases_expected"],
                                        ticks_checked["ticks_committed"])
    if zombie is not None:
        invariants["I6"] = zombie
    if write_marker:
        invariants["I5"] = check_no_open_transaction(topics)
    waited = waited_for(settled)
    if waited is not None:  # evidence; a transaction never decided fails I5 (here and by its marker)
        notes.insert(0, waited)
        i5 = invariants.setdefault("I5", {"ok": True})
        i5["open_when_verification_began"] = settled
        i5["ok"] = i5["ok"] and not settled["still_open"]
    left_open = max(len(invariants.get("I5", {}).get("unreadable", [])), len(settled["still_open"]))
    summary = {
        "releases_expected": counts["releases_expected"],
        "releases_observed": counts["releases_observed"],
        "results_expected": counts["results_expected"],
        "results_observed": counts["results_observed"],
        "ticks_committed": ticks_checked["ticks_committed"],
        "lease_expiries": counts["lease_expiries"],
        "dead_letters": counts["dead_letters_observed"],
        "duplicates": counts["duplicate_releases"] + counts["duplicate_results"] + counts["releases_extra"]
        + counts["results_extra"] + counts["dead_letters_extra"]
        + (invariants.get("I4", {}).get("duplicates_seen", 0)),
        "missing": counts["releases_missing"] + counts["results_missing"] + counts["dead_letters_missing"],
        "mismatches": len(ledger_mismatch) + counts["releases_out_of_order"] + counts["results_out_of_order"]
        + counts["dead_letters_out_of_order"] + len(child_problems) + len(invariant_problems)
        + len(ticks_checked["problems"]),
        "open_transactions": left_open,
    }
    return {"ok": all(v["ok"] for v in invariants.values()), "summary": summary, "invariants": invariants,
            "notes": notes[:20]}


def check_reader(reader, results_expected: int, releases_expected: int, ticks_expected: int,
                 timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while (reader.results < results_expected or reader.releases < releases_expected
           or reader.tick_results < ticks_expected) and time.monotonic() < deadline:
        time.sleep(0.2)
    dups = len(reader.duplicate_releases) + len(reader.duplicate_results) + len(reader.duplicate_ticks)
    return {"ok": dups == 0 and reader.results == results_expected and reader.releases == releases_expected
            and reader.tick_results == ticks_expected,
            "duplicates_seen": dups, "results_seen": reader.results, "releases_seen": reader.releases,
            "tick_results_seen": reader.tick_results, "refetched_after_reconnect": reader.refetched,
            "examples": (reader.duplicate_releases[:3] + [str(d) for d in reader.duplicate_results[:3]]
                         + reader.duplicate_ticks[:3])}


def check_no_open_transaction(topics: Topics) -> dict:
    """I5: a fresh transactional producer commits a marker to every partition of every output topic, the
    changelog and ledger-ticks; each must become readable (read_committed) past every earlier record. A transaction left
    open before it would hold the last stable offset back and keep the marker invisible. Run last: the
    markers are not events (the topics are deleted afterwards)."""
    bootstrap = topics.bootstrap
    names = [topics.name(t) for t in (*OUTPUT_TOPICS, "ledger-changelog", TICKS_TOPIC)]
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
