"""Avro wire format of branch settlement: single-object encoding (read by fastavro, written by writers compiled
from the schemas that write fastavro's bytes, see "Avro binary writers" below), and the canonical JSON form.

Every record on a topic or in the changelog is written as the Avro single-object encoding:

    C3 01 | 8-byte little-endian CRC-64-AVRO fingerprint of the writer schema's Parsing Canonical Form | body

The reader looks the writer schema up by its fingerprint among every version it knows (the current
`schemas/*.avsc` and the older ones in `schemas/history/`) and resolves the body into the *current* schema of the
same name, so a record written before a field was added is read with that field's default. Any Avro library can
produce and consume these bytes from the `.avsc` files alone.

An event is a record of the `io.branchsettlement.events` namespace. Its canonical dict (SPEC section 12) is the
record with `"type"` (the record's short name) first, then every field in schema order; optional fields absent
from the input are present with their default (None for unions with null), so all events of a type have the same
keys. Map entries are sorted by key when an event is normalized from JSON, so that equal events encode to equal
bytes whatever the key order of their source.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from functools import cache
from pathlib import Path
from typing import IO, Any

import fastavro
from fastavro import schemaless_reader, schemaless_writer

from schemas.errors import CodecError
from schemas.event_json import EventShape, event_type_of
from schemas.registry import SINGLE_OBJECT_MARKER, SchemaVersion, expand, load_registry, schema_fingerprint

SCHEMA_DIR = Path(__file__).resolve().parent
EVENTS_NAMESPACE = "io.branchsettlement.events"
HEADER_SIZE = len(SINGLE_OBJECT_MARKER) + 8

EVENT_TYPES = (
    "ParentReserved",
    "ChildReserved",
    "ChildActivated",
    "LeaseRenewed",
    "UsageReported",
    "ChildCompleted",
    "ChildSkipped",
    "CancelRequested",
    "CancelAcknowledged",
    "ChildFailed",
    "SpeculativeWinner",
    "ReservationTransferred",
    "ReconciliationResolved",
    "UsageAdjustment",
    "SchedulerReleaseConfirmed",
    "ParentClosed",
    "Tick",
)
OUTPUT_TYPES = ("SettlementResult", "CapacityReleased", "ParentSettled", "AuditRecord", "DeadLetter")
# Balance is the shared per-dimension type of outputs and ledger records; it can also be encoded on its own.
LEDGER_TYPES = ("Balance", "LedgerParent", "LedgerChild", "IdempotencyRecord", "TimerRecord", "PartitionMeta")

_Source = str | os.PathLike[str] | IO[bytes]


class Codec:
    """Encoder and decoder of every record of `schema_dir` (by default the packaged `schemas/` directory).

    Schemas are loaded, resolved and parsed once, at construction; a Codec is immutable afterwards and may be
    shared. `default_codec()` returns a shared instance for the packaged schemas.
    """

    def __init__(self, schema_dir: str | os.PathLike[str] = SCHEMA_DIR) -> None:
        registry = load_registry(Path(schema_dir))
        self._current = registry.current
        self._headers = {name: version.header for name, version in registry.current.items()}
        self._parsed = {name: version.parsed for name, version in registry.current.items()}
        self._writers = {name: compile_writer(schema) for name, schema in self._parsed.items()}
        # fingerprint -> (short name, writer schema, reader schema or None when the writer is current)
        self._readers: dict[bytes, tuple[str, dict[str, Any], dict[str, Any] | None]] = {
            fp: (v.name, v.parsed, None if v.current else registry.current[v.name].parsed)
            for fp, v in registry.by_fingerprint.items()
        }
        events = [v for v in registry.current.values() if v.namespace == EVENTS_NAMESPACE]
        self._event_shapes = {v.name: EventShape(v.name, v.parsed) for v in events}
        self._event_fullnames = {v.name: v.fullname for v in events}
        self._event_names_by_fullname = {v.fullname: v.name for v in events}
        self._container_schema = fastavro.parse_schema(expand([v.parsed for v in events], registry.definitions))
        self._container_fingerprint = schema_fingerprint(self._container_schema)

    @property
    def names(self) -> tuple[str, ...]:
        """Short names of every record this codec can encode."""
        return tuple(sorted(self._current))

    def version(self, name: str) -> SchemaVersion:
        """The current schema version of record `name`."""
        try:
            return self._current[name]
        except KeyError:
            raise CodecError(f"unknown record name {name!r}") from None

    def encode(self, name: str, record: dict[str, Any]) -> bytes:
        """Single-object encoding of `record` with the current schema of `name` (short name)."""
        try:
            header = self._headers[name]
        except KeyError:
            raise CodecError(f"unknown record name {name!r}") from None
        out = bytearray(header)
        try:
            self._writers[name](out, record)
        except _NotPlain:
            return self._encode_with_fastavro(name, header, record)
        return bytes(out)

    def _encode_with_fastavro(self, name: str, header: bytes, record: dict[str, Any]) -> bytes:
        """fastavro's encoding: what it accepts beyond plain values (a float for a long, a missing field with
        a default, a tuple for an array ...), and the error for what nobody can encode."""
        buffer = io.BytesIO()
        buffer.write(header)
        try:
            schemaless_writer(buffer, self._parsed[name], record)
        except Exception as exc:  # fastavro raises ValueError, TypeError, KeyError, AttributeError ...
            raise CodecError(f"{name}: cannot encode: {type(exc).__name__}: {exc}") from exc
        return buffer.getvalue()

    def decode(self, data: bytes) -> tuple[str, dict[str, Any]]:
        """(short name, record in the current reader schema) of single-object encoded `data`."""
        if len(data) < HEADER_SIZE:
            raise CodecError(f"truncated single-object header: {len(data)} bytes, need {HEADER_SIZE}")
        if data[:2] != SINGLE_OBJECT_MARKER:
            raise CodecError(f"bad single-object marker {bytes(data[:2]).hex()}, expected c301")
        fingerprint = bytes(data[2:HEADER_SIZE])
        try:
            name, writer, reader = self._readers[fingerprint]
        except KeyError:
            raise CodecError(f"unknown writer schema fingerprint {fingerprint.hex()}") from None
        body = io.BytesIO(data)
        body.seek(HEADER_SIZE)
        try:
            record = schemaless_reader(body, writer, reader)
        except Exception as exc:  # corrupt input surfaces as EOFError, UnicodeDecodeError, IndexError ...
            raise CodecError(f"{name}: cannot decode body: {type(exc).__name__}: {exc}") from exc
        if body.tell() != len(data):
            raise CodecError(f"{name}: {len(data) - body.tell()} trailing bytes after the record")
        if reader is not None:
            record = in_schema_order(record, reader)
        return name, record

    def encode_event(self, event: dict[str, Any]) -> bytes:
        """Single-object encoding of a canonical event dict (its "type" names the schema)."""
        return self.encode(self._event_name(event), event)

    def decode_event(self, data: bytes) -> dict[str, Any]:
        """The canonical event dict of single-object encoded `data`; CodecError if it is not an event."""
        name, record = self.decode(data)
        if name not in self._event_shapes:
            raise CodecError(f"{name} is not an event")
        return {"type": name, **record}

    def event_from_json(self, obj: Any) -> dict[str, Any]:
        """Validate a parsed JSON object against its event schema and return its canonical dict.

        The message of the CodecError names the field: "ChildReserved.quantities.tokens: expected integer, got
        12.5", "ChildFailed.activated: missing required field", "Tick.now: unknown field".
        """
        return event_type_of(obj, self._event_shapes).normalize(obj)

    def event_to_json(self, event: dict[str, Any]) -> dict[str, Any]:
        """The JSON-ready dict of a canonical event: a fresh, validated copy with every field, in schema order.

        The canonical form is the JSON form (SPEC section 12), so this is `event_from_json` under the name that
        says which way the data goes; a CodecError here means the caller built an invalid event.
        """
        return self.event_from_json(event)

    def write_container(self, dest: _Source, events: Iterable[dict[str, Any]]) -> None:
        """Write canonical events to an Avro object container file (path or binary file object).

        The file schema is the union of every event record, so any Avro tool can read the file.
        """
        tagged = ((self._event_fullnames[self._event_name(event)], event) for event in events)
        with _open(dest, "wb") as fo:
            try:
                fastavro.writer(fo, self._container_schema, tagged)
            except CodecError:
                raise
            except Exception as exc:
                raise CodecError(f"cannot write container: {type(exc).__name__}: {exc}") from exc

    def read_container(self, src: _Source) -> Iterator[dict[str, Any]]:
        """Canonical events of an Avro object container file whose schema is a union of event records (as
        `write_container` writes) or one event record. Older schema versions are resolved into the current ones.
        A seekable file object is needed when the file's schema is not the current one.
        """
        with _open(src, "rb") as fo:
            start = fo.tell()
            try:
                reader = fastavro.reader(fo, return_record_name=True)
                reader_schema = self._container_reader_schema(reader.writer_schema)
                if reader_schema is not None:
                    fo.seek(start)
                    reader = fastavro.reader(fo, reader_schema=reader_schema, return_record_name=True)
                single = None if isinstance(reader.writer_schema, list) else reader.writer_schema["name"]
                resolved = reader_schema is not None
                for item in reader:
                    fullname, record = (single, item) if single else item
                    name = self._event_names_by_fullname[fullname]
                    if resolved:
                        record = in_schema_order(record, self._parsed[name])
                    yield {"type": name, **record}
            except CodecError:
                raise
            except Exception as exc:
                raise CodecError(f"cannot read container: {type(exc).__name__}: {exc}") from exc

    def _container_reader_schema(self, writer_schema: Any) -> Any:
        """None when the file was written with current schemas, else the schema to resolve it into."""
        branches = writer_schema if isinstance(writer_schema, list) else [writer_schema]
        for branch in branches:
            fullname = branch.get("name") if isinstance(branch, dict) else None
            if fullname not in self._event_names_by_fullname:
                raise CodecError(f"container holds {fullname or repr(branch)}, which is not an event record")
        if isinstance(writer_schema, list):
            current, reader = self._container_fingerprint, self._container_schema
        else:
            version = self._current[self._event_names_by_fullname[writer_schema["name"]]]
            current, reader = version.fingerprint, version.parsed
        return None if schema_fingerprint(writer_schema) == current else reader

    def _event_name(self, event: Any) -> str:
        try:
            name = event["type"]
        except (KeyError, TypeError):
            raise CodecError(f"not an event dict with a 'type': {type(event).__name__}") from None
        if name not in self._event_shapes:
            raise CodecError(f"unknown event type {name!r}")
        return name


@cache
def default_codec() -> Codec:
    """The shared Codec of the packaged schemas."""
    return Codec()


def in_schema_order(value: Any, schema: Any, named: dict[str, Any] | None = None) -> Any:
    """`value` with every record's fields in the order of `schema` (a parsed schema).

    fastavro returns a record resolved from an older writer with the writer's fields first and the fields it
    lacked after them; this puts them back in the reader's order, so that a record has the same key order
    whichever version wrote it (JSON output depends on key order).
    """
    if named is None:
        named = schema.get("__named_schemas", {}) if isinstance(schema, dict) else {}
    if isinstance(schema, str):
        return in_schema_order(value, named[schema], named) if schema in named else value
    if isinstance(schema, list):
        branches = [branch for branch in schema if branch != "null"]
        if value is None or len(branches) != 1:
            return value  # a union of several non-null types: the branch is not known here, keep as read
        return in_schema_order(value, branches[0], named)
    kind = schema["type"]
    if kind == "record":
        return {
            field["name"]: in_schema_order(value[field["name"]], field["type"], named) for field in schema["fields"]
        }
    if kind == "map":
        return {key: in_schema_order(item, schema["values"], named) for key, item in value.items()}
    if kind == "array":
        return [in_schema_order(item, schema["items"], named) for item in value]
    return value


# -- Avro binary writers ----------------------------------------------------------------------------------------
#
# fastavro's schemaless_writer interprets the schema again for every value it writes, about half a microsecond a
# field; the fold writes a result, one or two audit records and one or two ledger records per event, which made
# encoding a large part of its time. Each current schema is compiled once into a tree of small writer functions
# (as schemas/event_json.py does for the JSON form) that take only plain values: exactly str, int, bool, bytes,
# None, dict, list, and every record field present. On anything else a writer raises _NotPlain, `Codec.encode`
# drops what was written so far and hands the record to fastavro, whose encoding or error it returns; so a
# record is encoded exactly as fastavro encodes it, whatever it holds. The bytes are the Avro binary encoding:
# zig-zag varints, length-prefixed UTF-8, a union's branch index, a map or an array as one block of all its
# items then an empty block (tests/test_fold_perf_equivalence.py compares them with fastavro's for every schema).

Writer = Callable[[bytearray, Any], None]

_LONG_MIN, _LONG_MAX = -(1 << 63), (1 << 63) - 1


class _NotPlain(Exception):
    """A value the compiled writers leave to fastavro."""


def compile_writer(schema: Any) -> Writer:
    """The writer of a parsed schema."""
    return _writer(schema, schema.get("__named_schemas", {}) if isinstance(schema, dict) else {})


def _writer(schema: Any, named: dict[str, Any]) -> Writer:
    if isinstance(schema, str):
        if schema in _PRIMITIVE_WRITERS:
            return _PRIMITIVE_WRITERS[schema]
        return _LazyWriter(schema, named)
    if isinstance(schema, list):
        return _union_writer(schema, named)
    kind = schema["type"]
    if kind == "record":
        return _record_writer(schema, named)
    if kind == "map":
        return _map_writer(_writer(schema["values"], named))
    if kind == "array":
        return _array_writer(_writer(schema["items"], named))
    if kind in _PRIMITIVE_WRITERS:
        return _PRIMITIVE_WRITERS[kind]
    return _leave_to_fastavro  # enum, fixed, float, double: no schema of ours has them


class _LazyWriter:
    """A reference to a named type, compiled on first use (a recursive type refers to itself)."""

    __slots__ = ("_name", "_named", "_write")

    def __init__(self, name: str, named: dict[str, Any]) -> None:
        self._name, self._named, self._write = name, named, None

    def __call__(self, out: bytearray, value: Any) -> None:
        if self._write is None:
            self._write = _writer(self._named[self._name], self._named)
        self._write(out, value)


def _leave_to_fastavro(out: bytearray, value: Any) -> None:
    raise _NotPlain


def _write_long(out: bytearray, value: Any) -> None:
    if type(value) is not int:
        raise _NotPlain
    if 0 <= value < 64:  # one byte: most counts, generations, partitions, lengths
        out.append(value << 1)
        return
    if not _LONG_MIN <= value <= _LONG_MAX:
        raise _NotPlain
    value = (value << 1) ^ (value >> 63)  # zig-zag: small magnitudes of either sign take few bytes
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)


def _write_bytes(out: bytearray, value: Any) -> None:
    if type(value) is not bytes:
        raise _NotPlain
    _write_long(out, len(value))
    out += value


def _write_string(out: bytearray, value: Any) -> None:
    if type(value) is not str:
        raise _NotPlain
    try:
        data = value.encode()
    except UnicodeEncodeError:  # a lone surrogate: fastavro raises the error
        raise _NotPlain from None
    size = len(data)
    if size < 64:  # the length is one byte (as in _write_long, written here to save a call per string)
        out.append(size << 1)
    else:
        _write_long(out, size)
    out += data


def _write_boolean(out: bytearray, value: Any) -> None:
    if type(value) is not bool:
        raise _NotPlain
    out.append(value)


def _write_null(out: bytearray, value: Any) -> None:
    if value is not None:
        raise _NotPlain


_PRIMITIVE_WRITERS: dict[str, Writer] = {
    "long": _write_long,
    # fastavro writes an int as a long: the same varint, with no 32-bit range check outside a union
    "int": _write_long,
    "string": _write_string,
    "bytes": _write_bytes,
    "boolean": _write_boolean,
    "null": _write_null,
}


def _union_writer(branches: list[Any], named: dict[str, Any]) -> Writer:
    other = [branch for branch in branches if branch != "null"]
    if len(branches) != 2 or len(other) != 1 or other[0] == "int":
        return _leave_to_fastavro  # fastavro picks among several branches (or range-checks an int) by validating
    write_value = _writer(other[0], named)
    null_index, value_index = (b"\x00", b"\x02") if branches[0] == "null" else (b"\x02", b"\x00")

    def write_optional(out: bytearray, value: Any) -> None:
        if value is None:
            out += null_index
            return
        out += value_index
        write_value(out, value)

    return write_optional


def _map_writer(write_value: Writer) -> Writer:
    def write_map(out: bytearray, value: Any) -> None:
        if type(value) is not dict:
            raise _NotPlain
        if value:
            _write_long(out, len(value))
            for key, item in value.items():
                _write_string(out, key)
                write_value(out, item)
        out.append(0)

    return write_map


def _array_writer(write_item: Writer) -> Writer:
    def write_array(out: bytearray, value: Any) -> None:
        if type(value) is not list:
            raise _NotPlain
        if value:
            _write_long(out, len(value))
            for item in value:
                write_item(out, item)
        out.append(0)

    return write_array


def _record_writer(schema: dict[str, Any], named: dict[str, Any]) -> Writer:
    fields = tuple((field["name"], _writer(field["type"], named)) for field in schema["fields"])

    def write_record(out: bytearray, value: Any) -> None:
        if type(value) is not dict:
            raise _NotPlain
        try:
            for name, write in fields:
                write(out, value[name])
        except KeyError:  # a missing field: fastavro writes its default or raises
            raise _NotPlain from None

    return write_record


def _open(target: _Source, mode: str) -> Any:
    if isinstance(target, (str, os.PathLike)):
        return open(target, mode)
    return nullcontext(target)
