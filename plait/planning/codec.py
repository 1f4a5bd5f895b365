"""One codec for plan files, driven by the dataclass fields and their type hints.

Writing (:func:`encode`) walks a value: a dataclass becomes a JSON object of its init fields,
tuples become lists, mappings objects, and the two leaf types a plan holds, :class:`MeshSpec`
and :class:`TensorLayout`, their documented forms. Reading (:func:`decode`) walks the *type
hints* of the target dataclass, so each field is checked against what it declares
(``int`` refuses ``true``, ``float`` takes any number, ``X | None`` takes ``null``, ...) and
every error names the field's path in the file (``ops[3].inputs[0].dims``).

Three things a record may declare, for its file form to differ from its Python form:

* ``file_order`` (a ``ClassVar`` tuple of attribute names): the order keys are written in,
  when it is not the field order (readers want names first, long lists last).
* ``field(metadata={KEY: "module"})``: the key a field is written under, when not its name.
* ``field(metadata={KEYED_BY: "name"})`` on a ``tuple[Record, ...]`` field: written as an
  object keyed by each record's ``name``, which is then left out of the record's own object.

A field with a default may be missing from a file (files written before it existed load with
the default); one without a default must be there. Unknown keys are refused. Layouts are read
on the mesh read last before them (the plan's mesh comes first in the field order).

The writer :func:`dump` puts small values on one line and spreads big ones out, keys in the
order given, floats by ``float.__repr__``: the same value always gives the same bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union, cast, get_args, get_origin

from plait.errors import PlaitError, PlanError
from plait.layout import TensorLayout
from plait.layout.placement import ReduceOp
from plait.mesh import MeshSpec

__all__ = [
    "KEY",
    "KEYED_BY",
    "Reader",
    "check_header",
    "decode",
    "dump",
    "encode",
    "no_duplicate_keys",
]

KEY = "plait.codec.key"
KEYED_BY = "plait.codec.keyed_by"
WIDTH = 100  # a JSON value that fits in this many columns is written on one line


@dataclass
class Reader:
    """What reading one file carries along: the mesh layouts are read on, the schema read."""

    schema_version: int
    mesh: MeshSpec | None = None


# --------------------------------------------------------------------------- fields


@functools.cache
def _fields(cls: type) -> tuple[dataclasses.Field[Any], ...]:
    """``cls``'s init fields in file order (``cls.file_order`` when it declares one)."""
    fields = [f for f in dataclasses.fields(cls) if f.init]
    order: tuple[str, ...] | None = getattr(cls, "file_order", None)
    if order is None:
        return tuple(fields)
    by_name = {f.name: f for f in fields}
    if sorted(order) != sorted(by_name):
        raise TypeError(f"{cls.__name__}.file_order must name each init field once: {order!r}")
    return tuple(by_name[name] for name in order)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _key(f: dataclasses.Field[Any]) -> str:
    return f.metadata.get(KEY, f.name)


def _has_default(f: dataclasses.Field[Any]) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


# --------------------------------------------------------------------------- leaves


def _layout_data(layout: TensorLayout) -> dict[str, Any]:
    def tm(v: int | tuple[int, ...]) -> int | list[int]:
        return list(v) if isinstance(v, tuple) else v

    return {
        "dims": [list(axes) for axes in layout.dims],
        "partial": list(layout.partial),
        "reduce_op": layout.reduce_op,
        "tensor_map": [tm(v) for v in layout.tensor_map()],
    }


def _layout_from(data: object, path: str, reader: Reader) -> TensorLayout:
    o = _Obj(data, path, reader)
    dims = o.take("dims", tuple[tuple[str, ...], ...], "a list with one list of axis names per dim")
    partial = o.take("partial", tuple[str, ...], "a list of axis names")
    reduce_op = o.take("reduce_op", str, "'sum', 'avg', 'max' or 'min'")
    if reduce_op not in get_args(ReduceOp):
        raise _bad(o.at("reduce_op"), reduce_op, "'sum', 'avg', 'max' or 'min'")
    tensor_map = o.take("tensor_map", list, "MindSpore's tensor map (a list)", None)
    o.done()
    mesh = reader.mesh
    if mesh is None:
        raise PlanError(f"plan file: {path}: a layout needs the plan's mesh, and none was read")
    layout = _build(path, lambda: TensorLayout(mesh, dims, partial, reduce_op))
    expected = _layout_data(layout)["tensor_map"]
    if tensor_map is not None and tensor_map != expected:
        raise PlanError(
            f"plan file: {path}.tensor_map {tensor_map!r} disagrees with dims "
            f"{list(map(list, dims))!r} on mesh {mesh.as_dict()!r} (expected {expected!r}); "
            "edit dims and drop or fix tensor_map"
        )
    return layout


def _mesh_from(data: object, path: str, reader: Reader) -> MeshSpec:
    sizes = _decode(dict[str, int], data, path, reader, "an object {axis name: size}")
    mesh: MeshSpec = _build(path, lambda: MeshSpec.from_dict(sizes))
    reader.mesh = mesh  # the layouts read after this are on this mesh
    return mesh


@dataclass(frozen=True)
class _Leaf:
    encode: Callable[[Any], Any]
    decode: Callable[[object, str, Reader], Any]
    what: str


_LEAVES: dict[type, _Leaf] = {
    MeshSpec: _Leaf(MeshSpec.as_dict, _mesh_from, "a mesh object {axis name: size}"),
    TensorLayout: _Leaf(_layout_data, _layout_from, "a layout object {dims, partial, ...}"),
}


# --------------------------------------------------------------------------- writing


def encode(value: Any) -> Any:
    """``value`` as JSON-ready data (dicts in file order, lists, str, numbers, bool, None)."""
    leaf = _LEAVES.get(type(value))
    if leaf is not None:
        return leaf.encode(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _encode_record(value)
    if isinstance(value, tuple | list):
        return [encode(v) for v in value]
    if isinstance(value, Mapping):
        return {k: encode(v) for k, v in value.items()}
    return value


def _encode_record(record: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cls: type = type(record)
    for f in _fields(cls):
        value = getattr(record, f.name)
        keyed_by = f.metadata.get(KEYED_BY)
        if keyed_by is None:
            out[_key(f)] = encode(value)
            continue
        out[_key(f)] = {
            getattr(item, keyed_by): {
                k: v for k, v in _encode_record(item).items() if k != keyed_by
            }
            for item in value
        }
    return out


def dump(value: Any, indent: int = 0) -> str:
    """JSON with small values on one line and big ones spread out, keys in insertion order.

    Deterministic by construction: only dicts built in a fixed order and lists reach it, and
    floats are written by ``float.__repr__`` (shortest round-tripping form).
    """
    if not isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    flat = _flat_within(value, WIDTH - indent)
    if flat is not None:
        return flat
    pad = " " * (indent + 2)
    if isinstance(value, dict):
        items = [
            f"{pad}{json.dumps(k, ensure_ascii=False)}: {dump(v, indent + 2)}"
            for k, v in value.items()
        ]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [pad + dump(v, indent + 2) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


def _flat_within(value: Any, budget: int) -> str | None:
    """``json.dumps(value)`` on one line if it fits in ``budget`` characters, else None.

    Stops as soon as the budget is spent, so big plans are not dumped flat at every level.
    """
    if isinstance(value, dict):
        parts, used = [], 2
        for k, v in value.items():
            key = json.dumps(k, ensure_ascii=False)
            sub = _flat_within(v, budget - used - len(key) - 2)
            if sub is None:
                return None
            parts.append(f"{key}: {sub}")
            used += len(parts[-1]) + 2
        return "{" + ", ".join(parts) + "}" if used - 2 * bool(parts) <= budget else None
    if isinstance(value, list):
        parts, used = [], 2
        for v in value:
            sub = _flat_within(v, budget - used)
            if sub is None:
                return None
            parts.append(sub)
            used += len(sub) + 2
        return "[" + ", ".join(parts) + "]" if used - 2 * bool(parts) <= budget else None
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    return text if len(text) <= budget else None


# --------------------------------------------------------------------------- reading


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: a repeated key is an error, not a silent win."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise PlanError(f"plan file repeats the key {key!r} in one object; keep one")
        out[key] = value
    return out


def decode(
    cls: type, data: object, reader: Reader, *, path: str = "", header: Collection[str] = ()
) -> Any:
    """Build a ``cls`` record from its file form; ``header`` keys are read by the caller."""
    return _decode_record(cls, data, path, reader, header=header)


def _decode_record(
    cls: type,
    data: object,
    path: str,
    reader: Reader,
    *,
    header: Collection[str] = (),
    given: Mapping[str, Any] | None = None,
) -> Any:
    o = _Obj(data, path, reader)
    o.used.update(header)
    hints = _hints(cls)
    kw: dict[str, Any] = dict(given or {})
    # Field order, not file order: the plan's mesh is read before the layouts that use it.
    for f in (f for f in dataclasses.fields(cls) if f.init and f.name not in kw):
        hint = hints[f.name]
        keyed_by = f.metadata.get(KEYED_BY)
        if keyed_by is not None:
            if _key(f) in o.data or not _has_default(f):
                kw[f.name] = _decode_keyed(hint, keyed_by, o, _key(f), reader)
        elif _key(f) in o.data or not _has_default(f):
            kw[f.name] = o.take(_key(f), hint, _what(hint))
    o.done()
    return _build(path or "the plan", lambda: cls(**kw))


def _decode_keyed(hint: Any, keyed_by: str, o: _Obj, key: str, reader: Reader) -> tuple[Any, ...]:
    """A ``tuple[Record, ...]`` written as ``{record.<keyed_by>: rest of the record}``."""
    (item_cls, _) = get_args(hint)
    entries = o.take(key, dict, "an object {name: {...}}")
    path = o.at(key)
    return tuple(
        _decode_record(item_cls, entry, f"{path}.{name}", reader, given={keyed_by: name})
        for name, entry in entries.items()
    )


def _decode(hint: Any, raw: object, path: str, reader: Reader, what: str | None = None) -> Any:
    """``raw`` (parsed JSON) as a value of type ``hint``; PlanError naming ``path`` if not."""
    origin = get_origin(hint)
    if hint is Any:
        return raw
    if origin in (Union, types.UnionType):
        for alternative in get_args(hint):
            if _matches(alternative, raw):
                return _decode(alternative, raw, path, reader)
        raise _bad(path, raw, what or _what(hint))
    if not _matches(hint, raw):
        raise _bad(path, raw, what or _what(hint))
    if hint in _LEAVES:
        return _LEAVES[hint].decode(raw, path, reader)
    if dataclasses.is_dataclass(hint):
        return _decode_record(cast(type, hint), raw, path, reader)
    if origin is tuple:
        args = get_args(hint)
        item = args[0] if len(args) == 2 and args[1] is Ellipsis else Any
        items = cast("list[Any]", raw)  # _matches saw a JSON array
        return tuple(_decode(item, v, f"{path}[{i}]", reader) for i, v in enumerate(items))
    if origin is dict:
        _, value = get_args(hint)
        entries = cast("dict[str, Any]", raw)  # _matches saw a JSON object
        return {k: _decode(value, v, f"{path}.{k}", reader) for k, v in entries.items()}
    return raw


def _json_kind(hint: Any) -> type | tuple[type, ...]:
    """The Python type(s) ``json.loads`` gives for a value of type ``hint``."""
    origin = get_origin(hint)
    if hint is type(None) or hint is None:
        return type(None)
    if origin is Literal:
        return tuple({type(a) for a in get_args(hint)})
    if hint is float:
        return (int, float)
    if origin in (tuple, list) or hint in (tuple, list):
        return list
    if origin is dict or hint is dict or hint in _LEAVES or dataclasses.is_dataclass(hint):
        return dict
    if isinstance(hint, type):
        return hint
    return object


def _matches(hint: Any, raw: object) -> bool:
    if hint is Any:
        return True
    kind = _json_kind(hint)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # JSON's true/false are Python bools, and bool is an int: only a bool field takes them.
    return isinstance(raw, kind) and (bool in kinds or not isinstance(raw, bool))


def _what(hint: Any) -> str:
    """``hint`` in words, for an error message."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_what(a) for a in get_args(hint))
    if origin is Literal:
        return "one of " + ", ".join(map(repr, get_args(hint)))
    if origin is tuple or hint in (tuple, list):
        return "a list [...]"
    if hint in _LEAVES:
        return _LEAVES[hint].what
    if origin is dict or hint is dict or dataclasses.is_dataclass(hint):
        return "an object {...}"
    words = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    return words.get(hint, "null" if hint in (None, type(None)) else str(hint))


class _Obj:
    """One JSON object of a plan file being read, naming ``path`` in every error."""

    def __init__(self, data: object, path: str, reader: Reader) -> None:
        if not isinstance(data, dict):
            raise _bad(path or "the top level", data, "an object {...}")
        self.data: dict[str, Any] = data
        self.path, self.reader = path, reader
        self.used: set[str] = set()

    def at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def take(self, key: str, hint: Any, what: str, default: Any = ...) -> Any:
        if key not in self.data:
            if default is not ...:
                return default
            raise PlanError(f"plan file: {self.at(key)} is missing; add it (expected {what})")
        self.used.add(key)
        return _decode(hint, self.data[key], self.at(key), self.reader, what)

    def done(self) -> None:
        extra = sorted(set(self.data) - self.used)
        if extra:
            raise PlanError(
                f"plan file: {self.path or 'the top level'} has unknown field(s) {extra!r}; "
                f"remove them (schema_version {self.reader.schema_version} does not define them)"
            )


def _bad(path: str, value: object, what: str) -> PlanError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return PlanError(f"plan file: {path} is {shown}; expected {what}; fix the file or plan again")


def _build(path: str, make: Callable[[], Any]) -> Any:
    """Run a constructor, re-raising its validation error with the field path in front."""
    try:
        return make()
    except PlaitError as e:  # PlanError, LayoutError from a layout or mesh, ...
        raise PlanError(f"plan file: {path}: {e}") from None


def check_header(data: object, schema_version: int, file_format: str) -> None:
    """The version and format keys every plan file starts with; PlanError if they are off."""
    o = _Obj(data, "", Reader(schema_version))
    if "schema_version" not in o.data:
        raise PlanError(
            "plan file has no schema_version: it is not a plait plan file (or was cut short); "
            "make one with plait.plan(...).save(path)"
        )
    version = o.take("schema_version", int, "an integer")
    if version != schema_version:
        newer = version > schema_version
        raise PlanError(
            f"plan file has schema_version {version}; this plait reads version "
            f"{schema_version} only; "
            + ("upgrade plait to read it" if newer else "plan again to write a current file")
        )
    fmt = o.take("format", str, repr(file_format), file_format)
    if fmt != file_format:
        raise _bad("format", fmt, repr(file_format))
