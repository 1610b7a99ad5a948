"""The one reader and writer of every JSON object the library stores.

Headers, commit markers, the run manifest and layouts are dataclasses; `dumps` writes them as
compact, key-sorted JSON and `loads` reads them back as untrusted input: the bytes are capped,
nesting is capped before the JSON parser sees them, integers must fit an int64, floats must be
finite, duplicate keys are refused, and each field must have exactly its annotated type (nested
records, `tuple[X, ...]`, `X | None`, str enums).  Unknown or missing fields are refused too.
A record's own rules live in its `check()` method, which `loads` calls last.  Every violation
is a `FormatError`, so no other exception type can leave a parse.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from enum import Enum
from functools import cache
from typing import Any, TypeVar, Union, cast, get_args, get_origin

import numpy as np

from .errors import FormatError

__all__ = ["MAX_DEPTH", "dumps", "enum_member", "loads"]

T = TypeVar("T")
E = TypeVar("E", bound=Enum)

MAX_DEPTH = 16
"""Nesting of arrays and objects; every record of the format needs at most 4."""
_INT64 = (-(1 << 63), (1 << 63) - 1)
_SCAN = 1 << 16
"""Bytes the nesting scan looks at a time: its work arrays (about 60 bytes a byte) stay a few MB."""


def dumps(record: Any) -> bytes:
    """Compact, key-sorted JSON of a record (enums as their values, tuples as arrays)."""
    return json.dumps(_plain(record), separators=(",", ":"), sort_keys=True, allow_nan=False).encode()


def loads(data: bytes | memoryview, cls: type[T], *, what: str, max_bytes: int) -> T:
    """Parse `data` as a `cls` record; any violation is a `FormatError` naming `what`."""
    data = bytes(data)
    if len(data) > max_bytes:
        raise FormatError(f"{what} is {len(data)} bytes, more than the {max_bytes} allowed")
    depth = _depth(data)
    if depth > MAX_DEPTH:
        raise FormatError(f"{what} nests {depth} levels deep, more than {MAX_DEPTH}")
    try:
        raw = json.loads(
            data.decode("utf-8"),
            object_pairs_hook=_unique_keys,
            parse_int=_int,
            parse_float=_float,
            parse_constant=_constant,
        )
        record = _convert(raw, cls, cls.__name__)
        check = getattr(record, "check", None)
        if check is not None:
            check()
    except (UnicodeDecodeError, json.JSONDecodeError, _Invalid, ValueError) as err:
        raise FormatError(f"{what} is malformed: {err}") from None
    return record


class _Invalid(Exception):
    """A value the JSON text may hold but a record may not."""


def _depth(data: bytes) -> int:
    """Deepest nesting of brackets outside strings, in one pass of numpy over 64 KiB chunks, nothing
    parsed: linear time and bounded memory whatever the bytes (a regular expression for strings
    backtracks on an unterminated one, in time or memory, and a hostile manifest may be 256 MiB).

    A quote opens or closes a string unless an odd run of backslashes comes right before it; up
    to the first byte that is not JSON, that is exactly where the JSON parser's strings lie.
    """
    raw = np.frombuffer(data, dtype=np.uint8)
    deepest = level = 0
    inside, slashes = False, 0  # in a string, and the backslashes ending the previous chunk
    for start in range(0, raw.size, _SCAN):
        chunk = raw[start : start + _SCAN]
        at = np.arange(chunk.size)
        slash = chunk == ord("\\")
        other = np.maximum.accumulate(np.where(slash, -1, at))  # the last non-backslash up to each byte
        run = np.empty(chunk.size, dtype=np.int64)  # backslashes right before each byte
        run[0] = slashes
        run[1:] = at[1:] - 1 - other[:-1] + np.where(other[:-1] < 0, slashes, 0)
        quote = (chunk == ord('"')) & (run % 2 == 0)
        opened = np.cumsum(quote) + inside  # odd after a byte: a string is open
        outside = (opened - quote) % 2 == 0  # before each byte
        steps = np.zeros(chunk.size, dtype=np.int64)
        steps[((chunk == ord("[")) | (chunk == ord("{"))) & outside] = 1
        steps[((chunk == ord("]")) | (chunk == ord("}"))) & outside] = -1
        levels = np.cumsum(steps) + level
        deepest, level = max(deepest, int(levels.max())), int(levels[-1])
        inside = bool(opened[-1] % 2)
        slashes = int(chunk.size - 1 - other[-1]) + (slashes if other[-1] < 0 else 0)
    return deepest


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _Invalid("an object repeats a key")
    return out


def _int(text: str) -> int:
    if len(text.lstrip("-")) > 19:
        raise _Invalid(f"integer {text[:24]}... does not fit 64 bits")
    value = int(text)
    if not _INT64[0] <= value <= _INT64[1]:
        raise _Invalid(f"integer {value} does not fit 64 bits")
    return value


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Invalid(f"number {text[:24]} is not finite as a float64")
    return value


def _constant(text: str) -> Any:
    raise _Invalid(f"{text} is not JSON")


@cache
def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _convert(raw: Any, kind: Any, where: str) -> Any:
    """`raw` as an instance of the annotation `kind`, or `_Invalid`."""
    origin = get_origin(kind)
    if origin in (Union, types.UnionType):
        for option in get_args(kind):
            if option is type(None) and raw is None:
                return None
        options = [o for o in get_args(kind) if o is not type(None)]
        if raw is not None and len(options) == 1:
            return _convert(raw, options[0], where)
        raise _Invalid(f"{where} must be {' or '.join(_name(o) for o in get_args(kind))}")
    if origin is tuple:
        item = get_args(kind)[0]
        if not isinstance(raw, list):
            raise _Invalid(f"{where} must be an array")
        return tuple(_convert(v, item, f"{where}[{i}]") for i, v in enumerate(raw))
    if dataclasses.is_dataclass(kind):
        record = cast(type, kind)  # a dataclass type, never an instance: annotations are types
        fields = _fields(record)
        if not isinstance(raw, dict) or raw.keys() != fields.keys():
            got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
            raise _Invalid(f"{where} must hold exactly the keys {sorted(fields)}, got {got}")
        return record(**{k: _convert(raw[k], t, f"{where}.{k}") for k, t in fields.items()})
    if isinstance(kind, type) and issubclass(kind, Enum):
        try:
            return kind(raw)
        except ValueError:
            raise _Invalid(f"{where} must be one of {[e.value for e in kind]}, got {raw!r}") from None
    if kind is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
    elif kind is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
    elif kind in (str, bool) and type(raw) is kind:
        return raw
    raise _Invalid(f"{where} must be {_name(kind)}, got {type(raw).__name__}")


def _name(kind: Any) -> str:
    return "null" if kind is type(None) else getattr(kind, "__name__", str(kind))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def enum_member(cls: type[E], value: object) -> E:
    """`value` as a member of `cls`: the member itself, its value, or its name (config files and
    Hydra's `instantiate` spell choices as strings, either way); ValueError otherwise."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        if isinstance(value, str) and value in cls.__members__:
            return cls.__members__[value]
        raise ValueError(f"{value!r} is not one of {[m.name for m in cls]}") from None
