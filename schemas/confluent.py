"""The Confluent wire format, an option beside the single-object encoding, for the Kafka ecosystem's serdes.

    00 | 4-byte big-endian schema id, assigned by a Schema Registry | Avro binary body

The body is the same Avro binary body as in the single-object encoding (schemas/codec.py); only the header
differs: where the single-object encoding names the writer schema by its fingerprint, the Confluent format names
it by the id a Schema Registry gave it. So any Java, Kafka Connect, ksqlDB or other serde that speaks the
Confluent format reads these records with the registry alone.

`ConfluentCodec` is a `Codec`: what it writes as Confluent frames are the records other programs read and write
(the events, `EXTERNAL_TYPES`, and the outputs), each registered under the subject of its full record name (the
"RecordNameStrategy": one topic carries several record types, `capacity-releases` both CapacityReleased and
ParentSettled, so a subject per topic cannot hold them). The processor's own records (the ledger, its
changelog, its ticks) stay single-object encoded: nothing outside reads them, and a restore needs no registry.

It reads both formats, whichever wrote a record: the first byte tells (00, or C3 of the single-object marker).
A Confluent frame whose schema (fetched from the registry once per id) is one this codec knows by fingerprint
is read exactly as its single-object twin (same fast paths, same limits, same errors); another version of a
known record is resolved into the current schema; an id the registry does not know, or a schema of another
record, is a CodecError (so the processor makes it a dead letter). A registry that cannot be reached is not the
record's fault: `SchemaRegistryUnavailable` propagates, the processor stops without committing, and its restart
reads the record again.

The registry itself is behind the small `SchemaSource` protocol (processors/kafka/schema_registry.py has the
HTTP client of the Confluent-compatible REST API), so this module does no I/O of its own.
"""

from __future__ import annotations

import io
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fastavro import parse_schema, schemaless_reader

from branch_settlement.errors import SettlementError
from branch_settlement.schemas.codec import (EVENT_TYPES, HEADER_SIZE, OUTPUT_TYPES, SCHEMA_DIR, Codec,
                                              fastavro_reason, in_schema_order)
from branch_settlement.schemas.codegen import check_varints
from branch_settlement.schemas.errors import CodecError
from branch_settlement.schemas.limits import MAX_EVENT_BYTES
from branch_settlement.schemas.registry import SINGLE_OBJECT_MARKER, _read_json, expand, load_registry, schema_fingerprint

MAGIC = b"\x00"
FRAME_SIZE = 5  # the magic byte and the schema id
# What other programs read or write: Confluent frames under this codec. Tick is the processor's own (ledger-ticks).
EXTERNAL_TYPES = tuple(name for name in EVENT_TYPES + OUTPUT_TYPES if name != "Tick")
MAX_SCHEMA_ID = 2**31 - 1


class SchemaRegistryError(SettlementError):
    """The registry refused something: a schema incompatible with the subject's versions, a bad request."""


class SchemaRegistryUnavailable(SchemaRegistryError):
    """The registry did not answer (connection refused, timed out, 5xx): nothing is wrong with the record."""


class SchemaSource(Protocol):
    """What ConfluentCodec needs of a Schema Registry."""

    def schema_by_id(self, schema_id: int) -> str | None:
        """The schema text registered under `schema_id`, or None if the registry has no such id."""

    def register(self, subject: str, schema: str) -> int:
        """The id of `schema` under `subject`, registering it as the subject's next version if it is new."""

    def incompatibilities(self, subject: str, schema: str) -> list[str]:
        """Why `schema` may not be the subject's next version under its compatibility level; [] if it may (or
        the subject has no version yet)."""


class StaticSchemas:
    """A registry snapshot in memory, {id: schema text}: for shared test vectors, and for reading frames of a
    registry exported to a file. `register` gives the id of a schema it holds under that text (compared by
    Parsing Canonical Form) and refuses any other; it checks no compatibility."""

    def __init__(self, schemas: dict[int, str]) -> None:
        self.schemas = dict(schemas)
        self._ids = {_canonical(text): schema_id for schema_id, text in self.schemas.items()}

    def schema_by_id(self, schema_id: int) -> str | None:
        return self.schemas.get(schema_id)

    def register(self, subject: str, schema: str) -> int:
        try:
            return self._ids[_canonical(schema)]
        except KeyError:
            raise SchemaRegistryError(f"{subject}: this schema is not in the registry snapshot") from None

    def incompatibilities(self, subject: str, schema: str) -> list[str]:
        return []


def _canonical(text: str) -> bytes:
    return schema_fingerprint(parse_schema(json.loads(text), _write_hint=False))


@dataclass(frozen=True)
class Registration:
    name: str  # short record name
    subject: str  # the full record name
    schema_id: int


def subject_of(fullname: str) -> str:
    """RecordNameStrategy: the subject of a record schema is its full name."""
    return fullname


def standalone_schemas(schema_dir: str | Path = SCHEMA_DIR) -> dict[str, str]:
    """Short name -> the current schema of that record as registered: self-contained (named types it uses
    defined inline), with its docs and defaults (compatibility checks need the defaults), compact JSON."""
    registry = load_registry(Path(schema_dir))
    return {name: json.dumps(expand(_read_json(version.source), registry.definitions), separators=(",", ":"))
            for name, version in registry.current.items()}


def frame(schema_id: int, body: bytes) -> bytes:
    return MAGIC + schema_id.to_bytes(4, "big") + body


class ConfluentCodec(Codec):
    """A Codec that writes the records of `external` (default EXTERNAL_TYPES) as Confluent frames with the ids
    their schemas have in `source`, and reads Confluent frames and single-object records alike."""

    def __init__(self, source: SchemaSource, schema_dir: str | Path = SCHEMA_DIR,
                 external: tuple[str, ...] = EXTERNAL_TYPES, implementation: str | None = None) -> None:
        super().__init__(schema_dir, implementation)
        self.source = source
        self.schema_dir = Path(schema_dir)
        self.external = tuple(external)
        self._ids: dict[str, int] = {}  # short name -> id of its current schema (after `register`)
        # schema id -> (single-object header of the same schema, or None), the writer schema's name, and its parsed
        # form with its named types (for a version this codec does not know by fingerprint).
        self._by_id: dict[int, tuple[bytes | None, str, tuple[Any, dict[str, Any] | None]]] = {}
        self._fingerprints = frozenset(self._readers)  # every version the single-object reader knows
        self._lock = threading.Lock()

    # -- registration ----------------------------------------------------------------------------------

    def check_and_register(self) -> list[Registration]:
        """Check every external record's current schema against its subject (a schema the subject's
        compatibility level refuses is a SchemaRegistryError naming every one and why, before anything is
        registered), then register each (an identical schema keeps its id) and encode with those ids."""
        schemas = standalone_schemas(self.schema_dir)
        refused = []
        for name in self.external:
            subject = subject_of(self.version(name).fullname)
            problems = self.source.incompatibilities(subject, schemas[name])
            if problems:
                refused.append(f"{subject}: {'; '.join(problems)}")
        if refused:
            raise SchemaRegistryError("the registry's compatibility rules refuse this version's schemas: "
                                      + " | ".join(refused))
        done = []
        for name in self.external:
            subject = subject_of(self.version(name).fullname)
            schema_id = self.source.register(subject, schemas[name])
            self._ids[name] = schema_id
            self._by_id[schema_id] = (self.version(name).header, name, (self.version(name).parsed, None))
            done.append(Registration(name, subject, schema_id))
        return done

    def schema_id(self, name: str) -> int:
        try:
            return self._ids[name]
        except KeyError:
            raise CodecError(f"{name}: no schema id: the codec's schemas are not registered yet "
                             "(check_and_register)") from None

    # -- writing ---------------------------------------------------------------------------------------

    def encode(self, name: str, record: dict[str, Any]) -> bytes:
        data = super().encode(name, record)
        schema_id = self._ids.get(name)
        return data if schema_id is None else frame(schema_id, data[HEADER_SIZE:])

    def encoder(self, name: str):
        single = super().encoder(name)
        schema_id = self._ids.get(name)
        if schema_id is None:
            return single
        prefix = frame(schema_id, b"")

        def encode(record: dict[str, Any]) -> bytes:
            return prefix + single(record)[HEADER_SIZE:]

        return encode

    # -- reading ---------------------------------------------------------------------------------------

    def decode(self, data: bytes) -> tuple[str, dict[str, Any]]:
        if data[:1] != MAGIC:
            return super().decode(data)
        header, name, writer = self._writer(data)
        if header is not None:
            return super().decode(header + data[FRAME_SIZE:])
        return name, self._resolve(name, writer, data)

    def decode_event(self, data: bytes) -> dict[str, Any]:
        if data[:1] != MAGIC:
            return super().decode_event(data)
        if len(data) > MAX_EVENT_BYTES:
            return super().decode_event(data)  # the size limit's own error, whatever the framing
        header, name, writer = self._writer(data)
        if name not in EVENT_TYPES:
            raise CodecError(f"{name} is not an event")
        if header is not None:
            return super().decode_event(header + data[FRAME_SIZE:])
        return {"type": name, **self._resolve(name, writer, data)}

    def _writer(self, data: bytes) -> tuple[bytes | None, str, Any]:
        if len(data) < FRAME_SIZE:
            raise CodecError(f"truncated Confluent frame: {len(data)} bytes, need {FRAME_SIZE}")
        schema_id = int.from_bytes(data[1:FRAME_SIZE], "big")
        known = self._by_id.get(schema_id)
        if known is not None:
            return known
        text = self.source.schema_by_id(schema_id)  # SchemaRegistryUnavailable propagates: not the record's fault
        if text is None:
            raise CodecError(f"schema id {schema_id} is not in the schema registry")
        try:
            named: dict[str, Any] = {}
            parsed = parse_schema(json.loads(text), named_schemas=named, _write_hint=False)
        except Exception as exc:
            raise CodecError(f"schema id {schema_id}: the registry's schema does not parse: {exc}") from None
        fullname = parsed.get("name") if isinstance(parsed, dict) else None
        name = next((n for n in self.names if self.version(n).fullname == fullname), None)
        if name is None:
            raise CodecError(f"schema id {schema_id} is {fullname or 'not a record'}, not a record of branch "
                             "settlement")
        fingerprint = schema_fingerprint(parsed)
        header = SINGLE_OBJECT_MARKER + fingerprint if fingerprint in self._fingerprints else None
        entry = (header, name, (parsed, named))
        with self._lock:
            self._by_id[schema_id] = entry
        return entry

    def _resolve(self, name: str, writer: Any, data: bytes) -> dict[str, Any]:
        """A record of another version of a known record (a schema this codec has no fingerprint of), resolved
        into the current schema by Avro's rules."""
        reader = self.version(name).parsed
        writer, named = writer
        check_varints(writer, data, FRAME_SIZE, named=named)  # fastavro would wrap a varint beyond 64 bits around
        body = io.BytesIO(data)
        body.seek(FRAME_SIZE)
        try:
            record = schemaless_reader(body, writer, reader)
        except Exception as exc:
            raise CodecError(f"{name}: cannot decode body: {fastavro_reason(exc)}") from exc
        if body.tell() != len(data):
            raise CodecError(f"{name}: {len(data) - body.tell()} trailing bytes after the record")
        return in_schema_order(record, reader)


__all__ = ["MAGIC", "FRAME_SIZE", "EXTERNAL_TYPES", "ConfluentCodec", "Registration", "SchemaSource", "StaticSchemas",
           "SchemaRegistryError", "SchemaRegistryUnavailable", "frame", "standalone_schemas", "subject_of"]
