"""Constrained decoding: grammars from schemas and tools, the reference sampler == the engine under a grammar,
and every answer validates."""

import json

import jsonschema
import pytest

from celeris.engine import Engine
from celeris.llm import LLM
from celeris.reference.masked import generate
from celeris.sampling.params import SamplingParams
from celeris.structured.grammar import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Constraint,
    GrammarError,
    grammar_tokenizer,
    json_object_grammar,
    schema_grammar,
    tool_call_grammar,
)
from celeris.tokenizer import Tokenizer
from tests.conftest import REPO_ROOT, TINY_LLM, build_tiny_checkpoint
from tests.serve.conftest import TEXTS
from tests.structured.schemas import SCHEMAS

GEN = {"max_tokens": 16, "steps": 8, "block_length": 8, "temperature": 0.0, "top_p": 1.0,
       "remasking": "low_confidence", "cfg_scale": 0.0}


@pytest.fixture(scope="module", params=[False, True], ids=["diffusion", "causal"])
def json_llm(request, tmp_path_factory) -> LLM:
    folder = tmp_path_factory.mktemp("json")
    return LLM(build_tiny_checkpoint(folder, TEXTS, "tiny-json", 256, GEN, is_causal=request.param), **TINY_LLM)


def params_for(grammar: str, **overrides) -> SamplingParams:
    base = {"max_tokens": 96, "steps": 96, "block_length": 1, "grammar": grammar}
    return SamplingParams(**{**base, **overrides})


def test_invalid_and_unsupported_schemas_raise_naming_the_field():
    with pytest.raises(GrammarError, match="not a valid JSON Schema") as exc:
        schema_grammar({"type": "objekt"})
    assert exc.value.param == "response_format.json_schema.schema"
    with pytest.raises(GrammarError, match="cannot be enforced"):
        schema_grammar({"type": "string", "format": "no-such-format"})
    with pytest.raises(GrammarError, match="must be a JSON Schema object"):
        schema_grammar(["not", "a", "schema"])


def test_masked_tokens_only_derive_grammar_text(json_llm):
    """Walk a grammar with the model's tokenizer: every allowed token keeps the text inside the grammar."""
    c = Constraint(schema_grammar(SCHEMAS["enum"]), json_llm.grammar_tokenizer)
    allowed = c.allowed(json_llm.model.config.vocab_size)
    assert 0 < int(allowed.sum()) < allowed.numel()
    assert not bool(allowed[json_llm.tokenizer.eos_token_id])  # the empty text is not an answer
    for tok in json_llm.tokenizer.encode('{"color":"red","ok":true}'):
        assert bool(c.allowed(json_llm.model.config.vocab_size)[tok])
        assert c.consume(tok)
    assert c.accepting and c.stopped


def assert_engine_equals_reference_and_validates(llm, params, schema) -> None:
    """Two prompts through the reference sampler and the engine under ``params``' grammar: the same tokens,
    finished by "stop", and JSON that validates against ``schema``."""
    tok = llm.tokenizer
    prompts = [tok.encode("def add(a, b):"), tok.encode("import os\n")]
    ref = generate(llm.model, prompts, params, grammar_tokenizer=llm.grammar_tokenizer)
    engine = Engine(llm.model, end_ids=[tok.eos_token_id], grammar_tokenizer=llm.grammar_tokenizer)
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    for r, ids in zip(requests, ref.token_ids, strict=True):
        assert r.final_prefix() == ids
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(tok.decode(ids)), schema)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_reference_sampler_equals_engine_and_output_validates(json_llm, name):
    """Temperature 0: the reference sampler and the engine commit the same tokens under a grammar, and the
    answer is JSON that validates against the schema."""
    schema = SCHEMAS[name]
    params = params_for(schema_grammar(schema), cache=json_llm.generation_config.get("cache", "none"))
    assert_engine_equals_reference_and_validates(json_llm, params, schema)


def test_sampled_outputs_validate(json_llm):
    """Temperature 0.7 over many seeds: every answer parses and validates (none cut by the budget)."""
    for name, schema in SCHEMAS.items():
        grammar = schema_grammar(schema)
        outs = json_llm.generate(["def f(x):"] * 3, params_for(grammar, temperature=0.7, seed=7,
                                                               cache=json_llm.generation_config.get("cache", "none")))
        for out in outs:
            assert out.finish_reason == "stop", (name, out.text)
            jsonschema.validate(json.loads(out.text), schema)


def test_json_object_and_tool_call_grammars(json_llm):
    outs = json_llm.generate(["x = 1"], params_for(json_object_grammar(), temperature=0.5, seed=1, max_tokens=128))
    if outs[0].finish_reason == "stop":
        assert isinstance(json.loads(outs[0].text), dict)
    tools = {"get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                             "required": ["city"], "additionalProperties": False}}
    out = json_llm.generate(["x = 1"], params_for(tool_call_grammar(tools, parallel=False), temperature=0.7,
                                                  seed=3))[0]
    assert out.finish_reason == "stop"
    assert out.text.startswith(TOOL_CALL_OPEN) and out.text.endswith(TOOL_CALL_CLOSE)
    call = json.loads(out.text[len(TOOL_CALL_OPEN):-len(TOOL_CALL_CLOSE)])
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], tools["get_weather"])


def test_grammar_with_verified_decoding_still_needs_a_causal_model():
    """Verified decoding runs under a grammar (tests/sampling/test_verified_grammar.py), on the models it runs on."""
    from celeris.models.celeris import CelerisConfig, CelerisModel
    from celeris.sampling.modes import check_request

    model = CelerisModel(CelerisConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2,
                                       intermediate_size=64, max_position_embeddings=64))
    with pytest.raises(ValueError, match="verified"):
        check_request(model, SamplingParams(decoding="verified", grammar=json_object_grammar()))


DIFFUSION_BLOCKS = [
    {"block_length": 8, "steps": 96},  # fixed schedule, one token per step
    {"block_length": 8, "steps": 24},  # four per step
    {"block_length": 16, "steps": 96, "decoding": "threshold", "threshold": 0.3},
    {"block_length": 8, "steps": 96, "cache": "dual_delayed"},
]


@pytest.fixture(scope="module")
def diffusion_llm(tmp_path_factory) -> LLM:
    folder = tmp_path_factory.mktemp("json-diffusion")
    return LLM(build_tiny_checkpoint(folder, TEXTS, "tiny-json", 256, GEN), **TINY_LLM)


@pytest.mark.parametrize("settings", DIFFUSION_BLOCKS, ids=lambda d: "-".join(map(str, d.values())))
@pytest.mark.parametrize("name", ["nested", "refs", "array"])
def test_parallel_blocks_reference_equals_engine_and_validate(diffusion_llm, settings, name):
    """A diffusion model keeps its blocks under a grammar: each step commits the longest run of its proposals
    from the leftmost open position that the grammar accepts; reference sampler == engine, all valid."""
    schema = SCHEMAS[name]
    assert_engine_equals_reference_and_validates(diffusion_llm, params_for(schema_grammar(schema), **settings), schema)


def test_parallel_commits_more_than_one_token_per_forward(diffusion_llm):
    schema = SCHEMAS["array"]
    params = params_for(schema_grammar(schema), block_length=16, steps=96, decoding="threshold", threshold=0.05,
                        temperature=0.0)
    outs = diffusion_llm.generate(["def f(x):", "import os\n", "class Stack:"], params)
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)
    assert sum(o.num_committed for o in outs) > sum(o.nfe for o in outs)


@pytest.mark.parametrize("budget", [18, 24, 40])
def test_answers_close_within_a_small_budget(json_llm, budget):
    """The closing-path rule: an answer that can end within max_tokens does (free numbers and strings would
    otherwise run on), and is valid."""
    schema = {"type": "object", "properties": {"p": {"type": "number"}, "s": {"type": "string"}},
              "required": ["p", "s"], "additionalProperties": False}
    for seed in range(4):
        out = json_llm.generate(["def f(x):"], params_for(schema_grammar(schema), temperature=1.0, seed=seed,
                                                          max_tokens=budget, steps=budget))[0]
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_an_impossible_budget_ends_with_length_never_claimed_complete(json_llm):
    out = json_llm.generate(["def f(x):"], params_for(schema_grammar(SCHEMAS["nested"]), max_tokens=4,
                                                      steps=4))[0]
    assert out.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


# Parameters whose references point inside themselves (issue 28 item 1): pydantic's $defs for a nested model, the
# older "definitions", and "#" (the parameters' own root, a recursive schema).
POINT = SCHEMAS["refs"]["$defs"]["Point"]
REFERRING_PARAMETERS = {
    "defs": SCHEMAS["refs"],
    "definitions": {"definitions": {"Point": POINT}, "type": "object", "required": ["at"],
                    "properties": {"at": {"$ref": "#/definitions/Point"}}, "additionalProperties": False},
    "root": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                              "next": {"$ref": "#"}}, "required": ["n"], "additionalProperties": False},
}
VALID_ARGUMENTS = {"defs": {"points": [{"x": 1, "y": 2}]}, "definitions": {"at": {"x": 3, "y": 4}},
                   "root": {"n": 1, "next": {"n": 2}}}
INVALID_ARGUMENTS = {"defs": {"points": [{"x": 1}]}, "definitions": {"at": {"x": 3, "y": 400}},
                     "root": {"n": 1, "next": {"m": 2}}}


@pytest.mark.parametrize("kind", sorted(REFERRING_PARAMETERS))
def test_tool_parameters_with_references_are_enforced(kind):
    """A call's arguments follow their own ``$ref``s: the grammar compiles, takes a valid nested call and refuses
    one that breaks the referenced schema (every tool_choice: tests/serve/test_tools.py)."""
    params = REFERRING_PARAMETERS[kind]
    jsonschema.validate(VALID_ARGUMENTS[kind], params)  # the test's own data, checked by the reference validator
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(INVALID_ARGUMENTS[kind], params)
    tok = Tokenizer(REPO_ROOT / "celeris" / "checkpoints" / "celeris-code-6m")
    matcher = Constraint(tool_call_grammar({"f": params}, parallel=False), grammar_tokenizer(tok)).matcher
    for arguments, ok in ((VALID_ARGUMENTS[kind], True), (INVALID_ARGUMENTS[kind], False)):
        body = json.dumps({"name": "f", "arguments": arguments}, separators=(",", ":"))
        m = matcher.deep_copy()
        accepted = all(m.consume_token(t) for t in tok.encode(TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE))
        assert (accepted and m.is_accepting()) is ok, (kind, arguments)


def test_tool_parameters_must_be_an_object_schema():
    for params in ({"type": "string"}, {"type": "array", "items": {}}, {"properties": {"a": {}}}):
        with pytest.raises(GrammarError, match='type "object"') as exc:
            tool_call_grammar({"f": params})
        assert exc.value.param == "tools[f].function.parameters"


def test_a_grammar_that_admits_no_answer_is_refused_for_the_tokenizer(json_llm):
    """llguidance compiles ``{"$ref": "#"}`` but fails at its first mask; ``check_grammar`` finds that before any
    request is queued, and ``answer_matches`` is the check a finished answer must pass."""
    import llguidance

    from celeris.structured.grammar import JSON_OPTIONS, answer_matches, check_grammar

    loop = llguidance.LLMatcher.grammar_from_json_schema({"$ref": "#"}, defaults=JSON_OPTIONS)
    with pytest.raises(GrammarError, match="cannot be enforced") as exc:
        check_grammar(loop, json_llm.grammar_tokenizer, "response_format")
    assert exc.value.param == "response_format"
    with pytest.raises(GrammarError, match="empty answer"):
        check_grammar(llguidance.LLMatcher.grammar_from_lark('start: "" | "{}"'), json_llm.grammar_tokenizer, "x")
    grammar = json_object_grammar()
    check_grammar(grammar, json_llm.grammar_tokenizer, "response_format")
    encode = json_llm.tokenizer.encode
    assert answer_matches(grammar, json_llm.grammar_tokenizer, encode('{"a":[1]}'))
    assert not answer_matches(grammar, json_llm.grammar_tokenizer, encode('{"a":[1]'))
    assert not answer_matches(grammar, json_llm.grammar_tokenizer, [])
    assert not answer_matches(loop, json_llm.grammar_tokenizer, [])
    with pytest.raises(GrammarError, match="admits no finite JSON value"):
        schema_grammar({"type": "array", "items": {"$ref": "#"}, "minItems": 1})


def test_the_grammar_tokenizer_is_built_at_the_first_request_with_a_grammar(tmp_path):
    """A load builds no llguidance tokenizer (a cold start that serves no grammar never pays for it); the engine
    builds it at its first constrained request, which then validates, and keeps it."""
    from celeris.structured import grammar as grammar_module

    llm = LLM(build_tiny_checkpoint(tmp_path, TEXTS, "tiny-lazy", 256, GEN, is_causal=True), **TINY_LLM)
    built = []
    real = grammar_module._grammar_tokenizer.__wrapped__

    def counting(*args):  # the uncached builder, counted
        built.append(args[1:])
        return real(*args)

    grammar_module._grammar_tokenizer.cache_clear()
    original, grammar_module._grammar_tokenizer = grammar_module._grammar_tokenizer, counting
    try:
        llm.generate("def f(x):", SamplingParams(max_tokens=8, steps=8, block_length=1))
        assert built == []
        out = llm.generate('{"color":', params_for(schema_grammar(SCHEMAS["enum"])))[0]
        jsonschema.validate(json.loads(out.text), SCHEMAS["enum"])
        llm.generate('{"color":', params_for(schema_grammar(SCHEMAS["enum"])))
        assert len(built) == 1 and llm.grammar_tokenizer is llm.engine.grammar_tokenizer is not None
    finally:
        grammar_module._grammar_tokenizer = original
