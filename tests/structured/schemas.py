"""JSON Schemas the structured-output tests decode under: nested objects, arrays with min/max items, enums,
required and optional properties, numbers with bounds, string patterns, ``anyOf`` and ``$defs``/``$ref``
(what the openai client's ``.parse()`` sends for nested pydantic models). Strings are bounded (``maxLength``)
so a random model's answer fits a small budget."""

SCHEMAS: dict[str, dict] = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "ok": {"type": "boolean"}},
             "required": ["color", "ok"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                                        "items": {"type": "string", "maxLength": 4}}},
              "required": ["tags"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                  "email": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}$"}},
                 "required": ["id", "email"], "additionalProperties": False}},
               "required": ["user"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -5, "maximum": 5},
                                                  "b": {"type": "string", "maxLength": 3}},
                 "required": ["a"], "additionalProperties": False},
    "anyof": {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                               {"type": "string", "enum": ["none", "all"]}]}},
              "required": ["v"], "additionalProperties": False},
    "refs": {"$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                                        "maximum": 99},
                                                                  "y": {"type": "integer", "minimum": 0,
                                                                        "maximum": 99}},
                                 "required": ["x", "y"], "additionalProperties": False}},
             "type": "object", "properties": {"points": {"type": "array", "items": {"$ref": "#/$defs/Point"},
                                                         "minItems": 1, "maxItems": 2}},
             "required": ["points"], "additionalProperties": False},
    "number": {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}},
               "required": ["p"], "additionalProperties": False},
}
