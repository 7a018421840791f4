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
import operator
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from functools import cache
from pathlib import Path
from typing import IO, Any

import fastavro
from fastavro import schemaless_reader, schemaless_writer

from branch_settlement.schemas.errors import CodecError
from branch_settlement.schemas.event_json import EventShape, event_type_of
from branch_settlement.schemas.registry import (SINGLE_OBJECT_MARKER, SchemaVersion, expand, load_registry,
                                                schema_fingerprint)

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
        self._encoders = {name: compile_encoder(v.parsed, v.header) for name, v in registry.current.items()}
        # fingerprint -> (short name, writer schema, reader schema or None when the writer is current)
        self._readers: dict[bytes, tuple[str, dict[str, Any], dict[str, Any] | None]] = {
            fp: (v.name, v.parsed, None if v.current else registry.current[v.name].parsed)
            for fp, v in registry.by_fingerprint.items()
        }
        events = [v for v in registry.current.values() if v.namespace == EVENTS_NAMESPACE]
        # Generated readers of bytes written with a current schema (fingerprint -> ...); others go to fastavro.
        self._fast_readers: dict[bytes, tuple[str, Callable[[bytes], dict[str, Any]]]] = {}
        self._fast_event_readers: dict[bytes, Callable[[bytes], dict[str, Any]]] = {}
        for v in registry.current.values():
            decoder = compile_decoder(v.parsed)
            if decoder is not None:
                self._fast_readers[v.fingerprint] = (v.name, decoder)
            event_decoder = compile_decoder(v.parsed, {"type": v.name}) if v.namespace == EVENTS_NAMESPACE else None
            if event_decoder is not None:
                self._fast_event_readers[v.fingerprint] = event_decoder
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
            encoder = self._encoders[name]
        except KeyError:
            raise CodecError(f"unknown record name {name!r}") from None
        try:
            return encoder(record)
        except _NotPlain:
            return self._encode_with_fastavro(name, self._headers[name], record)

    def encoder(self, name: str) -> Callable[[dict[str, Any]], bytes]:
        """`encode` of one record name, looked up once: `codec.encoder("AuditRecord")(record)` gives the same
        bytes (or CodecError) as `codec.encode("AuditRecord", record)`, for callers encoding record by record."""
        try:
            fast, header = self._encoders[name], self._headers[name]
        except KeyError:
            raise CodecError(f"unknown record name {name!r}") from None
        slow = self._encode_with_fastavro

        def encode(record: dict[str, Any]) -> bytes:
            try:
                return fast(record)
            except _NotPlain:
                return slow(name, header, record)

        return encode

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
        if type(data) is bytes and data[:2] == SINGLE_OBJECT_MARKER:
            fast = self._fast_readers.get(data[2:HEADER_SIZE])
            if fast is not None:
                try:
                    return fast[0], fast[1](data)
                except Exception:  # anything unusual: decoded again below, to fastavro's record or error
                    pass
        return self._decode_with_fastavro(data)

    def _decode_with_fastavro(self, data: bytes) -> tuple[str, dict[str, Any]]:
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
        if type(data) is bytes and data[:2] == SINGLE_OBJECT_MARKER:
            fast = self._fast_event_readers.get(data[2:HEADER_SIZE])
            if fast is not None:
                try:
                    return fast(data)
                except Exception:  # anything unusual: decoded again below, to fastavro's record or error
                    pass
        name, record = self._decode_with_fastavro(data)
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


# -- Avro binary writers and readers, generated from the schemas ----------------------------------------------
#
# fastavro interprets the schema again for every value it writes or reads (and `schemaless_reader` re-checks the
# schema on every call): about half a microsecond a field, ten or more microseconds a record. The fold decodes one
# event and encodes a result, an audit record or two and a few ledger records per event, so each current schema is
# compiled once into the Python source of one function that writes (or reads) a whole record with its fields
# unrolled: no call per field, no dispatch on the schema, nested records, maps and arrays inlined.
#
# A generated writer takes only plain values: exactly str, int, bool, bytes, None, dict, list, and every record
# field present. On anything else (or any exception at all) it raises _NotPlain and `Codec.encode` hands the record
# to fastavro, whose encoding or error it returns; so a record is encoded exactly as fastavro encodes it, whatever
# it holds. The bytes are the Avro binary encoding: zig-zag varints, length-prefixed UTF-8, a union's branch index,
# a map or an array as one block of all its items then an empty block (tests/test_fold_perf_equivalence.py compares
# them with fastavro's for every schema).
#
# A generated reader decodes only bytes written by the *current* schema of a record (a history version is resolved
# by fastavro) and only the canonical encodings a reader can take at their word: positive block counts, union
# branch indexes 0 and 1, lengths that fit, varints below 2**64, strict UTF-8, no trailing bytes. On anything else
# it raises (_NotPlain, IndexError, UnicodeDecodeError ...) and `Codec.decode` decodes the record again the plain
# way, so a record decodes to exactly what fastavro returns, or fails with exactly the same CodecError.

_LONG_MIN, _LONG_MAX = -(1 << 63), (1 << 63) - 1
_NULL = "null"


class _NotPlain(Exception):
    """A value the generated writers leave to fastavro, or bytes the generated readers leave to it."""


class _Unsupported(Exception):
    """A schema the generator does not compile (a recursive type, a union of several types, an enum ...)."""


# Encoded strings and longs, cached: ids, states, result codes, event types, notes, dimension names, ledger times
# and offsets recur across the records of a checkpoint (an event's result, audit records, releases and ledger
# records share most of them). Cleared when full, so memory stays bounded.
_STRING_CACHE_MAX = 16384
_STRING_CACHED_SIZE_MAX = 256  # bytes: at most 16384 * 256 bytes of cached strings
_LONG_CACHE_MAX = 4096
_string_cache: dict[str, bytes] = {}
_long_cache: dict[int, bytes] = {}


def _varint(value: int) -> bytes:
    """Zig-zag varint of a long; _NotPlain outside the long range (fastavro then decides)."""
    if not _LONG_MIN <= value <= _LONG_MAX:
        raise _NotPlain
    value = (value << 1) ^ (value >> 63)
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _long_bytes(value: int) -> bytes:
    """`_varint` of an exact int, cached."""
    data = _varint(value)
    if len(_long_cache) >= _LONG_CACHE_MAX:
        _long_cache.clear()
    _long_cache[value] = data
    return data


def _string_bytes(value: str) -> bytes:
    """Length-prefixed UTF-8 of an exact str, cached unless long (a dead letter's line may be a whole input
    record): a lone surrogate raises UnicodeEncodeError."""
    data = value.encode()
    size = len(data)
    data = (bytes((size << 1,)) if size < 64 else _varint(size)) + data
    if size <= _STRING_CACHED_SIZE_MAX:
        if len(_string_cache) >= _STRING_CACHE_MAX:
            _string_cache.clear()
        _string_cache[value] = data
    return data


def _read_varint(data: bytes, pos: int, first: int) -> tuple[int, int]:
    """(value, position after it) of a varint of several bytes whose first byte was `first`."""
    n = first & 0x7F
    shift = 7
    while True:
        b = data[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            break
    if n >> 64:  # fastavro accumulates in 64 bits: leave such input to it
        raise _NotPlain
    return (n >> 1) ^ -(n & 1), pos


def _read_length(data: bytes, pos: int, first: int) -> tuple[int, int]:
    n, pos = (first >> 1 ^ -(first & 1), pos) if first < 0x80 else _read_varint(data, pos, first)
    if n < 0:
        raise _NotPlain
    return n, pos


_GENERATED_GLOBALS = {
    "_NotPlain": _NotPlain,
    "_varint": _varint,
    "_long_bytes": _long_bytes,
    "_lc_get": _long_cache.get,
    "_string_bytes": _string_bytes,
    "_sc_get": _string_cache.get,
    "_read_varint": _read_varint,
    "_read_length": _read_length,
    "_join": b"".join,
    "_BOOL": (b"\x00", b"\x01"),
}


class _Gen:
    """Lines of generated source, with fresh local names."""

    def __init__(self, named: dict[str, Any]) -> None:
        self.named = named
        self.lines: list[str] = []
        self.constants: dict[str, Any] = {}
        self._count = 0

    def constant(self, value: Any) -> str:
        """The name under which the generated function sees `value`."""
        name = self.fresh("_k")
        self.constants[name] = value
        return name

    def fresh(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def emit(self, depth: int, text: str) -> None:
        self.lines.append("    " * depth + text)

    def resolve(self, schema: Any, stack: tuple[str, ...]) -> tuple[Any, tuple[str, ...]]:
        """A named reference replaced by its definition (inlined: a recursive type is not compiled)."""
        while isinstance(schema, str) and schema not in _PRIMITIVE_KINDS:
            if schema in stack or schema not in self.named:
                raise _Unsupported(schema)
            stack = stack + (schema,)
            schema = self.named[schema]
        if isinstance(schema, dict) and schema.get("type") in _PRIMITIVE_KINDS:
            if "logicalType" in schema:
                raise _Unsupported(schema["logicalType"])
            schema = schema["type"]
        return schema, stack


_PRIMITIVE_KINDS = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})


def _emit_write(g: _Gen, schema: Any, var: str, depth: int, stack: tuple[str, ...]) -> None:
    schema, stack = g.resolve(schema, stack)
    e = g.emit
    if isinstance(schema, list):
        other = [branch for branch in schema if branch != _NULL]
        if len(schema) != 2 or len(other) != 1 or g.resolve(other[0], stack)[0] == "int":
            # fastavro picks among several branches (or range-checks an int) by validating
            raise _Unsupported("union")
        null_byte, value_byte = (b"\x00", b"\x02") if schema[0] == _NULL else (b"\x02", b"\x00")
        e(depth, f"if {var} is None:")
        e(depth + 1, f"ap({null_byte!r})")
        e(depth, "else:")
        e(depth + 1, f"ap({value_byte!r})")
        _emit_write(g, other[0], var, depth + 1, stack)
        return
    kind = schema if isinstance(schema, str) else schema["type"]
    if kind in ("long", "int"):  # fastavro writes an int as a long: no 32-bit range check outside a union
        e(depth, f"if type({var}) is not int: raise _NotPlain")
        e(depth, f"ap(_lc_get({var}) or _long_bytes({var}))")  # never empty: a cached encoding is truthy
    elif kind == "string":
        e(depth, f"if type({var}) is not str: raise _NotPlain")
        e(depth, f"ap(_sc_get({var}) or _string_bytes({var}))")
    elif kind == "bytes":
        e(depth, f"if type({var}) is not bytes: raise _NotPlain")
        e(depth, f"n = len({var})")
        e(depth, "ap(_lc_get(n) or _long_bytes(n))")
        e(depth, f"ap({var})")
    elif kind == "boolean":
        e(depth, f"if type({var}) is not bool: raise _NotPlain")
        e(depth, f"ap(_BOOL[{var}])")
    elif kind == "null":
        e(depth, f"if {var} is not None: raise _NotPlain")
    elif kind == "record":
        e(depth, f"if type({var}) is not dict: raise _NotPlain")
        fields = schema["fields"]
        items = [g.fresh("f") for _ in fields]
        getter = g.constant(operator.itemgetter(*[field["name"] for field in fields])) if fields else None
        if len(fields) > 1:  # every field in one call; a missing field: KeyError, fastavro decides
            e(depth, f"{', '.join(items)} = {getter}({var})")
        elif fields:
            e(depth, f"{items[0]} = {getter}({var})")
        for field, item in zip(fields, items):
            _emit_write(g, field["type"], item, depth, stack)
    elif kind in ("map", "array"):
        e(depth, f"if type({var}) is not {'dict' if kind == 'map' else 'list'}: raise _NotPlain")
        e(depth, f"if {var}:")
        e(depth + 1, f"n = len({var})")
        e(depth + 1, "ap(_lc_get(n) or _long_bytes(n))")
        item = g.fresh("x")
        if kind == "map":
            key = g.fresh("k")
            e(depth + 1, f"for {key}, {item} in {var}.items():")
            _emit_write(g, "string", key, depth + 2, stack)
            _emit_write(g, schema["values"], item, depth + 2, stack)
        else:
            e(depth + 1, f"for {item} in {var}:")
            _emit_write(g, schema["items"], item, depth + 2, stack)
        e(depth, "ap(b'\\x00')")
    else:
        raise _Unsupported(kind)  # enum, fixed, float, double: no schema of ours has them


def _emit_read(g: _Gen, schema: Any, var: str, depth: int, stack: tuple[str, ...]) -> None:
    schema, stack = g.resolve(schema, stack)
    e = g.emit
    if isinstance(schema, list):
        if len(schema) > 64:
            raise _Unsupported("union")
        e(depth, "b = data[pos]")
        e(depth, "pos += 1")
        for index, branch in enumerate(schema):
            e(depth, f"{'if' if index == 0 else 'elif'} b == {index << 1}:")
            _emit_read(g, branch, var, depth + 1, stack)
        e(depth, "else: raise _NotPlain")
        return
    kind = schema if isinstance(schema, str) else schema["type"]
    if kind in ("long", "int"):
        e(depth, "b = data[pos]")
        e(depth, "pos += 1")
        e(depth, f"if b < 128: {var} = b >> 1 ^ -(b & 1)")
        e(depth, f"else: {var}, pos = _read_varint(data, pos, b)")
    elif kind in ("string", "bytes"):
        e(depth, "b = data[pos]")
        e(depth, "pos += 1")
        e(depth, "if not b & 0x81: n = b >> 1")
        e(depth, "else: n, pos = _read_length(data, pos, b)")
        # Past the end the slice is short, but pos goes on: the next read or the final check (pos == end) fails.
        e(depth, "b = pos + n")
        e(depth, f"{var} = data[pos:b]{'.decode()' if kind == 'string' else ''}")
        e(depth, "pos = b")
    elif kind == "boolean":
        e(depth, f"{var} = data[pos] != 0")
        e(depth, "pos += 1")
    elif kind == "null":
        e(depth, f"{var} = None")
    elif kind == "record":
        items = []
        for field in schema["fields"]:
            item = g.fresh("f")
            _emit_read(g, field["type"], item, depth, stack)
            items.append(f"{field['name']!r}: {item}")
        e(depth, f"{var} = {{{', '.join(items)}}}")
    elif kind in ("map", "array"):
        count, item = g.fresh("c"), g.fresh("x")
        e(depth, f"{var} = {{}}" if kind == "map" else f"{var} = []")
        e(depth, "b = data[pos]")
        e(depth, "pos += 1")
        e(depth, "if not b & 0x81: " + f"{count} = b >> 1")
        e(depth, f"else: {count}, pos = _read_length(data, pos, b)")  # a negative count (sized block): fastavro
        e(depth, f"while {count}:")
        e(depth + 1, f"for _ in range({count}):")
        if kind == "map":
            key = g.fresh("k")
            _emit_read(g, "string", key, depth + 2, stack)
            _emit_read(g, schema["values"], item, depth + 2, stack)
            e(depth + 2, f"{var}[{key}] = {item}")
        else:
            _emit_read(g, schema["items"], item, depth + 2, stack)
            e(depth + 2, f"{var}.append({item})")
        e(depth + 1, "b = data[pos]")
        e(depth + 1, "pos += 1")
        e(depth + 1, "if not b & 0x81: " + f"{count} = b >> 1")
        e(depth + 1, f"else: {count}, pos = _read_length(data, pos, b)")
    else:
        raise _Unsupported(kind)


def _compile(source: str, function: str, constants: dict[str, Any]) -> Callable[..., Any]:
    namespace = dict(_GENERATED_GLOBALS, **constants)
    exec(compile(source, f"<generated {function}>", "exec"), namespace)
    return namespace[function]


def _named_of(schema: Any) -> dict[str, Any]:
    return schema.get("__named_schemas", {}) if isinstance(schema, dict) else {}


def compile_encoder(schema: Any, header: bytes) -> Callable[[Any], bytes]:
    """`header` + the Avro binary encoding of a record of parsed `schema`: a generated function that raises
    _NotPlain for anything it leaves to fastavro (every record, if the schema is not one it compiles)."""
    g = _Gen(_named_of(schema))
    g.emit(0, "def encode(value):")
    g.emit(1, "parts = [HEADER]")
    g.emit(1, "ap = parts.append")
    g.emit(1, "try:")
    try:
        _emit_write(g, schema, "value", 2, ())
    except _Unsupported:
        return _leave_to_fastavro
    g.emit(1, "except Exception:")  # a missing field, an unhashable key, a lone surrogate ...: fastavro decides
    g.emit(2, "raise _NotPlain from None")
    g.emit(1, "return _join(parts)")
    return _compile("\n".join(g.lines) + "\n", "encode", {"HEADER": header, **g.constants})


def compile_decoder(schema: Any, head: dict[str, Any] | None = None) -> Callable[[bytes], dict[str, Any]] | None:
    """The record of single-object encoded bytes written with parsed `schema` (the header is not checked), with
    the items of `head` first; None if the schema is not one it compiles. Raises on anything left to fastavro."""
    schema_named = _named_of(schema)
    g = _Gen(schema_named)
    g.emit(0, "def decode(data):")
    g.emit(1, f"pos = {HEADER_SIZE}")
    g.emit(1, "end = len(data)")
    try:
        resolved, stack = g.resolve(schema, ())
        if not isinstance(resolved, dict) or resolved["type"] != "record":
            return None
        items = [f"{key!r}: {value!r}" for key, value in (head or {}).items()]
        for field in resolved["fields"]:
            item = g.fresh("f")
            _emit_read(g, field["type"], item, 1, stack)
            items.append(f"{field['name']!r}: {item}")
    except _Unsupported:
        return None
    g.emit(1, "if pos != end: raise _NotPlain")
    g.emit(1, f"return {{{', '.join(items)}}}")
    return _compile("\n".join(g.lines) + "\n", "decode", g.constants)


def _leave_to_fastavro(value: Any) -> bytes:
    raise _NotPlain


def _open(target: _Source, mode: str) -> Any:
    if isinstance(target, (str, os.PathLike)):
        return open(target, mode)
    return nullcontext(target)
