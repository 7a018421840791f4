"""Inputs of several partitions, kept apart: each partition has its own ledger and ledger time, so a
multi-partition replay folds each partition on its own, exactly as the processor does.

Also the export file format: an Avro object container whose records are `ExportedRecord` (partition,
offset, the event or, for a record that could not be decoded, its raw bytes and the reason). Any Avro
library reads it; `settle replay FILE.avro` folds it partition by partition.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import fastavro

from processors.replay import Input, ReplayResult, ledger_snapshot, replay, replay_document
from projections.store import MemoryStore, Store
from schemas import EVENT_TYPES
from schemas.codec import Codec, CodecError

EXPORT_RECORD = "io.branchsettlement.export.ExportedRecord"


def export_schema(codec: Codec) -> dict:
    events = [codec.version(name).parsed for name in EVENT_TYPES]
    return fastavro.parse_schema({
        "type": "record", "name": EXPORT_RECORD,
        "doc": "One input record of branch-events: its position, and the event or why it is not one.",
        "fields": [
            {"name": "partition", "type": "int"},
            {"name": "offset", "type": "long"},
            {"name": "event", "type": ["null", *events], "default": None},
            {"name": "raw", "type": ["null", "bytes"], "default": None},
            {"name": "reason", "type": "string", "default": ""},
        ],
    })


def decode_record(codec: Codec, partition: int, offset: int, value: bytes | None) -> tuple[int, Input, bytes | None]:
    """An input record of the topic as the processor sees it: an event, or a dead letter with the reason."""
    try:
        return partition, Input(offset, codec.decode_event(value or b"")), value
    except CodecError as exc:
        return partition, Input(offset, None, str(exc)), value


def write_export(path, records: Iterable[tuple[int, Input, bytes | None]], codec: Codec) -> int:
    """Write (partition, input, raw bytes) records to an Avro container; return how many."""
    schema = export_schema(codec)
    count = 0

    def rows() -> Iterator[dict]:
        nonlocal count
        for partition, item, raw in records:
            count += 1
            if item.event is not None:
                event = {k: v for k, v in item.event.items() if k != "type"}
                yield {"partition": partition, "offset": item.offset,
                       "event": (f"io.branchsettlement.events.{item.event['type']}", event), "raw": None,
                       "reason": ""}
            else:
                yield {"partition": partition, "offset": item.offset, "event": None, "raw": raw or b"",
                       "reason": item.reason}

    with open(path, "wb") as out:
        fastavro.writer(out, schema, rows(), codec="deflate")
    return count


def is_export(path) -> bool:
    with open(path, "rb") as f:
        try:
            reader = fastavro.reader(f)
        except ValueError:
            return False
        schema = reader.writer_schema
        return isinstance(schema, dict) and schema.get("name") == EXPORT_RECORD


def read_export(path, codec: Codec) -> dict[int, list[Input]]:
    """Inputs of an export file, per partition, in offset order."""
    by_partition: dict[int, list[Input]] = {}
    with open(path, "rb") as f:
        for row in fastavro.reader(f, return_record_name=True):
            if row["event"] is not None:
                name, fields = row["event"]
                event = codec.event_from_json({"type": name.rsplit(".", 1)[1], **fields})
                item = Input(row["offset"], event)
            else:
                item = Input(row["offset"], None, row["reason"])
            by_partition.setdefault(row["partition"], []).append(item)
    return dict(sorted(by_partition.items()))


def replay_partitions(inputs: dict[int, Iterable[Input]], codec: Codec, store_factory=MemoryStore,
                      progress=lambda events: None) -> dict[int, tuple[ReplayResult, Store]]:
    """Fold each partition's inputs into its own fresh store."""
    folded = {}
    for partition, items in sorted(inputs.items()):
        folded[partition] = replay(_counting(items, progress), store_factory(), codec=codec, partition=partition)
    return folded


def _counting(items: Iterable[Input], progress) -> Iterator[Input]:
    for n, item in enumerate(items, start=1):
        yield item
        if n % 1000 == 0:
            progress(1000)


def merged_document(folded: dict[int, tuple[ReplayResult, Store]], codec: Codec) -> dict:
    """One SPEC §12 document for several partitions: ledgers merged (a parent lives in one partition),
    outputs in (partition, offset) order."""
    doc = {"parents": {}, "children": {}, "results": [], "releases": [], "dead_letters": []}
    for partition, (result, store) in sorted(folded.items()):
        part = replay_document(result, store, codec)
        doc["parents"].update(part["parents"])
        doc["children"].update(part["children"])
        doc["results"].extend(part["results"])
        doc["releases"].extend(part["releases"])
        doc["dead_letters"].extend({"partition": partition, "offset": letter["offset"], "reason": letter["reason"]}
                                   for letter in result.dead_letters)
    doc["parents"] = dict(sorted(doc["parents"].items()))
    doc["children"] = dict(sorted(doc["children"].items()))
    return doc


__all__ = ["decode_record", "write_export", "read_export", "is_export", "replay_partitions", "merged_document",
           "ledger_snapshot"]
