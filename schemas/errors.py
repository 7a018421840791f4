"""The one error of the wire format, a branch of the error root (a ValueError too: bytes or JSON that do not
fit a schema are a bad value)."""

from __future__ import annotations

from branch_settlement.errors import SettlementError


class CodecError(SettlementError, ValueError):
    """Bytes, a JSON object or a schema file that does not fit the Avro schemas of `schemas/`.

    Raised by `Codec.decode*` (bad marker, unknown writer fingerprint, truncated or trailing bytes), by
    `Codec.encode*` (a record that does not fit its schema), by `Codec.event_from_json` (the message names the
    field: ``ChildReserved.quantities.tokens: expected integer, got 12.5``) and when the schema directory
    itself is inconsistent (unknown type reference, a name defined twice, a file named after another record).

    For input records this is expected bad input: the processor turns it into a dead letter with this message as
    the reason and goes on. Raised while loading schemas it is a packaging bug: fix the `.avsc` files.
    """
