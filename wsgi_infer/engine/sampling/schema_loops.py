"""JSON Schemas with no finite value: a schema whose ``$ref`` and ``allOf`` lead back to it at the same place in the
value, never reaching one that says what the value is (``{"$ref": "#"}``, ``a`` → ``b`` → ``a``), or whose every
value holds another of itself (an object's required property, an array's least items, that recur to it).

JSON Schema leaves a loop undefined (a validator would never end), and llguidance compiles either to a grammar that
no text completes: a choice stopped on ``{"x":``, its mask letting the end of sequence through, or nested until its
tokens ran out. Found here before compiling, so that the request is refused naming its field. A schema that may
recur through a property or an item (a tree) is fine where the recursion may stop (an optional property, an
array that may be empty, an ``anyOf``/``oneOf`` branch that ends it, a type besides the object's); schemas reached
only from ``$defs`` that nothing refers to are not looked at, and where a nested ``$id`` moves the base of
references, nothing is."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from urllib.parse import unquote

# The keywords whose values are schemas (one, a list, or names to schemas); the others' values are data.
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_ONE_MORE = ("unevaluatedItems", "unevaluatedProperties")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_NAMED = ("properties", "patternProperties", "dependentSchemas")
_JSON_IN_LARK = re.compile(r"%json\s*")


def schemas_in_lark(grammar: str) -> Iterator[object]:
    """The schemas a Lark grammar embeds (``%json {...}``, as tools' grammars do); one that does not parse is left
    for llguidance to name."""
    decoder = json.JSONDecoder()
    for found in _JSON_IN_LARK.finditer(grammar):
        try:
            yield decoder.raw_decode(grammar, found.end())[0]
        except ValueError:
            continue


def loop_at(root: object) -> str | None:
    """Where ``root`` first reaches a schema with no finite value (a JSON pointer, ``#`` the root itself), or None.

    A schema ends unless its ``$ref``, one of its ``allOf`` or of the values it forces (``_forced``) does not, or all
    of its ``anyOf``/``oneOf`` branches do not: the least fixed point, grown from the schemas that end at once, in
    time linear in the references."""
    found = _reachable(root)
    if found is None:
        return None
    for forced in (False, True):  # a loop of references first: where it is reached says more than what holds it
        ended = _ended(root, found, forced)
        if unended := [where for key, (where, _) in found.items() if key not in ended]:
            return unended[0]
    return None


def _ended(root: object, found: dict[int, tuple[str, dict]], forced: bool) -> set[int]:
    """The schemas of ``found`` that end (``loop_at``), counting the values they force only with ``forced``."""
    waits: dict[int, int] = {}  # per schema: the schemas it needs that have not ended, +1 while no branch has
    needed_by: dict[int, list[int]] = {key: [] for key in found}
    branch_of: dict[int, list[int]] = {key: [] for key in found}
    for key, (_, schema) in found.items():
        must = [_target(root, schema), *_list(schema, "allOf"), *(_forced(schema) if forced else [])]
        must = list(dict.fromkeys(id(s) for s in must if isinstance(s, dict)))
        branches = _list(schema, "anyOf") + _list(schema, "oneOf")
        open_branches = bool(branches) and all(isinstance(s, dict) for s in branches)  # `true` ends at once
        waits[key] = len(must) + open_branches
        for other in must:
            needed_by[other].append(key)
        for other in (id(s) for s in branches) if open_branches else ():
            branch_of[other].append(key)
    ended, branched = set(), set()
    ready = [key for key, count in waits.items() if count == 0]
    while ready:
        key = ready.pop()
        ended.add(key)
        settled = [k for k in dict.fromkeys(branch_of[key]) if k not in branched]  # a branch has ended
        branched.update(settled)
        for waiting in needed_by[key] + settled:
            waits[waiting] -= 1
            if waits[waiting] == 0:
                ready.append(waiting)
    return ended


def _reachable(root: object) -> dict[int, tuple[str, dict]] | None:
    """Each schema reachable from ``root`` through schema keywords and local references, by identity, with the
    pointer it was first reached at; None where a nested ``$id`` moves the base that references resolve against."""
    found: dict[int, tuple[str, dict]] = {}
    stack: list[tuple[str, object]] = [("#", root)]
    while stack:
        where, schema = stack.pop()
        if not isinstance(schema, dict) or id(schema) in found:
            continue
        if schema is not root and "$id" in schema:
            return None
        found[id(schema)] = (where, schema)
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            stack.append((ref, _target(root, schema)))
        stack.extend(reversed(list(_children(where, schema))))
    return found


def _children(where: str, schema: dict) -> Iterator[tuple[str, object]]:
    for word in (*_ONE, *_ONE_MORE):
        if isinstance(schema.get(word), dict):
            yield f"{where}/{word}", schema[word]
    for word in _LIST:
        for index, item in enumerate(_list(schema, word)):
            yield f"{where}/{word}/{index}", item
    for word in _NAMED:
        named = schema.get(word)
        for name, item in named.items() if isinstance(named, dict) else ():
            yield f"{where}/{word}/{name.replace('~', '~0').replace('/', '~1')}", item


def _forced(schema: dict) -> list:
    """The schemas of the values every value of ``schema`` holds, where it admits objects alone (its required
    properties') or arrays alone (its first ``minItems`` items')."""
    kind, least = schema.get("type"), schema.get("minItems")
    if kind == "object" and isinstance(schema.get("required"), list):
        named = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        other = schema.get("additionalProperties")
        return [named.get(name, other) for name in schema["required"] if isinstance(name, str)]
    if kind == "array" and isinstance(least, int) and least > 0:
        prefix = _list(schema, "prefixItems") or _list(schema, "items")  # (items as a list: before 2020-12)
        rest = schema.get("items") if isinstance(schema.get("items"), dict) else schema.get("additionalItems")
        return prefix[:least] + ([rest] if len(prefix) < least else [])
    return []


def _list(schema: dict, word: str) -> list:
    value = schema.get(word)
    return value if isinstance(value, list) else []


def _target(root: object, schema: dict) -> object:
    """What a local ``$ref`` (``#`` or ``#/a/b``) points at in ``root``; None for any other or none."""
    ref = schema.get("$ref")
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
