"""Avro wire format of branch settlement, the codec API: `Codec` (single-object encoding, the writer schema
resolved by fingerprint, container files, the canonical JSON form), `default_codec`, and the record names
EVENT_TYPES, OUTPUT_TYPES, LEDGER_TYPES.

Records are read and written by readers and writers generated from the schemas (schemas/codegen.py), or by the
compiled module's readers and writers of the same plans (native/, selected by schemas/native.py), which give up
to fastavro on anything unusual, so the bytes, records and errors are fastavro's either way.

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

import hashlib
import io
import os
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from functools import cache
from pathlib import Path
from typing import IO, Any

import fastavro
from fastavro import schemaless_reader, schemaless_writer

from branch_settlement.schemas import native
from branch_settlement.schemas.codegen import NotPlain, check_varints, compile_decoder, compile_encoder
from branch_settlement.schemas.limits import MAX_EVENT_BYTES
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
    "LoanRequested",
    "LoanReturned",
)
OUTPUT_TYPES = ("SettlementResult", "CapacityReleased", "ParentSettled", "LoanRevocationRequested", "AuditRecord",
                "DeadLetter")
# Balance is the shared per-dimension type of outputs and ledger records; it can also be encoded on its own.
LEDGER_TYPES = ("Balance", "LedgerParent", "LedgerChild", "IdempotencyRecord", "TimerRecord", "PartitionMeta")

_Source = str | os.PathLike[str] | IO[bytes]


class Codec:
    """Encoder and decoder of every record of `schema_dir` (by default the packaged `schemas/` directory).

    Schemas are loaded, resolved and parsed once, at construction; a Codec is immutable afterwards and may be
    shared. `default_codec()` returns a shared instance for the packaged schemas.
    """

    def __init__(self, schema_dir: str | os.PathLike[str] = SCHEMA_DIR, implementation: str | None = None) -> None:
        # native.COMPILED or native.PYTHON (schemas/native.py): whose readers and writers run; the same bytes.
        self.implementation = native.select(implementation)
        registry = load_registry(Path(schema_dir))
        self._current = registry.current
        self._headers = {name: version.header for name, version in registry.current.items()}
        self._parsed = {name: version.parsed for name, version in registry.current.items()}
        impl = self.implementation
        self._encoders = {name: compile_encoder(v.parsed, v.header, impl) for name, v in registry.current.items()}
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
            decoder = compile_decoder(v.parsed, HEADER_SIZE, None, impl)
            if decoder is not None:
                self._fast_readers[v.fingerprint] = (v.name, decoder)
            if v.namespace == EVENTS_NAMESPACE:
                event_decoder = compile_decoder(v.parsed, HEADER_SIZE, {"type": v.name}, impl)
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
        except NotPlain:
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
            except NotPlain:
                return slow(name, header, record)

        return encode

    def plain_encoders(self) -> dict[str, Callable[[dict[str, Any]], bytes]]:
        """Per record name, the writer `encode` tries first (compiled or generated, as the implementation is): it
        raises NotPlain for what only fastavro encodes, which `encode` then does."""
        return dict(self._encoders)

    def compiled_event_readers(self) -> dict[bytes, Any]:
        """Per writer fingerprint, the compiled reader `decode_event` tries first for a single-object event (the
        compiled codec's, native/src/lib.rs `Decoder`); empty for the Python codec, and for a codec whose
        `decode_event` is its own."""
        if self.implementation != native.COMPILED or type(self).decode_event is not Codec.decode_event:
            return {}
        decoder = native.module().Decoder
        return {fingerprint: reader for fingerprint, reader in self._fast_event_readers.items()
                if isinstance(reader, decoder)}

    def _encode_with_fastavro(self, name: str, header: bytes, record: dict[str, Any]) -> bytes:
        """fastavro's encoding: what it accepts beyond plain values (a float for a long, a missing field with
        a default, a tuple for an array ...), and the error for what nobody can encode."""
        buffer = io.BytesIO()
        buffer.write(header)
        try:
            schemaless_writer(buffer, self._parsed[name], record)
        except Exception as exc:  # fastavro raises ValueError, TypeError, KeyError, AttributeError ...
            raise CodecError(f"{name}: cannot encode: {fastavro_reason(exc)}") from exc
        return buffer.getvalue()

    def decode(self, data: bytes) -> tuple[str, dict[str, Any]]:
        """(short name, record in the current reader schema) of single-object encoded `data`."""
        if type(data) is bytes and data[:2] == SINGLE_OBJECT_MARKER:
            fast = self._fast_readers.get(data[2:HEADER_SIZE])
            if fast is not None:
                try:
                    return fast[0], fast[1](data)
                except CodecError:
                    raise
                except Exception:  # anything unusual: decoded again below, to fastavro's record or error
                    pass
        return self._decode_with_fastavro(data)

    def _decode_with_fastavro(self, data: bytes) -> tuple[str, dict[str, Any]]:
        if len(data) < HEADER_SIZE:
            raise CodecError(f"truncated single-object header: {len(data)} bytes, need {HEADER_SIZE}")
        if data[:2] != SINGLE_OBJECT_MARKER:
            if data[:1] == b"\x00":
                raise CodecError(f"a Confluent wire format frame (schema id {int.from_bytes(data[1:5], 'big')}): "
                                 "reading it needs the Schema Registry (--schema-registry-url; docs/wire-formats.md)")
            raise CodecError(f"bad single-object marker {bytes(data[:2]).hex()}, expected c301")
        fingerprint = bytes(data[2:HEADER_SIZE])
        try:
            name, writer, reader = self._readers[fingerprint]
        except KeyError:
            raise CodecError(f"unknown writer schema fingerprint {fingerprint.hex()}") from None
        check_varints(writer, data, HEADER_SIZE)  # fastavro would wrap a varint beyond 64 bits around
        body = io.BytesIO(data)
        body.seek(HEADER_SIZE)
        try:
            record = schemaless_reader(body, writer, reader)
        except Exception as exc:  # corrupt input surfaces as EOFError, UnicodeDecodeError, IndexError ...
            raise CodecError(f"{name}: cannot decode body: {fastavro_reason(exc)}") from exc
        if body.tell() != len(data):
            raise CodecError(f"{name}: {len(data) - body.tell()} trailing bytes after the record")
        if reader is not None:
            record = in_schema_order(record, reader)
        return name, record

    def encode_event(self, event: dict[str, Any]) -> bytes:
        """Single-object encoding of a canonical event dict (its "type" names the schema)."""
        return self.encode(self._event_name(event), event)

    def decode_event(self, data: bytes) -> dict[str, Any]:
        """The canonical event dict of single-object encoded `data`; CodecError if it is not an event, or larger
        than an event may be (schemas/limits.py)."""
        if len(data) > MAX_EVENT_BYTES:
            raise CodecError(f"a record of {len(data)} bytes (sha256 {hashlib.sha256(data).hexdigest()}): an event "
                             f"is at most {MAX_EVENT_BYTES}")
        if type(data) is bytes and data[:2] == SINGLE_OBJECT_MARKER:
            fast = self._fast_event_readers.get(data[2:HEADER_SIZE])
            if fast is not None:
                try:
                    return fast(data)
                except CodecError:
                    raise
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
                raise CodecError(f"cannot write container: {fastavro_reason(exc)}") from exc

    def read_container(self, src: _Source) -> Iterator[dict[str, Any]]:
        """Canonical events of an Avro object container file whose schema is a union of event records (as
        `write_container` writes) or one event record. Older schema versions are resolved into the current ones.
        A seekable file object is needed when the file's schema is not the current one.
        """
        with _open(src, "rb") as fo:
            start = fo.tell()
            try:
                blocks = fastavro.block_reader(fo, return_record_name=True)
                reader_schema = self._container_reader_schema(blocks.writer_schema)
                if reader_schema is not None:
                    fo.seek(start)
                    blocks = fastavro.block_reader(fo, reader_schema=reader_schema, return_record_name=True)
                single = None if isinstance(blocks.writer_schema, list) else blocks.writer_schema["name"]
                resolved = reader_schema is not None
                named: dict[str, Any] = {}
                writer = fastavro.parse_schema(blocks.writer_schema, named_schemas=named, _write_hint=False)
                for block in blocks:
                    # fastavro would wrap a varint beyond 64 bits around: each block is checked before it is read
                    check_varints(writer, block.bytes_.getvalue(), block.bytes_.tell(), block.num_records, named)
                    for item in block:
                        fullname, record = (single, item) if single else item
                        name = self._event_names_by_fullname[fullname]
                        if resolved:
                            record = in_schema_order(record, self._parsed[name])
                        yield {"type": name, **record}
            except CodecError:
                raise
            except Exception as exc:
                raise CodecError(f"cannot read container: {fastavro_reason(exc)}") from exc

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


_OBJECT_REPR = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>")


def fastavro_reason(exc: BaseException) -> str:
    """What fastavro's exception says, as a reason that is the same in every process: fastavro names the stream
    it read (`<_io.BytesIO object at 0x7f...>`), whose address would make a dead letter's reason differ between
    the processor and a replay of the same record."""
    return f"{type(exc).__name__}: {_OBJECT_REPR.sub('the record', str(exc))}"


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


def _open(target: _Source, mode: str) -> Any:
    if isinstance(target, (str, os.PathLike)):
        return open(target, mode)
    return nullcontext(target)
