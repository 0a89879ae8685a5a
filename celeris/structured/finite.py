"""Whether a JSON Schema admits a finite value at all (``has_finite_value``).

A schema whose ``$ref`` s recurse without a way out (``{"$ref": "#"}``; an object whose required property is the
object itself; an array of at least one item of itself) is a valid schema that no finite JSON text validates: a
grammar built from it derives no sentence, and a constrained decoder can only end its answer early or run out of
budget. This is the productivity test of context-free grammars (a nonterminal is productive when some finite
terminal string derives from it; Hopcroft and Ullman, *Introduction to Automata Theory, Languages, and
Computation*, section 4.4): a least fixpoint over the schema's ``$ref`` targets.

Each keyword is read generously (an intersection of ``allOf`` branches counts as admitting a value when every
branch does), so the test only refuses schemas that certainly admit nothing finite; contradictions between
keywords are llguidance's to find ("Unsatisfiable schema").
"""

from __future__ import annotations

from urllib.parse import unquote

_UNKNOWN = object()  # a $ref this module does not resolve (another document, an $anchor): assumed productive
_ALL_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def _pointer_target(root: object, ref: str) -> object:
    """The subschema a local ``$ref`` (``#`` or ``#/json/pointer``, RFC 6901) points at, else ``_UNKNOWN``."""
    if not ref.startswith("#") or (len(ref) > 1 and not ref.startswith("#/")):
        return _UNKNOWN
    node = root
    for part in ref[2:].split("/") if len(ref) > 1 else []:
        key = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return _UNKNOWN
    return node


def _refs(node: object) -> set[str]:
    """Every ``$ref`` string anywhere in ``node``."""
    if isinstance(node, dict):
        found = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
        for value in node.values():
            found |= _refs(value)
        return found
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node)) if node else set()
    return set()


def _object_ok(node: dict, ok) -> bool:
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    return all(ok(properties[name]) for name in required if name in properties)


def _array_ok(node: dict, ok) -> bool:
    prefix = node.get("prefixItems", node.get("items") if isinstance(node.get("items"), list) else [])
    rest = node.get("items", True) if not isinstance(node.get("items"), list) else node.get("additionalItems", True)
    min_items = node.get("minItems", 0) if isinstance(node.get("minItems"), int) else 0
    needed = [prefix[i] if i < len(prefix) else rest for i in range(min(min_items, len(prefix) + 1))]
    return all(ok(sub) for sub in needed)


def _productive(node: object, root: object, known: set[str]) -> bool:
    """Whether ``node`` admits a finite value, assuming exactly the ``$ref`` targets in ``known`` do."""
    if node is False:
        return False
    if not isinstance(node, dict):
        return True

    def ok(sub: object) -> bool:
        return _productive(sub, root, known)

    ref = node.get("$ref")
    if isinstance(ref, str) and _pointer_target(root, ref) is not _UNKNOWN and ref not in known:
        return False
    if "enum" in node and isinstance(node["enum"], list) and not node["enum"]:
        return False
    for key, need_all in (("allOf", True), ("anyOf", False), ("oneOf", False)):
        branches = node.get(key)
        if isinstance(branches, list):
            results = [ok(b) for b in branches]
            if not (all(results) if need_all else any(results)):
                return False
    if "const" in node or "enum" in node:
        return True
    types = node.get("type", list(_ALL_TYPES))
    types = [types] if isinstance(types, str) else types
    return any(_object_ok(node, ok) if t == "object" else _array_ok(node, ok) if t == "array" else True
               for t in types)


def has_finite_value(schema: dict) -> bool:
    """Whether some finite JSON value may validate against ``schema`` (module docstring): False only when every
    value would have to contain itself through ``$ref`` (e.g. ``{"$ref": "#"}``) or a required part is ``false``.

    Args:
        schema: a JSON Schema already checked against its meta-schema (``celeris.structured.grammar.check_schema``).
    """
    refs = {r for r in _refs(schema) if _pointer_target(schema, r) is not _UNKNOWN}
    known: set[str] = set()
    changed = True
    while changed:  # least fixpoint: add each target that admits a value given the ones found so far
        changed = False
        for ref in refs - known:
            if _productive(_pointer_target(schema, ref), schema, known):
                known.add(ref)
                changed = True
    return _productive(schema, schema, known)
