"""The codec a command reads and writes records with, from its settings (docs/wire-formats.md).

    no schema_registry_url                 the single-object encoding (default_codec): reads no Confluent frame
    a schema_registry_url                  ConfluentCodec: reads both formats; writes single-object
    + wire_format confluent, as a writer   registers the schemas (compatibility checked first) and writes
                                           Confluent frames

The URL is a Confluent-compatible Schema Registry (http or https), or `file:PATH`, a registry snapshot: a
JSON document {"schemas": [{"id": N, "subject": S, "schema": TEXT}, ...]}, for reading or writing frames
where a registry's ids are fixed and known (an audit of an export offline, a closed deployment, tests).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from branch_settlement.errors import ConfigError
from branch_settlement.processors.kafka.config import check_wire_format
from branch_settlement.schemas.codec import Codec, default_codec
from branch_settlement.schemas.confluent import ConfluentCodec, SchemaSource, StaticSchemas

log = logging.getLogger("settle")

FILE_SCHEME = "file:"


def codec_for(settings: Any, *, writes: bool) -> Codec:
    """The codec of a command whose settings (a ProcessorConfig, or a command's resolved arguments) are
    `settings`; `writes`: it publishes events or outputs (settle run, settle produce)."""
    wire_format = getattr(settings, "wire_format", None) or "single-object"
    url = getattr(settings, "schema_registry_url", None) or ""
    check_wire_format(wire_format, url)
    if not url:
        return default_codec()
    codec = ConfluentCodec(schema_source(settings))
    if writes and wire_format == "confluent":
        registered = codec.check_and_register()
        log.info("schema registry %s: %d subjects checked and registered (ids %s)", _shown(url), len(registered),
                 ", ".join(f"{r.name} {r.schema_id}" for r in registered))
    return codec


def schema_source(settings: Any) -> SchemaSource:
    url = settings.schema_registry_url
    if url.startswith(FILE_SCHEME):
        return read_snapshot(url[len(FILE_SCHEME):])
    from branch_settlement.processors.kafka.schema_registry import HttpSchemaRegistry

    password = None
    password_file = getattr(settings, "schema_registry_password_file", "") or ""
    if password_file:
        try:
            password = Path(password_file).read_text().strip()
        except OSError as err:
            raise ConfigError(f"schema_registry_password_file {password_file}: {err.strerror or err}") from None
    return HttpSchemaRegistry(url, username=getattr(settings, "schema_registry_username", "") or None,
                              password=password,
                              ca_location=getattr(settings, "schema_registry_ca_location", "") or None)


def read_snapshot(path: str) -> StaticSchemas:
    """A registry snapshot file: {"schemas": [{"id", "subject", "schema"}, ...]}."""
    try:
        document = json.loads(Path(path).read_text())
        schemas = {int(entry["id"]): str(entry["schema"]) for entry in document["schemas"]}
    except OSError as err:
        raise ConfigError(f"schema registry snapshot {path}: {err.strerror or err}") from None
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"schema registry snapshot {path}: expected {{\"schemas\": [{{\"id\", \"subject\", "
                          f"\"schema\"}}, ...]}} ({type(err).__name__}: {err})") from None
    return StaticSchemas(schemas)


def write_snapshot(path: str, registrations: list[tuple[int, str, str]]) -> None:
    """Write a registry snapshot of (id, subject, schema text) entries."""
    Path(path).write_text(json.dumps({"schemas": [{"id": i, "subject": s, "schema": t}
                                                  for i, s, t in registrations]}, indent=2) + "\n")


def _shown(url: str) -> str:
    """The URL without credentials, for logs."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://{rest.split('@', 1)[1]}"
    return url


__all__ = ["codec_for", "schema_source", "read_snapshot", "write_snapshot", "FILE_SCHEME"]
