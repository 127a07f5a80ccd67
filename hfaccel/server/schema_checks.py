"""What of a ``response_format`` JSON schema is served, checked before xgrammar compiles it.

Two kinds of schema are refused (a 400 naming where in the schema), each found by walking the schema's
subschemas (never a property that happens to be named like a keyword):

- **Keywords the grammar would not enforce.** xgrammar 0.2 compiles these and ignores them, so an
  answer could break them with no error (found by asking its matcher to accept an instance that breaks
  each validation keyword, strict and not; ``tests/server/test_structured.py`` keeps both lists honest):
  ``not``, ``uniqueItems``, ``contains`` (and ``minContains``, ``maxContains``), ``dependentRequired``,
  ``dependencies``, ``dependentSchemas``, ``if``/``then``/``else``, an ``allOf`` of more than one
  subschema, ``unevaluatedProperties`` without ``strict``, and ``required`` naming a property that
  ``properties`` does not list. ``oneOf`` is served as ``anyOf`` (xgrammar's reading, and vLLM's): an
  answer matching two of its branches is possible.
- **Schemas nested over 64 levels** (xgrammar's compile grows steeply with depth: 16 ms at 64 levels
  of arrays, 0.3 s at 200, 34 s at 900).
- **Schemas over OpenAI's Structured Outputs limits**: 1,000 enum values in all, 5,000 object
  properties, 120,000 characters of property names, definition names, enum and const values. A
  grammar's compile time grows with the square of its enum values (10,000 strings: 5 s on two cores,
  30,000: 55 s, every core busy meanwhile), so the limits that keep a client within OpenAI's also
  keep one request from stalling the others.
"""

from __future__ import annotations

from typing import Any

MAX_DEPTH = (
    64  # subschemas inside subschemas: xgrammar's compile takes 16 ms at 64, 0.3 s at 200, 34 s at 900
)
MAX_ENUM_VALUES = 1_000
MAX_PROPERTIES = 5_000
MAX_STRING_CHARS = 120_000

# Where a schema holds subschemas: one, a list of them, or a map of names to them.
_ONE = ("items", "additionalProperties", "contains", "propertyNames", "if", "then", "else", "not",
        "unevaluatedProperties", "unevaluatedItems")  # fmt: skip
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def check_schema(schema: Any, strict: bool = False) -> None:
    """Raise ValueError, saying where and why, for a schema the grammar would not enforce whole (with
    `strict`: the request's ``strict``, xgrammar's strict mode) or one over OpenAI's size limits (see the
    module doc)."""
    if not isinstance(schema, dict):
        raise ValueError(f"the JSON schema must be a JSON object, got {schema!r}")
    totals = {"enum values": 0, "properties": 0, "characters": 0}
    _walk(schema, "schema", totals, strict, 0)
    for name, (count, limit) in {
        "enum values": (totals["enum values"], MAX_ENUM_VALUES),
        "properties": (totals["properties"], MAX_PROPERTIES),
        "characters of names, enum and const values": (totals["characters"], MAX_STRING_CHARS),
    }.items():
        if count > limit:
            raise ValueError(
                f"the JSON schema cannot be used: it has {count:,} {name}, over OpenAI's structured-output "
                f"limit of {limit:,}"
            )


def _walk(node: Any, where: str, totals: dict[str, int], strict: bool, depth: int) -> None:
    if not isinstance(node, dict):
        return  # a boolean subschema (true / false), or a malformed one xgrammar reports
    if depth > MAX_DEPTH:
        raise ValueError(f"the JSON schema cannot be used: it nests subschemas over {MAX_DEPTH} levels deep")
    _check_keywords(node, where, strict)
    for value in node.get("enum") or []:
        totals["enum values"] += 1
        totals["characters"] += len(value) if isinstance(value, str) else 0
    if isinstance(node.get("const"), str):
        totals["characters"] += len(node["const"])
    for key in _ONE:
        _walk(node.get(key), f"{where}.{key}", totals, strict, depth + 1)
    for key in _MANY:
        for i, sub in enumerate(node.get(key) or []):
            _walk(sub, f"{where}.{key}[{i}]", totals, strict, depth + 1)
    for key in _NAMED:
        named = node.get(key)
        if not isinstance(named, dict):
            continue
        if key == "properties":
            totals["properties"] += len(named)
        totals["characters"] += sum(map(len, named))
        for name, sub in named.items():
            _walk(sub, f"{where}.{key}.{name}", totals, strict, depth + 1)


# Keywords xgrammar 0.2 compiles without enforcing, whatever `strict` says.
_UNENFORCED = ("not", "contains", "minContains", "maxContains", "dependentRequired", "dependencies",
               "dependentSchemas")  # fmt: skip


def _check_keywords(node: dict[str, Any], where: str, strict: bool) -> None:
    """Refuse the keywords xgrammar compiles without enforcing (see the module doc)."""
    unenforced = [k for k in _UNENFORCED if k in node]
    if node.get("uniqueItems") is True:
        unenforced.append("uniqueItems")
    if "if" in node and ("then" in node or "else" in node):
        unenforced.append("if/then/else")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        unenforced.append("allOf of more than one schema")
    if not strict and node.get("unevaluatedProperties", True) is not True:  # strict mode enforces it
        unenforced.append("unevaluatedProperties (without strict)")
    if unenforced:
        raise ValueError(
            f"the JSON schema cannot be used: {where} uses {', '.join(unenforced)}, which the grammar "
            "does not enforce (an answer could break it)"
        )
    required, listed = node.get("required"), node.get("properties") or {}
    # (only where the node describes an object: an `if` of {"required": [...]} alone is enforced)
    is_object = "properties" in node or node.get("type") == "object"
    if is_object and isinstance(required, list) and isinstance(listed, dict):
        missing = [name for name in required if name not in listed]
        if missing:
            raise ValueError(
                f"the JSON schema cannot be used: {where} requires {', '.join(map(repr, missing))}, "
                "which its properties do not list (the grammar does not enforce it)"
            )
