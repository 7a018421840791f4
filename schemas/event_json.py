"""The canonical JSON form of events (SPEC section 12): validation and normalization.

Each event schema is compiled once into a tree of small checking functions, so that validating a parsed JSON
object costs a few dict lookups and `type(...) is` tests per field: this runs for every line of a replayed file.
A checker returns the normalized value (a fresh dict in schema order for records, keys sorted for maps, defaults
filled in) or raises `_Invalid`; the path of the offending field is collected while the exception travels up, so
the happy path never builds a path string.

JSON types map to Avro types strictly: a long or an int is a JSON integer (not a boolean, not a float like 12.0),
a boolean is true/false, a map is an object whose values follow the map's type, a record is an object with no
field the schema does not know.
"""

from __future__ import annotations

import copy
import json
import operator
from collections.abc import Callable
from typing import Any

from branch_settlement.schemas.errors import CodecError

TYPE_FIELD = "type"

_LONG_MIN, _LONG_MAX = -(1 << 63), (1 << 63) - 1
_INT_MIN, _INT_MAX = -(1 << 31), (1 << 31) - 1
_NO_DEFAULT = object()
_SHOWN_CHARS_MAX = 60

Checker = Callable[[Any], Any]


class _Invalid(Exception):
    """A value that does not fit; `where` collects field names from the innermost outwards."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.where: list[str] = []

    def with_where(self, name: str) -> _Invalid:
        self.where.append(name)
        return self


class EventShape:
    """Validator of one event type's JSON form."""

    __slots__ = ("name", "field_names", "_check")

    def __init__(self, name: str, parsed_schema: dict[str, Any]) -> None:
        named = parsed_schema.get("__named_schemas", {})
        self.name = name
        self.field_names = tuple(field["name"] for field in parsed_schema["fields"])
        if TYPE_FIELD in self.field_names:
            raise CodecError(f"{name}: an event schema cannot have a field named {TYPE_FIELD!r}")
        self._check = _record_checker(parsed_schema, named, head={TYPE_FIELD: name})

    def normalize(self, obj: Any) -> dict[str, Any]:
        """The canonical dict of `obj`: "type" first, then every field in schema order. Raises CodecError.

        `obj` is a dict whose "type" named this shape (`event_type_of` checked it).
        """
        try:
            return self._check(obj)
        except _Invalid as exc:
            where = ".".join([self.name, *reversed(exc.where)])
            raise CodecError(f"{where}: {exc.message}") from None


def event_type_of(obj: Any, known: dict[str, EventShape]) -> EventShape:
    if type(obj) is not dict:
        raise CodecError(f"expected a JSON object, got {_show(obj)}")
    try:
        name = obj[TYPE_FIELD]
    except KeyError:
        raise CodecError(f"{TYPE_FIELD}: missing required field") from None
    shape = known.get(name) if type(name) is str else None
    if shape is None:
        raise CodecError(f"{TYPE_FIELD}: unknown event type {_show(name)}")
    return shape


def _show(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= _SHOWN_CHARS_MAX else text[: _SHOWN_CHARS_MAX - 3] + "..."


def _checker(schema: Any, named: dict[str, Any]) -> Checker:
    if isinstance(schema, str):
        if schema in _LEAVES:
            return _LEAVES[schema]
        return _checker(named[schema], named)
    if isinstance(schema, list):
        return _union_checker(schema, named)
    kind = schema["type"]
    if kind == "record":
        return _record_checker(schema, named, head={})
    if kind == "map":
        return _map_checker(_checker(schema["values"], named))
    if kind == "array":
        return _array_checker(_checker(schema["items"], named))
    if kind in _LEAVES:
        return _LEAVES[kind]
    raise CodecError(f"{schema!r} has no canonical JSON form")


def _check_string(value: Any) -> str:
    if type(value) is str:
        if not value.isascii():
            _check_unicode(value)
        return value
    raise _Invalid(f"expected string, got {_show(value)}")


def _check_unicode(value: str) -> None:
    """JSON's escapes can write what no UTF-8 (and so no Avro string) can hold: a lone surrogate."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _Invalid("not valid Unicode text: it holds a lone surrogate (an escape such as \\ud800)") from None


def _check_long(value: Any) -> int:
    if type(value) is int and _LONG_MIN <= value <= _LONG_MAX:
        return value
    raise _Invalid(f"expected integer, got {_show(value)}")


def _check_int(value: Any) -> int:
    if type(value) is int and _INT_MIN <= value <= _INT_MAX:
        return value
    raise _Invalid(f"expected 32-bit integer, got {_show(value)}")


def _check_boolean(value: Any) -> bool:
    if type(value) is bool:
        return value
    raise _Invalid(f"expected boolean, got {_show(value)}")


def _check_null(value: Any) -> None:
    if value is None:
        return None
    raise _Invalid(f"expected null, got {_show(value)}")


_LEAVES: dict[str, Checker] = {
    "string": _check_string,
    "long": _check_long,
    "int": _check_int,
    "boolean": _check_boolean,
    "null": _check_null,
}


def _union_checker(branches: list[Any], named: dict[str, Any]) -> Checker:
    other = [branch for branch in branches if branch != "null"]
    if len(branches) != 2 or len(other) != 1:
        raise CodecError(f"union {branches!r} has no canonical JSON form (only [null, T] has)")
    check = _checker(other[0], named)

    def check_optional(value: Any) -> Any:
        return None if value is None else check(value)

    return check_optional


def _map_checker(check_value: Checker) -> Checker:
    def check_map(value: Any) -> dict[str, Any]:
        if type(value) is not dict:
            raise _Invalid(f"expected object, got {_show(value)}")
        keys = value
        if len(value) > 1:
            try:
                keys = sorted(value)
            except TypeError:
                raise _Invalid(f"expected string keys, got {_show(list(value))}") from None
        out = {}
        for key in keys:
            if type(key) is not str:
                raise _Invalid(f"expected string key, got {_show(key)}")
            if not key.isascii():
                _check_unicode(key)
            try:
                out[key] = check_value(value[key])
            except _Invalid as exc:
                exc.where.append(key)
                raise
        return out

    return check_map


def _array_checker(check_item: Checker) -> Checker:
    def check_array(value: Any) -> list[Any]:
        if type(value) is not list:
            raise _Invalid(f"expected array, got {_show(value)}")
        out = []
        for index, item in enumerate(value):
            try:
                out.append(check_item(item))
            except _Invalid as exc:
                exc.where.append(str(index))
                raise
        return out

    return check_array


def _default_maker(field: dict[str, Any]) -> Callable[[], Any] | None:
    if "default" not in field:
        return None
    default = field["default"]
    if isinstance(default, (dict, list)):
        return lambda: copy.deepcopy(default)
    return lambda: default


def _record_checker(schema: dict[str, Any], named: dict[str, Any], head: dict[str, Any]) -> Checker:
    fields = tuple(
        (field["name"], _checker(field["type"], named), _default_maker(field)) for field in schema["fields"]
    )
    known = frozenset(head) | {name for name, _, _ in fields}
    head_size = len(head)

    def check_record(value: Any) -> dict[str, Any]:
        if type(value) is not dict:
            raise _Invalid(f"expected object, got {_show(value)}")
        out = dict(head)
        present = head_size
        for name, check, make_default in fields:
            try:
                item = value[name]
            except KeyError:
                if make_default is None:
                    raise _Invalid("missing required field").with_where(name) from None
                out[name] = make_default()
                continue
            present += 1
            try:
                out[name] = check(item)
            except _Invalid as exc:
                exc.where.append(name)
                raise
        if present != len(value):
            unknown = sorted(key for key in value if key not in known)
            raise _Invalid("unknown field").with_where(str(unknown[0]))
        return out

    return check_record


# -- the sorted-keys JSON text of an event's fields ------------------------------------------------------------
#
# The fold digests each event's payload as `json.dumps(payload, sort_keys=True, separators=(",", ":"),
# ensure_ascii=False)` (processors/ledger/fold.py). The C encoder behind json.dumps sorts every dict's items and looks at
# every value's type, in the order it finds them; for an event of a known type the keys and their order are known
# in advance. `compile_sorted_json` generates, from an event schema, a function that writes that exact text with
# one f-string per record: keys in sorted order, strings between quotes, ints as `int.__repr__`, true/false/null.
# It only takes what it is sure of: a dict holding exactly the schema's fields (and "type"), each of exactly its
# schema type, map keys of type str, and strings that JSON leaves as they are (no quote, no backslash, no control
# character: checked once on the whole UTF-8 text, by counting those bytes). For anything else it returns None and
# the caller uses json.dumps, so the text is always json.dumps's.


class _NotSure(Exception):
    pass


class _JsonGen:
    def __init__(self, named: dict[str, Any]) -> None:
        self.named = named
        self.lines: list[str] = []
        self._count = 0

    def fresh(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def emit(self, depth: int, text: str) -> None:
        self.lines.append("    " * depth + text)


def _fstring_text(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def _emit_json(g: _JsonGen, schema: Any, var: str, depth: int) -> tuple[str, int]:
    """Emit the checks of `var` against `schema`; return (f-string fragment writing it, quotes in that fragment
    that do not depend on the value; quotes that do are added to `q` by the emitted code)."""
    while isinstance(schema, str) and schema in g.named:
        schema = g.named[schema]
    if isinstance(schema, dict) and schema.get("type") in _LEAVES and "logicalType" not in schema:
        schema = schema["type"]
    e = g.emit
    if isinstance(schema, list):
        other = [branch for branch in schema if branch != "null"]
        if len(schema) != 2 or len(other) != 1:
            raise _NotSure
        text = g.fresh("s")
        e(depth, f"if {var} is None: {text} = 'null'")
        e(depth, "else:")
        fragment, quotes = _emit_json(g, other[0], var, depth + 1)
        e(depth + 1, f"{text} = f'{fragment}'")
        if quotes:
            e(depth + 1, f"q += {quotes}")
        return f"{{{text}}}", 0
    kind = schema if isinstance(schema, str) else schema["type"]
    if kind == "string":
        e(depth, f"if type({var}) is not str: raise _NotSure")
        return f'"{{{var}}}"', 2
    if kind in ("long", "int"):
        e(depth, f"if type({var}) is not int: raise _NotSure")
        return f"{{{var}}}", 0
    if kind == "boolean":
        text = g.fresh("s")
        e(depth, f"if type({var}) is not bool: raise _NotSure")
        e(depth, f"{text} = 'true' if {var} else 'false'")
        return f"{{{text}}}", 0
    if kind == "null":
        e(depth, f"if {var} is not None: raise _NotSure")
        return "null", 0
    if kind == "record":
        fields = sorted(schema["fields"], key=lambda field: field["name"])
        e(depth, f"if type({var}) is not dict or len({var}) != {len(fields)}: raise _NotSure")
        parts, quotes = [], 0
        for field in fields:
            item = g.fresh("v")
            e(depth, f"{item} = {var}[{field['name']!r}]")
            fragment, field_quotes = _emit_json(g, field["type"], item, depth)
            parts.append(_fstring_text(f'"{field["name"]}":') + fragment)
            quotes += 2 + field_quotes
        return "{{" + ",".join(parts) + "}}", quotes
    if kind == "map":
        text, key, item = g.fresh("s"), g.fresh("k"), g.fresh("x")
        e(depth, f"if type({var}) is not dict: raise _NotSure")
        e(depth, f"{text} = []")
        e(depth, f"for {key} in sorted({var}):")  # keys of several types: TypeError, json.dumps decides
        e(depth + 1, f"if type({key}) is not str: raise _NotSure")
        e(depth + 1, f"{item} = {var}[{key}]")
        fragment, quotes = _emit_json(g, schema["values"], item, depth + 1)
        e(depth + 1, f"{text}.append(f'\"{{{key}}}\":{fragment}')")
        e(depth, f"q += {quotes + 2} * len({var})")
        return f"{{{{{{_join({text})}}}}}}", 0
    if kind == "array":
        text, item = g.fresh("s"), g.fresh("x")
        e(depth, f"if type({var}) is not list: raise _NotSure")
        e(depth, f"{text} = []")
        e(depth, f"for {item} in {var}:")
        fragment, quotes = _emit_json(g, schema["items"], item, depth + 1)
        e(depth + 1, f"{text}.append(f'{fragment}')")
        e(depth, f"q += {quotes} * len({var})")
        return f"[{{_join({text})}}]", 0
    raise _NotSure


def compile_sorted_json(name: str, parsed_schema: dict[str, Any], leave_out: tuple[str, ...] = ()
                        ) -> Callable[[dict[str, Any]], bytes | None]:
    """The function giving the UTF-8 of json.dumps(event without `leave_out`, sort_keys=True, separators=(",", ":"),
    ensure_ascii=False) for an event dict of type `name` (parsed_schema: its event schema), or None when it is not
    sure (see above)."""
    g = _JsonGen(parsed_schema.get("__named_schemas", {}))
    fields = {field["name"]: field["type"] for field in parsed_schema["fields"]}
    fields[TYPE_FIELD] = {"type": "string"}
    kept = sorted(key for key in fields if key not in leave_out)
    g.emit(0, "def sorted_json(event):")
    g.emit(1, "try:")
    g.emit(2, f"if type(event) is not dict or len(event) != {len(fields)}: return None")
    for key in fields:
        if key in leave_out:
            g.emit(2, f"if {key!r} not in event: return None")
    names = [g.fresh("v") for _ in kept]
    g.emit(2, f"{', '.join(names)}{',' if len(names) == 1 else ''} = _get(event)")
    g.emit(2, "q = 0")
    parts, quotes = [], 0
    try:
        for key, item in zip(kept, names):
            fragment, key_quotes = _emit_json(g, fields[key], item, 2)
            parts.append(_fstring_text(f'"{key}":') + fragment)
            quotes += 2 + key_quotes
    except _NotSure:
        return lambda event: None
    g.emit(2, "data = f'{{" + ",".join(parts) + "}}'.encode()")  # a lone surrogate: UnicodeEncodeError
    g.emit(1, "except Exception:")  # a missing field, keys json.dumps would sort otherwise ...: json.dumps decides
    g.emit(2, "return None")
    # Quotes, backslashes and control characters are the bytes json.dumps escapes; the text must hold no more of
    # them than the quotes it was written with (UTF-8 bytes of other characters are all >= 0x80).
    g.emit(1, f"if len(data) - len(data.translate(None, _ESCAPED)) != q + {quotes}: return None")
    g.emit(1, "return data")
    namespace = {"_NotSure": _NotSure, "_get": operator.itemgetter(*kept), "_join": ",".join,
                 "_ESCAPED": bytes(range(0x20)) + b'"\\'}
    exec(compile("\n".join(g.lines) + "\n", f"<sorted json of {name}>", "exec"), namespace)
    return namespace["sorted_json"]


# Plan kinds of the compiled sorted-JSON digest (native/src/lib.rs, SortedJsonDigest).
_JSON_PLAN = {"null": 0, "boolean": 1, "long": 2, "int": 2, "string": 3}
_JSON_RECORD, _JSON_MAP, _JSON_ARRAY, _JSON_UNION = 5, 6, 7, 8


def sorted_json_plan(parsed_schema: dict[str, Any], leave_out: tuple[str, ...] = ()) -> tuple | None:
    """What `compile_sorted_json` generates for the event schema, as data for the compiled module: (the count of
    the event's keys, the keys left out, the kept keys sorted, a plan per kept key); None where the generated
    function is never sure (it then always returns None). The same walk as `_emit_json`."""
    named = parsed_schema.get("__named_schemas", {})
    fields = {field["name"]: field["type"] for field in parsed_schema["fields"]}
    fields[TYPE_FIELD] = {"type": "string"}
    kept = sorted(key for key in fields if key not in leave_out)
    try:
        plans = tuple(_json_plan(named, fields[key]) for key in kept)
    except _NotSure:
        return None
    return (len(fields), tuple(key for key in fields if key in leave_out), tuple(kept), plans)


def _json_plan(named: dict[str, Any], schema: Any) -> tuple:
    while isinstance(schema, str) and schema in named:
        schema = named[schema]
    if isinstance(schema, dict) and schema.get("type") in _LEAVES and "logicalType" not in schema:
        schema = schema["type"]
    if isinstance(schema, list):
        other = [branch for branch in schema if branch != "null"]
        if len(schema) != 2 or len(other) != 1:
            raise _NotSure
        return (_JSON_UNION, _json_plan(named, other[0]))
    kind = schema if isinstance(schema, str) else schema["type"]
    if kind in _JSON_PLAN:
        return (_JSON_PLAN[kind],)
    if kind == "record":
        fields = sorted(schema["fields"], key=lambda field: field["name"])
        return (_JSON_RECORD, tuple(field["name"] for field in fields),
                tuple(_json_plan(named, field["type"]) for field in fields))
    if kind == "map":
        return (_JSON_MAP, _json_plan(named, schema["values"]))
    if kind == "array":
        return (_JSON_ARRAY, _json_plan(named, schema["items"]))
    raise _NotSure
