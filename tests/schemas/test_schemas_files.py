"""The .avsc files are plain Avro data that any library reads, and follow the project's schema conventions."""

import json
from pathlib import Path

import pytest
from fastavro.schema import load_schema

from branch_settlement.schemas import EVENT_TYPES, LEDGER_TYPES, OUTPUT_TYPES, SCHEMA_DIR, default_codec
from branch_settlement.schemas.registry import schema_fingerprint

pytestmark = pytest.mark.unit

CURRENT_FILES = sorted(SCHEMA_DIR.glob("*.avsc"))
HISTORY_FILES = sorted((SCHEMA_DIR / "history").glob("*.avsc"))
COMMON_EVENT_FIELDS = ["event_id", "idempotency_key", "parent_id", "occurred_at_ms"]
NAMESPACES = {
    "io.branchsettlement.events": EVENT_TYPES,
    "io.branchsettlement.outputs": OUTPUT_TYPES,
    "io.branchsettlement.ledger": LEDGER_TYPES,
}


def raw(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def walk_types(schema):
    """Every type node of a raw schema, depth first."""
    yield schema
    if isinstance(schema, list):
        for branch in schema:
            yield from walk_types(branch)
    elif isinstance(schema, dict):
        for field in schema.get("fields", ()):
            yield from walk_types(field["type"])
        for key in ("items", "values"):
            if key in schema:
                yield from walk_types(schema[key])


def walk_fields(schema):
    for node in walk_types(schema):
        if isinstance(node, dict):
            yield from node.get("fields", ())


def schema_path(name: str) -> Path:
    """`<Name>.avsc`, or `<full name>.avsc` for a shared type that other files reference."""
    path = SCHEMA_DIR / f"{name}.avsc"
    return path if path.exists() else SCHEMA_DIR / f"{SHARED_TYPES[name]}.{name}.avsc"


SHARED_TYPES = {"Balance": "io.branchsettlement.ledger"}


def test_one_file_per_record_of_the_three_families():
    assert sorted(CURRENT_FILES) == sorted(schema_path(name) for name in EVENT_TYPES + OUTPUT_TYPES + LEDGER_TYPES)
    for namespace, names in NAMESPACES.items():
        for name in names:
            schema = raw(schema_path(name))
            assert (schema["type"], schema["name"], schema["namespace"]) == ("record", name, namespace)


@pytest.mark.parametrize("path", CURRENT_FILES + HISTORY_FILES, ids=lambda p: p.name)
def test_plain_fastavro_load_schema_reads_every_file_without_the_codec(path):
    # A referenced shared type is found through its file name, `<full name>.avsc`, and inlined, so the schema
    # fastavro loads is the whole writer schema: its fingerprint is the one the codec writes.
    parsed = load_schema(str(path))
    assert parsed["name"] == f"{raw(path)['namespace']}.{raw(path)['name']}"
    if path.parent == SCHEMA_DIR:
        assert schema_fingerprint(parsed) == default_codec().version(raw(path)["name"]).fingerprint


def test_every_event_starts_with_the_common_fields_and_has_no_type_field():
    for name in EVENT_TYPES:
        names = [field["name"] for field in raw(SCHEMA_DIR / f"{name}.avsc")["fields"]]
        assert names[:4] == COMMON_EVENT_FIELDS, name
        assert "type" not in names, name


@pytest.mark.parametrize("path", CURRENT_FILES + HISTORY_FILES, ids=lambda p: p.name)
def test_conventions_strings_not_enums_longs_for_times_and_quantities(path):
    schema = raw(path)
    for node in walk_types(schema):
        assert not (isinstance(node, dict) and node.get("type") in ("enum", "float", "double")), node
        if isinstance(node, dict) and node.get("type") == "map" and node["values"] in ("int", "double", "float"):
            pytest.fail(f"{path.name}: per-dimension quantities are map<long>: {node}")
    for field in walk_fields(schema):
        if field["name"].endswith("_ms"):
            assert field["type"] in ("long", ["null", "long"]), (path.name, field)
        if isinstance(field["type"], list):
            assert field["type"][0] == "null", (path.name, field)  # a null default needs null first


def test_history_files_are_older_versions_of_a_current_record():
    assert HISTORY_FILES, "at least one older version proves evolution"
    current = {path.stem for path in CURRENT_FILES}
    for path in HISTORY_FILES:
        name, version, _ = path.name.split(".")
        assert name in current and version.startswith("v"), path.name
        assert raw(path)["name"] == name
        load_schema(str(path), named_schemas={})  # self-contained: a frozen snapshot refers to nothing current
