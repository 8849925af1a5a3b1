"""Tool declarations as Kimi-K2.5 shows them to the model: a TypeScript namespace, not JSON.

Part of the ``kimi-mini`` tokenizer's remote code (copied next to ``tokenization_kimi.py``). It
follows the documented behaviour of K2.5's own encoder: every function becomes
``type <name> = (_: {...}) => any;`` inside ``namespace functions { ... }`` under a ``# Tools``
header; descriptions, constraints and defaults become ``//`` comments above what they describe;
required fields come first, then optional ones (``name?:``), each group sorted by name;
``integer`` is ``number``, enums are unions of literals, ``anyOf`` and type lists are unions,
arrays are ``Array<T>``, ``additionalProperties`` is an index signature, and ``$defs`` become
interfaces referenced by name. A schema it cannot read raises ``ValueError``; the tokenizer
then falls back to the template's compact JSON, as K2.5's does.
"""

from __future__ import annotations

import json

INDENT = "  "
FIELD_SEPARATOR = ",\n"
CONSTRAINTS = {"string": ("maxLength", "minLength", "pattern"), "number": ("maximum", "minimum"),
               "integer": ("maximum", "minimum"), "array": ("maxItems", "minItems")}
UNION_NAMES = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean", "null": "null",
               "object": "{}", "array": "Array<any>"}


def comment(text: str, indent: str = "") -> str:
    """``// line`` per line of ``text``; blank lines stay blank."""
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


class Schemas:
    """The ``$defs`` met while reading one function, for ``$ref`` and the interfaces above it."""

    def __init__(self):
        self.defs: dict[str, dict] = {}
        self.self_ref = False

    def ref_name(self, ref: str) -> str:
        if ref == "#":
            self.self_ref = True
            return "parameters"
        prefix = "#/$defs/"
        if not ref.startswith(prefix):
            raise ValueError(f"unsupported $ref {ref!r}")
        name = ref[len(prefix):]
        if name not in self.defs:
            raise ValueError(f"$ref {ref!r} names no definition")
        return name


def _notes(schema, indent: str) -> str:
    """The comment lines above a field: its description, then its constraints."""
    if not isinstance(schema, dict):
        return ""
    lines = []
    if schema.get("description"):
        lines.append(comment(schema["description"], indent))
    kind = schema.get("type") if isinstance(schema.get("type"), str) else None
    if "$ref" in schema or "anyOf" in schema or "enum" in schema:
        kind = None  # these read no constraints
    shown = sorted((k, schema[k]) for k in CONSTRAINTS.get(kind, ()) if k in schema)
    if shown:
        lines.append(indent + "// " + ", ".join(f"{k}: {v}" for k, v in shown))
    return "".join(line + "\n" for line in lines)


def _type(schema, ctx: Schemas, indent: str) -> str:
    """The TypeScript type of one JSON schema."""
    if isinstance(schema, bool):
        return "any" if schema else "null"
    if not isinstance(schema, dict):
        raise ValueError(f"not a JSON schema: {schema!r}")
    if "$ref" in schema:
        return ctx.ref_name(schema["$ref"])
    if "anyOf" in schema:
        return " | ".join(_type(s, ctx, indent) for s in schema["anyOf"])
    if "enum" in schema:
        _check_enum(schema)
        return " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(UNION_NAMES[k] for k in kind)
    if kind == "object":
        return _object(schema, ctx, indent)
    if kind == "array":
        return _array(schema, ctx, indent)
    if kind is not None:
        return "number" if kind == "integer" else str(kind)
    if schema == {}:
        return "any"
    raise ValueError(f"a schema without a type: {schema!r}")


ENUM_VALUE_TYPES = {"string": str, "number": (int, float), "integer": int, "boolean": bool}


def _check_enum(schema: dict) -> None:
    """Enum values must be of the declared type (a nullable type allows None)."""
    kind = schema.get("type")
    if isinstance(kind, list):
        rest = [k for k in kind if k != "null"]
        if len(rest) != 1 or len(kind) > 2:
            raise ValueError(f"enum type {kind} is not supported")
        kind = rest[0]
    want = ENUM_VALUE_TYPES.get(kind)
    for v in schema["enum"]:
        if want is not None and v is not None and not isinstance(v, want):
            raise ValueError(f"enum value {v!r} is not a {kind}")


def _field(name: str, schema, optional: bool, ctx: Schemas, indent: str) -> str:
    text = _notes(schema, indent)
    default = schema.get("default") if isinstance(schema, dict) else None
    if default is not None:
        shown = repr(default) if isinstance(default, (bool, int, float)) else json.dumps(default, ensure_ascii=False)
        text += f"{indent}// Default: {shown}\n"
    return text + f"{indent}{name}{'?' if optional else ''}: {_type(schema, ctx, indent)}"


def _fields(schema: dict, ctx: Schemas, indent: str, *, ordered: bool = True) -> list[str]:
    """Required fields sorted by name, then the optional ones, then the index signature
    (``ordered=False``: the schema's own order and no index signature, as the root interface of a
    self-referencing schema is written)."""
    if "$defs" in schema:
        ctx.defs.update(schema["$defs"])
    props = schema.get("properties")
    required = set(schema.get("required") or [])
    names = sorted(props or {}, key=lambda n: (n not in required, n)) if ordered else list(props or {})
    inner = indent + INDENT
    out = [_field(n, props[n], n not in required, ctx, inner) for n in names]
    extra = schema.get("additionalProperties") if ordered else None
    if extra is not None:
        if extra is True:
            kind = "any"
        elif extra is False:
            kind = "never"
        elif isinstance(extra, dict):
            kind = _type(extra, ctx, inner)
        else:
            raise ValueError(f"additionalProperties must be a boolean or a schema, got {extra!r}")
        out.append(f"{inner}[k: string]: {kind}")
    return out


def _object(schema: dict, ctx: Schemas, indent: str) -> str:
    fields = _fields(schema, ctx, indent)
    return "{\n" + FIELD_SEPARATOR.join(fields) + "\n" + indent + "}" if fields else "{}"


def _array(schema: dict, ctx: Schemas, indent: str) -> str:
    item = schema.get("items") or {"type": "any"}
    notes = _notes(item, indent + INDENT)
    if not notes:
        return f"Array<{_type(item, ctx, indent)}>"
    inner = indent + INDENT
    return "Array<\n" + notes + inner + _type(item, ctx, inner) + "\n" + indent + ">"


def function_declaration(function: dict) -> str:
    """One function (the ``function`` object of an OpenAI tool) as TypeScript."""
    ctx = Schemas()
    params = function.get("parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"parameters must be an object schema, got {params!r}")
    signature = _object(params, ctx, "")
    interfaces = []
    if ctx.self_ref:
        body = FIELD_SEPARATOR.join(_fields(params, ctx, "", ordered=False))
        interfaces.append("interface parameters {" + (f"\n{body}\n" if body else "") + "}")
        signature = "parameters"
    for name, schema in list(ctx.defs.items()):
        about = comment(schema["description"]) + "\n" if isinstance(schema, dict) and schema.get("description") else ""
        interfaces.append(f"{about}interface {name} {_type(schema, ctx, '')}")
    name = function.get("name", "function")
    parts = ["\n".join(interfaces), comment(function["description"]) if function.get("description") else "",
             f"type {name} = (_: {signature}) => any;"]
    return "\n".join(p for p in parts if p)


def encode_tools_to_typescript_style(tools: list[dict]) -> str:
    """The whole declaration block for ``tools`` (OpenAI format); "" when none is a function."""
    functions = [function_declaration(t["function"]) for t in tools or []
                 if isinstance(t, dict) and t.get("type") == "function" and t.get("function")]
    if not functions:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"
