"""Kimi K2.5 tool declarations: the TypeScript-style ``tool_declare`` body.

K2.5's tokenizer code does not hand ``tools`` to its template as JSON. It first sorts
every dict in the tool list by key (recursively), then turns each ``{"type":
"function", "function": {...}}`` entry into a TypeScript type inside ``namespace
functions``; the template prints that string, and prints the tool list as JSON only when
the conversion yields nothing or fails. Behaviour reproduced here (learned from the
pinned oracles in ``tests/test_chat_k25_oracle.py``, not copied from them):

* one ``type NAME = (_: {...}) => any;`` per function, preceded by its description as
  ``//`` comment lines, and by ``interface`` blocks for ``$defs`` (and for the
  parameters object itself when a schema refers to it with ``"$ref": "#"``);
* object fields: required ones first, then optional ones (``name?``), each group sorted
  by name, each preceded by its description, its constraints and its default;
* ``integer`` prints as ``number``; ``enum`` as a ``|`` list; ``anyOf`` and type lists as
  unions; arrays as ``Array<...>``; ``additionalProperties`` as ``[k: string]: ...``.

Where the reference encoder raises (an unresolved ``$ref``, an enum value of the wrong
type, a schema node it does not recognise, ...) the template falls back to JSON.
Schemas outside the well-typed subset (a description that is not a string, a
``properties`` that is not an object, ...) are declared by the same JSON fallback and
reported as unproven, since what the reference does with them depends on accidents of
its implementation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal
from collections.abc import Mapping, Sequence

from ..jsonl import value_key

__all__ = ["ToolDeclaration", "declare_tools", "sort_keys_deep"]

_INDENT = "  "
_UNION_NAMES = {
    "string": "string",
    "number": "number",
    "integer": "number",
    "boolean": "boolean",
    "null": "null",
    "object": "{}",
    "array": "Array<any>",
}
_CONSTRAINT_KEYS = {
    "string": ("maxLength", "minLength", "pattern"),
    "number": ("maximum", "minimum"),
    "integer": ("maximum", "minimum"),
}
_ARRAY_CONSTRAINT_KEYS = ("minItems", "maxItems")


@dataclass(frozen=True)
class ToolDeclaration:
    """The ``tool_declare`` body for one request and how far it is proven."""

    text: str
    form: Literal["typescript", "json"]
    #: Why a JSON declaration was chosen (None for TypeScript).
    reason: str | None = None
    #: True when the fallback is certain (the reference encoder fails or yields
    #: nothing); False when the tools are outside the subset reproduced exactly.
    certain: bool = True


class _Fallback(Exception):
    """The reference encoder fails here: the template declares the tools as JSON."""


class _Unsupported(Exception):
    """Outside the well-typed schema subset whose rendering is reproduced exactly."""


def sort_keys_deep(value: Any) -> Any:
    """Every dict's keys in sorted order, at every depth (lists keep their order; a tuple
    is the list it is sent as, so a declaration depends only on the JSON the API gets)."""
    if isinstance(value, Mapping):
        return {k: sort_keys_deep(value[k]) for k in sorted(value)}
    if isinstance(value, list | tuple):
        return [sort_keys_deep(v) for v in value]
    return value


#: Declarations already built, by :func:`~tokenbridge.jsonl.value_key` of the tool list: a
#: dataset sends one tool list with every request, and the prompt and the gate each need
#: its declaration (34 us for two functions; the key costs 0.6 us). Cleared when full.
_DECLARED: dict[bytes, ToolDeclaration] = {}
_DECLARED_MAX = 256


def declare_tools(tools: Sequence[Any]) -> ToolDeclaration:
    """The declaration K2.5 renders for a non-empty ``tools`` list."""
    tools = list(tools)
    key = value_key(tools)
    if key is None:
        return _declare(tools)
    decl = _DECLARED.get(key)
    if decl is None:
        if len(_DECLARED) >= _DECLARED_MAX:
            _DECLARED.clear()
        decl = _DECLARED[key] = _declare(tools)
    return decl


def _declare(tools: list[Any]) -> ToolDeclaration:
    ordered = sort_keys_deep(tools)
    try:
        return ToolDeclaration(_typescript(ordered), "typescript")
    except _Fallback as e:
        return ToolDeclaration(_json(ordered), "json", str(e), certain=True)
    except _Unsupported as e:
        return ToolDeclaration(_json(ordered), "json", str(e), certain=False)


def _json(tools: Any) -> str:
    return json.dumps(tools, ensure_ascii=False, separators=(",", ":"))


# --- schema tree -----------------------------------------------------------------


@dataclass
class _Node:
    kind: Literal["scalar", "object", "array", "enum", "anyof", "union", "ref"]
    description: str = ""
    constraints: dict[str, Any] = field(default_factory=dict)
    name: str = ""  # scalar type name / ref target name
    fields: list[_Field] = field(default_factory=list)
    extra: _Node | bool | None = None  # additionalProperties
    items: list[_Node] = field(default_factory=list)  # array item / anyOf members
    literals: list[str] = field(default_factory=list)  # enum / union members, printed


@dataclass
class _Field:
    name: str
    node: _Node
    optional: bool
    default: Any


@dataclass
class _Registry:
    defs: dict[str, Any] = field(default_factory=dict)
    self_ref: bool = False


def _describe(schema: Mapping[str, Any]) -> str:
    desc = schema.get("description", "")
    if not isinstance(desc, str):
        raise _Unsupported(f"description is {type(desc).__name__}, not a string")
    return desc


def _parse(schema: Any, reg: _Registry) -> _Node:  # noqa: PLR0911 - one node per schema keyword, in the reference's order
    """One schema node, in the order the reference walks it (refs resolve as met)."""
    if isinstance(schema, bool):
        return _Node("scalar", name="any" if schema else "null")
    if not isinstance(schema, Mapping):
        raise _Unsupported(f"schema node is {type(schema).__name__}, not an object")
    if "$ref" in schema:
        return _parse_ref(schema, reg)
    if "anyOf" in schema:
        members = schema["anyOf"]
        if not isinstance(members, list):
            raise _Unsupported("anyOf is not a list")
        return _Node("anyof", _describe(schema), items=[_parse(m, reg) for m in members])
    if "enum" in schema:
        return _parse_enum(schema)
    if "type" in schema:
        typ = schema["type"]
        if isinstance(typ, list):
            try:
                names = [_UNION_NAMES[t] for t in typ]
            except (KeyError, TypeError):
                raise _Fallback(f"type list {typ!r} names a type with no TypeScript form") from None
            return _Node("union", _describe(schema), literals=names)
        if not isinstance(typ, str):
            raise _Unsupported(f"type is {type(typ).__name__}, not a string or list")
        if typ == "object":
            return _parse_object(schema, reg)
        if typ == "array":
            return _parse_array(schema, reg)
        keys = _CONSTRAINT_KEYS.get(typ, ())
        return _Node("scalar", _describe(schema), {k: schema[k] for k in keys if k in schema}, name=typ)
    if not schema:
        return _Node("scalar", name="any")
    raise _Fallback(f"schema node without $ref/anyOf/enum/type: {sorted(schema)}")


def _parse_ref(schema: Mapping[str, Any], reg: _Registry) -> _Node:
    ref = schema["$ref"]
    if not isinstance(ref, str):
        raise _Unsupported("$ref is not a string")
    desc = _describe(schema)
    if ref == "#":
        reg.self_ref = True
        return _Node("ref", desc, name="parameters")
    if ref.startswith("#/$defs/"):
        name = ref.split("/")[-1]
        if name not in reg.defs:
            raise _Fallback(f"$ref {ref!r} names no $defs entry seen so far")
        return _Node("ref", desc, name=name)
    raise _Fallback(f"$ref {ref!r} is not local (#/$defs/...)")


def _parse_enum(schema: Mapping[str, Any]) -> _Node:
    values = schema["enum"]
    if not isinstance(values, list) or not all(v is None or isinstance(v, (str, int, float)) for v in values):
        raise _Unsupported("enum is not a list of scalars")
    if "type" in schema:
        _check_enum_type(schema["type"], values)
    printed = [f'"{v}"' if isinstance(v, str) else str(v) for v in values]
    return _Node("enum", _describe(schema), literals=printed)


def _check_enum_type(typ: Any, values: list[Any]) -> None:
    if isinstance(typ, list):
        if len(typ) == 1:
            typ = typ[0]
        elif len(typ) == 2 and "null" in typ:
            typ = typ[1] if typ[0] == "null" else typ[0]
        else:
            raise _Fallback(f"enum with type {typ!r}")
    wanted = {"string": (str,), "number": (int, float), "integer": (int,), "boolean": (bool,)}
    kinds = wanted.get(typ) if isinstance(typ, str) else None
    for v in values:
        if kinds is not None and v is not None and not isinstance(v, kinds):
            raise _Fallback(f"enum value {v!r} is not of type {typ}")


def _parse_object(schema: Mapping[str, Any], reg: _Registry) -> _Node:
    node = _Node("object", _describe(schema))
    if not schema:
        return node
    defs = schema.get("$defs")
    if defs:
        if not isinstance(defs, Mapping):
            raise _Fallback("$defs is not an object")
        reg.defs.update(defs)
    extra = schema.get("additionalProperties")
    if isinstance(extra, Mapping):
        node.extra = _parse(extra, reg)
    elif extra is None or isinstance(extra, bool):
        node.extra = extra
    else:
        raise _Unsupported(f"additionalProperties is {type(extra).__name__}")
    if "properties" not in schema:
        return node
    props, required = schema["properties"], schema.get("required", [])
    if not isinstance(props, Mapping):
        raise _Unsupported("properties is not an object")
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise _Unsupported("required is not a list of names")
    for name, prop in props.items():
        default = prop.get("default") if isinstance(prop, Mapping) else None
        node.fields.append(_Field(name, _parse(prop, reg), name not in required, default))
    return node


def _parse_array(schema: Mapping[str, Any], reg: _Registry) -> _Node:
    item = _parse(schema["items"], reg) if schema.get("items") else _Node("scalar", name="any")
    constraints = {k: schema[k] for k in _ARRAY_CONSTRAINT_KEYS if k in schema}
    return _Node("array", _describe(schema), constraints, items=[item])


# --- printing --------------------------------------------------------------------


def _comment(text: str, indent: str = "") -> str:
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


def _doc(node: _Node, indent: str) -> str:
    out = ""
    if node.description:
        out += _comment(node.description, indent) + "\n"
    if node.constraints:
        out += indent + "// " + ", ".join(f"{k}: {node.constraints[k]}" for k in sorted(node.constraints)) + "\n"
    return out


def _field(f: _Field, indent: str) -> str:
    doc = _doc(f.node, indent)
    if f.default is not None:
        shown = repr(f.default) if isinstance(f.default, (int, float)) else json.dumps(f.default, ensure_ascii=False)
        doc += f"{indent}// Default: {shown}\n"
    return f"{doc}{indent}{f.name}{'?' if f.optional else ''}: {_ts(f.node, indent)}"


def _ts(node: _Node, indent: str) -> str:
    if node.kind == "scalar":
        return "number" if node.name == "integer" else node.name
    if node.kind == "ref":
        return node.name
    if node.kind in ("enum", "union"):
        return " | ".join(node.literals)
    if node.kind == "anyof":
        return " | ".join(_ts(n, indent) for n in node.items)
    if node.kind == "array":
        item, inner = node.items[0], indent + _INDENT
        doc = _doc(item, inner)
        if doc:
            return f"Array<\n{doc}{inner}{_ts(item, inner)}\n{indent}>"
        return f"Array<{_ts(item, indent)}>"
    return _object_ts(node, indent)


def _object_ts(node: _Node, indent: str) -> str:
    inner = indent + _INDENT
    ordered = sorted((f for f in node.fields if not f.optional), key=lambda f: f.name)
    ordered += sorted((f for f in node.fields if f.optional), key=lambda f: f.name)
    lines = [_field(f, inner) for f in ordered]
    if node.extra is not None:
        extra = node.extra
        shown = ("any" if extra else "never") if isinstance(extra, bool) else _ts(extra, inner)
        lines.append(f"{inner}[k: string]: {shown}")
    if not lines:
        return "{}"
    return "{\n" + ",\n".join(lines) + f"\n{indent}}}"


def _function(fn: Mapping[str, Any]) -> str:
    name = fn.get("name", "function")
    desc = fn.get("description")
    params = fn.get("parameters") or {}
    if not isinstance(name, str):
        raise _Unsupported("function name is not a string")
    if desc and not isinstance(desc, str):
        raise _Fallback("function description is not a string")
    if not isinstance(params, Mapping):
        raise _Fallback("function parameters is not an object")
    reg = _Registry()
    root = _parse_object(params, reg)
    # decided before the $defs are parsed: a "#" inside a $defs entry prints as
    # `parameters` but does not make the signature refer to the interface
    self_ref = reg.self_ref
    blocks: list[str] = []
    if self_ref:
        body = ",\n".join(_field(f, _INDENT) for f in root.fields)
        blocks.append("interface parameters {" + (f"\n{body}\n" if body else "") + "}")
    for def_name, def_schema in list(reg.defs.items()):
        if not isinstance(def_schema, Mapping):
            raise _Fallback(f"$defs entry {def_name!r} is not an object")
        def_node = _parse(def_schema, reg)
        head = _comment(def_node.description) + "\n" if def_node.description else ""
        blocks.append(f"{head}interface {def_name} {_ts(def_node, '')}")
    signature = "parameters" if self_ref else _object_ts(root, "")
    parts = ["\n".join(blocks), _comment(desc) if desc else "", f"type {name} = (_: {signature}) => any;"]
    return "\n".join(p for p in parts if p)


def _typescript(tools: list[Any]) -> str:
    functions: list[str] = []
    for tool in tools:
        if not isinstance(tool, Mapping):
            raise _Fallback("a tool is not an object")
        if tool.get("type") != "function":
            continue
        fn = tool.get("function", {})
        if not fn:
            continue
        if not isinstance(fn, Mapping):
            raise _Fallback("tool.function is not an object")
        functions.append(_function(fn))
    if not functions:
        raise _Fallback('no tool of type "function" with a function body')
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"
