"""``has_finite_value`` against a brute-force reference: a schema admits a finite value exactly when one of the
small JSON values enumerated here validates (``jsonschema``), for schemas whose smallest value is that small."""

import itertools
import sys

import jsonschema
import pytest

from celeris.structured.finite import has_finite_value


def small_values(depth: int) -> list:
    """Every JSON value of nesting at most ``depth`` built from a few leaves, one-item arrays and one-key objects
    (key ``a`` or ``next``)."""
    values: list = [None, True, 0, "x", [], {}]
    for _ in range(depth):
        values = values + [[v] for v in values] + [{k: v} for k, v in itertools.product(("a", "next"), values)]
    return values


VALUES = small_values(2)

LINKED = {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
          "required": ["next"]}
SCHEMAS = {
    "self": {"$ref": "#"},
    "required_self": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    "optional_self": {"type": "object", "properties": {"a": {"$ref": "#"}}},
    "array_of_self": {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    "array_maybe_empty": {"type": "array", "items": {"$ref": "#"}},
    "linked_list": LINKED,
    "defs_cycle": {"$defs": {"p": {"$ref": "#/$defs/q"}, "q": {"type": "object", "properties": {"a": {"$ref":
                   "#/$defs/p"}}, "required": ["a"]}}, "$ref": "#/$defs/p"},
    "defs_way_out": {"$defs": {"p": {"anyOf": [{"$ref": "#/$defs/q"}, {"type": "integer"}]},
                               "q": {"type": "object", "properties": {"a": {"$ref": "#/$defs/p"}},
                                     "required": ["a"]}}, "$ref": "#/$defs/p"},
    "all_of_with_dead_branch": {"allOf": [{"type": "object"}, {"$ref": "#"}]},
    "required_false": {"type": "object", "properties": {"a": False}, "required": ["a"]},
    "prefix_items": {"type": "array", "prefixItems": [{"type": "null"}, {"$ref": "#"}], "minItems": 1},
    "prefix_items_dead": {"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1},
    "two_types": {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    "plain": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
}


def brute_force_admits(schema: dict) -> bool:
    """Some small value validates; a validation that recurses forever (``{"$ref": "#"}`` checks the same value
    against itself again) never says valid."""
    validator = jsonschema.Draft202012Validator(schema)

    def valid(value: object) -> bool:
        try:
            return validator.is_valid(value)
        except RecursionError:
            return False

    limit, depth, frame = sys.getrecursionlimit(), 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    sys.setrecursionlimit(depth + 150)  # plenty for values of depth 2; a loop is found sooner
    try:
        return any(valid(v) for v in VALUES)
    finally:
        sys.setrecursionlimit(limit)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_agrees_with_brute_force(name):
    assert has_finite_value(SCHEMAS[name]) == brute_force_admits(SCHEMAS[name])


def test_refs_it_cannot_resolve_are_assumed_to_admit_values():
    assert has_finite_value({"$ref": "https://example.com/other.json"})
    assert has_finite_value({"type": "object", "properties": {"a": {"$ref": "#/$defs/absent"}}, "required": ["a"]})
