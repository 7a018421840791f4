"""The comparison of what a re-fold derives with what the processors committed, and of the final ledgers
with the live projections.

Each output topic-partition is first compared as bytes: the published values against the derived records
encoded the same way, each kind in its order. Only a topic-partition where the bytes differ (a divergence, a
processor ahead of the input read, another writer schema) is decoded and matched record by record, by what
produced each record rather than by its position: (input offset, record kind, n-th of that kind for that
input). So an injected record, a removed one and an altered one are each reported once, at their own offset,
instead of shifting every record after them, and decoding is paid only where something differs. A final
ledger is compared with the live projection the same way: equal record bytes agree, the others are compared
as `ledger_snapshot` shows them.
"""

from __future__ import annotations

import sys

from branch_settlement.processors.ledger.outputs import OUTPUT_ROUTES
from branch_settlement.processors.crosscheck.report import NOT_YET_PROCESSED, Divergence, PartitionOutcome, Report
from branch_settlement.processors.replay.replayer import ReplayResult, child_entry, ledger_snapshot, parent_entry
from branch_settlement.projections import keys
from branch_settlement.projections.store import Store
from branch_settlement.schemas.codec import HEADER_SIZE, Codec

# Output topic -> ((record name, the Outputs list it is derived from), ...), from the one routing table.
DERIVED = {topic: tuple((name, attr) for attr, routed, name in OUTPUT_ROUTES if routed == topic)
           for topic in dict.fromkeys(topic for _, topic, _ in OUTPUT_ROUTES)}


def encode_derived(outputs, codec: Codec) -> dict[str, list[bytes]]:
    """The derived outputs encoded per output topic, in the processor's order (what the re-fold builds as
    it folds)."""
    derived: dict[str, list[bytes]] = {topic: [] for topic in DERIVED}
    for attr, topic, name in OUTPUT_ROUTES:
        derived[topic].extend(codec.encode(name, record) for record in getattr(outputs, attr))
    return derived


def compare_partition(p: int, derived: dict[str, list[bytes]], dead_letters: list[dict], published: dict,
                      codec: Codec, offset_range: tuple[int, int], names: dict[str, str],
                      part: PartitionOutcome, snapshot_end: int | None = None,
                      committed: int | None = None) -> None:
    """The derived outputs of one partition (encoded) against the published ones. Published records are
    compared as bytes with the derived ones, in order; only a topic-partition where they differ is decoded and
    matched record by record (`_diff`), which pinpoints each divergence. `snapshot_end`: the input offset the
    replay read up to; a published record for it or beyond that the replay did not derive is the processor's
    work since (its ticks keep coming at that offset while it waits for input), not an extra. `committed`: the
    processors' group's committed offset of the partition; an output missing for an input at or beyond it is
    not yet processed (`part.not_yet_processed`), not missing."""
    low, high = offset_range
    full = low <= 0 and high >= sys.maxsize
    for topic in DERIVED:
        mine = derived[topic]
        rows = published[topic]
        report = Report()
        if same_bytes(mine, rows):
            report.compared = len(mine) if full else sum(
                1 for value in mine if low <= codec.decode(value)[1]["input_offset"] <= high)
        else:
            expected = {key: record for key, (_, record) in _keyed_published(
                [(None, *codec.decode(value)) for value in mine]).items()}
            decoded = [(offset, *codec.decode(value)) for offset, value in rows]
            _diff(names[topic], p, expected, _keyed_published(decoded), low, high, report, snapshot_end, committed)
        part.compared += report.compared
        part.divergences[topic] = [d for d in report.divergences if d.problem != NOT_YET_PROCESSED]
        part.not_yet_processed.extend(d for d in report.divergences if d.problem == NOT_YET_PROCESSED)
    report = Report()
    expected = {("DeadLetter", letter["offset"], 0): {"offset": letter["offset"], "reason": letter["reason"]}
                for letter in dead_letters}
    found = {}
    for offset, value in published["branch-events-dlq"]:
        letter = codec.decode(value)[1]
        found[("DeadLetter", letter["offset"], 0)] = (offset, {"offset": letter["offset"], "reason": letter["reason"]})
    _diff(names["branch-events-dlq"], p, expected, found, low, high, report, snapshot_end, committed)
    part.compared += report.compared
    part.divergences["branch-events-dlq"] = [d for d in report.divergences if d.problem != NOT_YET_PROCESSED]
    part.not_yet_processed.extend(d for d in report.divergences if d.problem == NOT_YET_PROCESSED)


def same_bytes(derived: list[bytes], rows: list[tuple[int, bytes]]) -> bool:
    """Whether the published values are exactly the derived records: in the same order, or with their kinds
    interleaved otherwise but each kind in its order (a processor that wrote each checkpoint's kinds apart; a
    kind's schema fingerprint heads its bytes, so no record of one kind equals one of another)."""
    if len(derived) != len(rows):
        return False
    values = [value for _, value in rows]
    if values == derived:
        return True
    by_kind: dict[bytes, list[bytes]] = {}
    for value in derived:
        by_kind.setdefault(value[:HEADER_SIZE], []).append(value)
    position = dict.fromkeys(by_kind, 0)
    for value in values:
        kind = value[:HEADER_SIZE]
        records = by_kind.get(kind)
        if records is None or position[kind] == len(records) or records[position[kind]] != value:
            return False
        position[kind] += 1
    return True


def _keyed_published(rows: list[tuple[int, str, dict]]) -> dict[tuple, tuple[int, dict]]:
    keyed = {}
    counts: dict[tuple, int] = {}
    for offset, kind, record in rows:
        base = (kind, record["input_offset"])
        n = counts.get(base, 0)
        counts[base] = n + 1
        keyed[(kind, record["input_offset"], n)] = (offset, record)
    return keyed


def _diff(topic: str, partition: int, expected: dict, found: dict, low: int, high: int, report: Report,
          snapshot_end: int | None = None, committed: int | None = None) -> None:
    lagging = committed if committed is not None else sys.maxsize
    last_replayed = max((key[1] for key in expected), default=-1)
    ahead = snapshot_end if snapshot_end is not None else sys.maxsize
    for key in sorted(set(expected) | set(found), key=lambda k: (k[1], k[0], k[2])):
        input_offset = key[1]
        if not low <= input_offset <= high:
            continue
        if key not in found:
            problem = NOT_YET_PROCESSED if input_offset >= lagging else "missing"
            report.divergences.append(Divergence(topic, partition, None, input_offset, problem, expected[key], None))
        elif key not in expected:
            if input_offset > last_replayed and key[0] != "DeadLetter" or input_offset >= ahead:
                continue  # the processor is ahead of the replay's snapshot of the input
            report.divergences.append(Divergence(topic, partition, found[key][0], input_offset, "extra", None,
                                                 found[key][1]))
        else:
            report.compared += 1
            if found[key][1] != expected[key]:
                report.divergences.append(Divergence(topic, partition, found[key][0], input_offset, "different",
                                                     _changed(expected[key], found[key][1]),
                                                     _changed(found[key][1], expected[key])))


def _changed(a: dict, b: dict) -> dict:
    """The fields of `a` that differ from `b`: a readable divergence, not two whole records."""
    return {k: v for k, v in a.items() if b.get(k) != v} if isinstance(a, dict) and isinstance(b, dict) else a


def compare_ledgers(folded: dict[int, tuple[ReplayResult, Store]], live: dict[int, dict], codec: Codec,
                    report: Report) -> None:
    for p, (_, store) in folded.items():
        if p not in live:
            continue
        derived = ledger_snapshot(store, codec)
        for section in ("parents", "children"):
            for key in sorted(set(derived[section]) | set(live[p][section])):
                if derived[section].get(key) != live[p][section].get(key):
                    report.divergences.append(Divergence(f"projection/{section}", p, None, None, "ledger",
                                                         {key: derived[section].get(key)},
                                                         {key: live[p][section].get(key)}))


def compare_live_ledger(p: int, store: Store, live, codec: Codec, part: PartitionOutcome) -> None:
    """The final ledger against the live projection's: records whose bytes are equal agree; the others are
    compared as `ledger_snapshot` shows them."""
    divergences = part.divergences.setdefault("ledger", [])
    if isinstance(live, dict):
        if p in live:
            report = Report()
            compare_ledgers({p: (None, store)}, {p: live[p]}, codec, report)
            divergences.extend(report.divergences)
        return
    live_store = live.open(p)
    if live_store is None:
        return
    try:
        for section, kind, entry in (("parents", keys.PARENT, parent_entry), ("children", keys.CHILD, child_entry)):
            derived = dict(store.scan(keys.prefix(kind)))
            found = dict(live_store.scan(keys.prefix(kind)))
            differ = []
            for key in derived.keys() | found.keys():
                a, b = derived.get(key), found.get(key)
                if a == b:
                    continue
                mine = entry(codec.decode(a)[1]) if a is not None else None
                theirs = entry(codec.decode(b)[1]) if b is not None else None
                name = (mine or theirs)[0]
                if (mine and mine[1]) != (theirs and theirs[1]):
                    differ.append((name, mine[1] if mine else None, theirs[1] if theirs else None))
            for name, mine, theirs in sorted(differ, key=lambda d: d[0]):
                divergences.append(Divergence(f"projection/{section}", p, None, None, "ledger", {name: mine},
                                              {name: theirs}))
    finally:
        live_store.close()


__all__ = ["DERIVED", "encode_derived", "compare_partition", "same_bytes", "compare_ledgers", "compare_live_ledger"]
