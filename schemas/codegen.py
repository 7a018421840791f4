"""Avro binary readers and writers generated from the schemas: the fast path under `Codec` (schemas/codec.py).

Why they exist: fastavro interprets the schema again for every value it writes or reads (and `schemaless_reader`
re-checks the schema on every call), and the fold decodes one event and encodes a result, an audit record or two
and a few ledger records per event. So each current schema is compiled once into the Python source of one
function that writes (or reads) a whole record with its fields unrolled: no call per field, no dispatch on the
schema, nested records, maps and arrays inlined. What that saves is measured in docs/benchmarks.md (History).

Neither kind decides anything fastavro would decide differently; each gives up to fastavro instead:

A generated writer takes only plain values: exactly str, int, bool, bytes, None, dict, list, and every record
field present. On anything else (or any exception at all) it raises NotPlain and `Codec.encode` hands the record
to fastavro, whose encoding or error it returns; so a record is encoded exactly as fastavro encodes it, whatever
it holds. The bytes are the Avro binary encoding: zig-zag varints, length-prefixed UTF-8, a union's branch index,
a map or an array as one block of all its items then an empty block (tests/ledger/test_fold_perf_equivalence.py compares
them with fastavro's for every schema).

A generated reader decodes only bytes written by the *current* schema of a record (a history version is resolved
by fastavro) and only the canonical encodings a reader can take at their word: positive block counts, union
branch indexes 0 and 1, lengths that fit, varints below 2**64, strict UTF-8, no trailing bytes. On anything else
it raises (NotPlain, IndexError, UnicodeDecodeError ...) and `Codec.decode` decodes the record again the plain
way, so a record decodes to exactly what fastavro returns, or fails with exactly the same CodecError.

A schema the generator does not compile (a recursive type, a union of several types, an enum ...) gets no
reader (`compile_decoder` returns None) and a writer that leaves every record to fastavro.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from branch_settlement.schemas import native
from branch_settlement.schemas.errors import CodecError

_LONG_MIN, _LONG_MAX = -(1 << 63), (1 << 63) - 1
_NULL = "null"


class NotPlain(Exception):
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
    """Zig-zag varint of a long; NotPlain outside the long range (fastavro then decides)."""
    if not _LONG_MIN <= value <= _LONG_MAX:
        raise NotPlain
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
    beyond = 0  # the bits past the 70th, OR-ed, not shifted: a long run of bytes costs linear time
    while True:
        b = data[pos]
        pos += 1
        if shift < 70:
            n |= (b & 0x7F) << shift
        else:
            beyond |= b & 0x7F
        shift += 7
        if b < 0x80:
            break
    if beyond or n >> 64:  # no long has it: fastavro would wrap it around to a small number, so refuse it here
        raise CodecError(f"a varint at byte {pos} is beyond the 64 bits of an Avro long")
    return (n >> 1) ^ -(n & 1), pos


def _read_length(data: bytes, pos: int, first: int) -> tuple[int, int]:
    n, pos = (first >> 1 ^ -(first & 1), pos) if first < 0x80 else _read_varint(data, pos, first)
    if n < 0:
        raise NotPlain
    return n, pos


def check_varints(schema: Any, data: bytes, pos: int, count: int = 1, named: dict[str, Any] | None = None) -> int:
    """Walk `count` records of parsed writer `schema` in `data` from `pos`, as fastavro will read them, and raise
    CodecError at a varint beyond 64 bits, which fastavro wraps around to a small number (a quantity of 2**64 + 5
    would be booked as 5). Run before fastavro reads what the generated readers leave to it: a sized block (a
    negative count), an older writer schema, a Confluent frame of another version, a container file's block.
    It also refuses what would make fastavro loop for ever or lose its place: a block of more items than bytes
    left, `count` records in fewer bytes, a sized block whose byte size disagrees with its items. Bytes it cannot
    walk (truncated, a bad branch ...) it leaves to fastavro's own error. Returns the end position (or -1 where it
    stopped early)."""
    if named is None:
        named = _named_of(schema)
    if count > 1 and count > len(data) - pos:
        raise CodecError(f"{count} records in {len(data) - pos} bytes")  # fastavro would loop over them all
    try:
        for _ in range(count):
            start = pos
            pos = _scan(schema, data, pos, named)
            if pos == start:
                break  # records of no width: the rest read no byte either
        return pos
    except CodecError:
        raise
    except Exception:  # noqa: BLE001 - truncated, a bad branch, too deep ...: fastavro's error, not ours
        return -1


def _scan_long(data: bytes, pos: int) -> tuple[int, int]:
    b = data[pos]
    return (b >> 1 ^ -(b & 1), pos + 1) if b < 0x80 else _read_varint(data, pos + 1, b)


_FIXED_WIDTH = {"boolean": 1, "float": 4, "double": 8, "null": 0}


def _scan(schema: Any, data: bytes, pos: int, named: dict[str, Any]) -> int:
    if isinstance(schema, list):
        index, pos = _scan_long(data, pos)
        if not 0 <= index < len(schema):
            raise IndexError(index)
        return _scan(schema[index], data, pos, named)
    if isinstance(schema, str):
        if schema in named:
            return _scan(named[schema], data, pos, named)
        kind = schema
    else:
        kind = schema["type"]
        if isinstance(kind, (dict, list)) or (isinstance(kind, str) and kind in named):
            return _scan(kind, data, pos, named)
    if kind in ("int", "long", "enum"):
        return _scan_long(data, pos)[1]
    if kind in ("string", "bytes"):
        size, pos = _scan_long(data, pos)
        if size < 0 or pos + size > len(data):
            raise IndexError(size)
        return pos + size
    if kind in _FIXED_WIDTH or kind == "fixed":
        end = pos + (_FIXED_WIDTH[kind] if kind in _FIXED_WIDTH else schema["size"])
        if end > len(data):
            raise IndexError(end)
        return end
    if kind == "record":
        for field in schema["fields"]:
            pos = _scan(field["type"], data, pos, named)
        return pos
    if kind in ("array", "map"):
        item = schema["items"] if kind == "array" else schema["values"]
        while True:
            block, pos = _scan_long(data, pos)
            if block == 0:
                return pos
            size = None
            if block < 0:  # a sized block: its byte size follows (fastavro seeks past it where it skips a field)
                block = -block
                size, pos = _scan_long(data, pos)
            if block > len(data) - pos:
                # more items than bytes left: fastavro reads booleans or nulls past the end without failing,
                # 2**62 times over (a hang); no record of ours has such a block
                raise CodecError(f"a block of {block} items at byte {pos}: {len(data) - pos} bytes follow")
            first = pos
            for _ in range(block):
                start = pos
                if kind == "map":
                    pos = _scan("string", data, pos, named)
                pos = _scan(item, data, pos, named)
                if pos == start:
                    break  # items of no width: the rest of the block reads no byte either
            if size is not None and pos != first + size:
                # a reader skipping the block would land elsewhere than one reading it: no walk can be sure
                raise CodecError(f"a block of {block} items at byte {first} says it is {size} bytes long, "
                                 f"its items take {pos - first}")
    raise IndexError(kind)


_GENERATED_GLOBALS = {
    "NotPlain": NotPlain,
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
        e(depth, f"if type({var}) is not int: raise NotPlain")
        e(depth, f"ap(_lc_get({var}) or _long_bytes({var}))")  # never empty: a cached encoding is truthy
    elif kind == "string":
        e(depth, f"if type({var}) is not str: raise NotPlain")
        e(depth, f"ap(_sc_get({var}) or _string_bytes({var}))")
    elif kind == "bytes":
        e(depth, f"if type({var}) is not bytes: raise NotPlain")
        e(depth, f"n = len({var})")
        e(depth, "ap(_lc_get(n) or _long_bytes(n))")
        e(depth, f"ap({var})")
    elif kind == "boolean":
        e(depth, f"if type({var}) is not bool: raise NotPlain")
        e(depth, f"ap(_BOOL[{var}])")
    elif kind == "null":
        e(depth, f"if {var} is not None: raise NotPlain")
    elif kind == "record":
        e(depth, f"if type({var}) is not dict: raise NotPlain")
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
        e(depth, f"if type({var}) is not {'dict' if kind == 'map' else 'list'}: raise NotPlain")
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
        e(depth, "else: raise NotPlain")
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


# Plan kinds, numbered as native/src/lib.rs reads them (schemas/native.py: PLAN_VERSION).
_PLAN_KINDS = {"null": 0, "boolean": 1, "long": 2, "int": 2, "string": 3, "bytes": 4}
_PLAN_RECORD, _PLAN_MAP, _PLAN_ARRAY, _PLAN_UNION = 5, 6, 7, 8


def _plan(g: _Gen, schema: Any, stack: tuple[str, ...], writing: bool) -> tuple[Any, ...]:
    """What `_emit_write` (writing) or `_emit_read` generates for `schema`, as data for the compiled module: nested
    tuples, the kind first. The same resolution and the same refusals (_Unsupported), so the compiled reader and
    writer take exactly the schemas the generated ones take."""
    schema, stack = g.resolve(schema, stack)
    if isinstance(schema, list):
        if writing:
            other = [branch for branch in schema if branch != _NULL]
            if len(schema) != 2 or len(other) != 1 or g.resolve(other[0], stack)[0] in ("int", _NULL):
                raise _Unsupported("union")  # a null spelled as a type object: the generated writer decides
        elif len(schema) > 64:
            raise _Unsupported("union")
        return (_PLAN_UNION, tuple(_plan(g, branch, stack, writing) for branch in schema))
    kind = schema if isinstance(schema, str) else schema["type"]
    if kind in _PLAN_KINDS:
        return (_PLAN_KINDS[kind],)
    if kind == "record":
        fields = schema["fields"]
        return (_PLAN_RECORD, tuple(field["name"] for field in fields),
                tuple(_plan(g, field["type"], stack, writing) for field in fields))
    if kind == "map":
        return (_PLAN_MAP, _plan(g, schema["values"], stack, writing))
    if kind == "array":
        return (_PLAN_ARRAY, _plan(g, schema["items"], stack, writing))
    raise _Unsupported(kind)


def compile_encoder(schema: Any, header: bytes, implementation: str = native.PYTHON) -> Callable[[Any], bytes]:
    """`header` + the Avro binary encoding of a record of parsed `schema`: a function that raises NotPlain for
    anything it leaves to fastavro (every record, if the schema is not one it compiles). `implementation`
    native.COMPILED: the compiled module's writer of the same plan (where it compiles the schema)."""
    if implementation == native.COMPILED:
        try:
            return native.module().Encoder(_plan(_Gen(_named_of(schema)), schema, (), True), header, NotPlain)
        except _Unsupported:
            pass  # the generated writer decides, as below
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
    g.emit(2, "raise NotPlain from None")
    g.emit(1, "return _join(parts)")
    return _compile("\n".join(g.lines) + "\n", "encode", {"HEADER": header, **g.constants})


def compile_decoder(schema: Any, header_size: int, head: dict[str, Any] | None = None,
                    implementation: str = native.PYTHON) -> Callable[[bytes], dict[str, Any]] | None:
    """The record of single-object encoded bytes written with parsed `schema` (the first `header_size` bytes, the
    header, are not checked), with the items of `head` first; None if the schema is not one it compiles. Raises on
    anything left to fastavro. `implementation` native.COMPILED: the compiled module's reader of the same plan."""
    if implementation == native.COMPILED:
        g = _Gen(_named_of(schema))
        try:
            resolved, stack = g.resolve(schema, ())
            if isinstance(resolved, dict) and resolved["type"] == "record":
                return native.module().Decoder(_plan(g, resolved, stack, False), header_size, dict(head or {}),
                                               NotPlain, CodecError)
        except _Unsupported:
            pass  # the generated reader decides, as below
    schema_named = _named_of(schema)
    g = _Gen(schema_named)
    g.emit(0, "def decode(data):")
    g.emit(1, f"pos = {header_size}")
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
    g.emit(1, "if pos != end: raise NotPlain")
    g.emit(1, f"return {{{', '.join(items)}}}")
    return _compile("\n".join(g.lines) + "\n", "decode", g.constants)


def _leave_to_fastavro(value: Any) -> bytes:
    raise NotPlain
