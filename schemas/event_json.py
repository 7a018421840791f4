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
from collections.abc import Callable
from typing import Any

from schemas.errors import CodecError

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
        return value
    raise _Invalid(f"expected string, got {_show(value)}")


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
