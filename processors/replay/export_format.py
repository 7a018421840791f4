"""The export file format: an Avro object container whose records are `ExportedRecord` (partition, offset,
the event or, for a record that could not be decoded, its raw bytes and the reason; `ledger_tick` marks the
processor's ticks of ledger-ticks, merged in before the input offset `offset`), with the input topic's
partition count in the container's metadata (`settle.partitions`). Any Avro library reads it; `settle
export` writes it and `settle replay FILE.avro` folds it partition by partition, as the processor did: each
partition folds only its own parents, and its ticks come only from the processor."""

from __future__ import annotations

from typing import Iterable, Iterator

import fastavro

from branch_settlement.processors.replay.replayer import Input
from branch_settlement.schemas import EVENT_TYPES
from branch_settlement.schemas.codec import Codec, CodecError

EXPORT_RECORD = "io.branchsettlement.export.ExportedRecord"
PARTITIONS_METADATA = "settle.partitions"


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
            {"name": "ledger_tick", "type": "boolean", "default": False,
             "doc": "one of the processor's ticks (ledger-ticks), folded before input offset `offset`"},
        ],
    })


def decode_record(codec: Codec, partition: int, offset: int, value: bytes | None) -> tuple[int, Input, bytes | None]:
    """An input record of the topic as the processor sees it: an event, or a dead letter with the reason."""
    try:
        return partition, Input(offset, codec.decode_event(value or b"")), value
    except CodecError as exc:
        return partition, Input(offset, None, str(exc)), value


def write_export(path, records: Iterable[tuple[int, Input, bytes | None]], codec: Codec,
                 partitions: int | None = None) -> int:
    """Write (partition, input, raw bytes) records to an Avro container, with the input topic's partition
    count `partitions`; return how many."""
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
                       "reason": "", "ledger_tick": item.ledger_tick}
            else:
                yield {"partition": partition, "offset": item.offset, "event": None, "raw": raw or b"",
                       "reason": item.reason, "ledger_tick": item.ledger_tick}

    metadata = {PARTITIONS_METADATA: str(partitions)} if partitions else None
    with open(path, "wb") as out:
        fastavro.writer(out, schema, rows(), codec="deflate", metadata=metadata)
    return count


def export_partition_count(path) -> int | None:
    """The input topic's partition count an export was written with; None for a file from before it was
    recorded (its partitions then fold every parent, and the ticks in it)."""
    with open(path, "rb") as f:
        value = fastavro.reader(f).metadata.get(PARTITIONS_METADATA)
    return int(value) if value and value.isdigit() else None


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
    return {p: [export_input(row, codec) for row in rows] for p, rows in read_export_rows(path).items()}


def read_export_rows(path) -> dict[int, list[dict]]:
    """The rows of an export file as Avro decoded them, per partition, in offset order (`export_input`
    makes each an Input)."""
    by_partition: dict[int, list[dict]] = {}
    with open(path, "rb") as f:
        for row in fastavro.reader(f, return_record_name=True):
            by_partition.setdefault(row["partition"], []).append(row)
    return dict(sorted(by_partition.items()))


def export_input(row: dict, codec: Codec) -> Input:
    ledger_tick = row.get("ledger_tick", False)
    if row["event"] is not None:
        name, fields = row["event"]
        return Input(row["offset"], codec.event_from_json({"type": name.rsplit(".", 1)[1], **fields}),
                     ledger_tick=ledger_tick)
    return Input(row["offset"], None, row["reason"], ledger_tick=ledger_tick)


__all__ = ["EXPORT_RECORD", "PARTITIONS_METADATA", "export_schema", "export_partition_count", "decode_record", "write_export", "is_export", "read_export",
           "read_export_rows", "export_input"]
