"""Avro schemas of branch settlement (`*.avsc`, older versions in `history/`) and their codec.
Imports nothing of the namespace but the error root, `branch_settlement.errors`."""

from branch_settlement.schemas.codec import EVENT_TYPES, LEDGER_TYPES, OUTPUT_TYPES, SCHEMA_DIR, Codec, default_codec
from branch_settlement.schemas.errors import CodecError

__all__ = [
    "EVENT_TYPES",
    "LEDGER_TYPES",
    "OUTPUT_TYPES",
    "SCHEMA_DIR",
    "Codec",
    "CodecError",
    "default_codec",
]
