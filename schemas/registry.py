"""Every known schema version, self-contained and fingerprinted.

A schema file may refer to a named type of another file by full name (`io.branchsettlement.ledger.Balance`).
Before parsing, each schema is expanded so that it stands alone: the first use of a named type is replaced by
its definition, later uses stay references. This matters for evolution, not only for parsing: the fingerprint is
taken over the Parsing Canonical Form of the expanded schema, so a change to `Balance` changes the fingerprint of
every record that contains it, as it does in the Java implementation.

A file is named after its record, `<Name>.avsc`; a shared type that other files reference is named after its full
name, `<namespace>.<Name>.avsc`, which is where fastavro's plain `load_schema` looks for a referenced type: then
`load_schema(path)` of any file gives the self-contained schema, and the right fingerprint, with no codec at all.

Files in `history/` are older versions, kept to read what was written with them. They are frozen snapshots, so
they must be self-contained: a reference to a current definition would silently change what they describe.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastavro import parse_schema
from fastavro.schema import fingerprint, to_parsing_canonical_form

from branch_settlement.schemas.errors import CodecError

SCHEMA_SUFFIX = ".avsc"
HISTORY_DIR = "history"
SINGLE_OBJECT_MARKER = b"\xc3\x01"
FINGERPRINT_ALGORITHM = "CRC-64-AVRO"

_PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})
_NAMED = frozenset({"record", "error", "enum", "fixed"})


@dataclass(frozen=True, slots=True)
class SchemaVersion:
    """One version of one record schema, parsed by fastavro and ready to read or write."""

    name: str  # short name: "ChildFailed"
    fullname: str  # "io.branchsettlement.events.ChildFailed"
    namespace: str
    fingerprint: bytes  # 8 bytes, little-endian CRC-64-AVRO of the Parsing Canonical Form
    parsed: dict[str, Any]  # fastavro parsed schema, self-contained
    source: Path
    current: bool

    @property
    def header(self) -> bytes:
        """The single-object encoding header: marker C3 01, then the fingerprint."""
        return SINGLE_OBJECT_MARKER + self.fingerprint


@dataclass(frozen=True, slots=True)
class Registry:
    current: dict[str, SchemaVersion]  # short name -> current version
    by_fingerprint: dict[bytes, SchemaVersion]  # every version, current and history
    definitions: dict[str, dict[str, Any]]  # full name -> raw definition of every named type of the current files


def schema_fingerprint(schema: Any) -> bytes:
    """The 8-byte CRC-64-AVRO fingerprint of a self-contained schema, in the little-endian order that the Avro
    single-object encoding writes (fastavro's hex string is already in that byte order)."""
    return bytes.fromhex(fingerprint(to_parsing_canonical_form(schema), FINGERPRINT_ALGORITHM))


def load_registry(schema_dir: Path) -> Registry:
    schema_dir = Path(schema_dir)
    current_raw = {path: _read_json(path) for path in sorted(schema_dir.glob("*" + SCHEMA_SUFFIX))}
    if not current_raw:
        raise CodecError(f"no {SCHEMA_SUFFIX} files in {schema_dir}")
    definitions: dict[str, dict[str, Any]] = {}
    for path, raw in current_raw.items():
        _index_named_types(raw, "", definitions, path)

    current: dict[str, SchemaVersion] = {}
    by_fingerprint: dict[bytes, SchemaVersion] = {}
    for path, raw in current_raw.items():
        version = _version(path, raw, definitions, current=True)
        if path.stem not in (version.name, version.fullname):
            raise CodecError(f"{path}: defines {version.fullname}, expected a record named {path.stem}")
        if version.name in current:
            raise CodecError(f"{path}: short name {version.name} already used by {current[version.name].source}")
        current[version.name] = version
        _add(by_fingerprint, version)

    for path in sorted((schema_dir / HISTORY_DIR).glob("*" + SCHEMA_SUFFIX)):
        version = _version(path, _read_json(path), {}, current=False)
        live = current.get(version.name)
        if live is None or live.fullname != version.fullname:
            raise CodecError(f"{path}: {version.fullname} has no current version to be read into")
        _add(by_fingerprint, version)
    return Registry(current=current, by_fingerprint=by_fingerprint, definitions=definitions)


def expand(schema: Any, definitions: dict[str, dict[str, Any]], namespace: str = "") -> Any:
    """`schema` with every reference to a named type not defined in it replaced by its definition (once)."""
    return _expand(schema, namespace, definitions, set())


def _version(path: Path, raw: Any, definitions: dict[str, dict[str, Any]], *, current: bool) -> SchemaVersion:
    if not isinstance(raw, dict) or raw.get("type") != "record":
        raise CodecError(f"{path}: a schema file holds one record schema")
    standalone = expand(raw, definitions)
    try:
        parsed = parse_schema(standalone)
    except Exception as exc:  # fastavro raises several types for a bad schema; all mean the same here
        raise CodecError(f"{path}: invalid Avro schema: {exc}") from exc
    fullname = parsed["name"]
    namespace, _, name = fullname.rpartition(".")
    return SchemaVersion(
        name=name,
        fullname=fullname,
        namespace=namespace,
        fingerprint=schema_fingerprint(parsed),
        parsed=parsed,
        source=path,
        current=current,
    )


def _add(by_fingerprint: dict[bytes, SchemaVersion], version: SchemaVersion) -> None:
    known = by_fingerprint.get(version.fingerprint)
    if known is not None:
        raise CodecError(f"{version.source}: same canonical form as {known.source}")
    by_fingerprint[version.fingerprint] = version


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CodecError(f"{path}: cannot read schema: {exc}") from exc


def _fullname(name: str, namespace: str) -> str:
    return name if "." in name or not namespace else f"{namespace}.{name}"


def _index_named_types(schema: Any, namespace: str, out: dict[str, dict[str, Any]], path: Path) -> None:
    if isinstance(schema, list):
        for branch in schema:
            _index_named_types(branch, namespace, out, path)
        return
    if not isinstance(schema, dict):
        return
    kind = schema.get("type")
    if kind in _NAMED:
        full = _fullname(schema["name"], schema.get("namespace", namespace))
        if full in out:
            raise CodecError(f"{path}: {full} is defined in more than one schema file")
        out[full] = schema | {"name": full, "namespace": full.rpartition(".")[0]}
        for field in schema.get("fields", ()):
            _index_named_types(field["type"], full.rpartition(".")[0], out, path)
    elif kind == "array":
        _index_named_types(schema["items"], namespace, out, path)
    elif kind == "map":
        _index_named_types(schema["values"], namespace, out, path)


def _expand(schema: Any, namespace: str, definitions: dict[str, dict[str, Any]], defined: set[str]) -> Any:
    if isinstance(schema, list):
        return [_expand(branch, namespace, definitions, defined) for branch in schema]
    if isinstance(schema, str):
        if schema in _PRIMITIVES:
            return schema
        full = _fullname(schema, namespace)
        if full in defined:
            return full
        if full not in definitions:
            raise CodecError(f"unknown type {full}")
        return _expand(definitions[full], namespace, definitions, defined)
    kind = schema["type"]
    if kind in _NAMED:
        full = _fullname(schema["name"], schema.get("namespace", namespace))
        if full in defined:
            raise CodecError(f"{full} is defined twice in one schema")
        defined.add(full)
        own_namespace = full.rpartition(".")[0]
        out = {key: value for key, value in schema.items() if key != "namespace"}
        out["name"] = full
        if "fields" in schema:
            out["fields"] = [
                field | {"type": _expand(field["type"], own_namespace, definitions, defined)}
                for field in schema["fields"]
            ]
        return out
    if kind == "array":
        return schema | {"items": _expand(schema["items"], namespace, definitions, defined)}
    if kind == "map":
        return schema | {"values": _expand(schema["values"], namespace, definitions, defined)}
    if kind in _PRIMITIVES:
        return schema
    return _expand(kind, namespace, definitions, defined)  # {"type": "SomeName"} is a reference too
