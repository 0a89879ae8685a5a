"""Verified decoding under a grammar (celeris.sampling.verified.verify_under_grammar): at temperature 0 exactly constrained
next-token greedy decoding (batched, staggered, drafts accepted and rejected), sampled answers validate, and
the speculative rule under a grammar keeps the masked next-token distribution."""

import json

import jsonschema
import pytest
import torch

from celeris.engine import Engine
from celeris.engine.verified import DraftRow, VerifiedDecoder, generate_verified
from celeris.llm import LLM
from celeris.reference.masked import generate
from celeris.sampling.params import SamplingParams
from celeris.sampling.verified import grammar_lookup_drafts, verify_under_grammar
from celeris.structured.grammar import Constraint, row_constraints, schema_grammar, tool_call_grammar
from tests.conftest import build_tiny_checkpoint
from tests.serve.conftest import TEXTS
from tests.structured.schemas import SCHEMAS

K = 4
GEN = {"max_tokens": 16, "steps": 16, "block_length": 1, "temperature": 0.0, "top_p": 1.0, "cfg_scale": 0.0,
       "decoding": "verified", "draft_source": "lookup_first"}
NAMES = ["flat", "enum", "nested", "refs", "array", "anyof"]


@pytest.fixture(scope="module")


def hybrid_llm(tmp_path_factory) -> LLM:
    folder = tmp_path_factory.mktemp("json-hybrid")
    return LLM(build_tiny_checkpoint(folder, TEXTS, "tiny-hybrid", 256, GEN, is_causal=True, draft_block_size=K),
               device="cpu")


def verified(grammar: str, max_tokens: int = 64, **overrides) -> SamplingParams:
    return SamplingParams(**{"max_tokens": max_tokens, "steps": max_tokens, "block_length": 1,
                             "decoding": "verified", "grammar": grammar, **overrides})


def reference(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    """Constrained next-token greedy decoding: the reference sampler, one token per step, under the grammar."""
    plain = SamplingParams(max_tokens=params.max_tokens, steps=params.max_tokens, block_length=1,
                           grammar=params.grammar)
    return generate(llm.model, [prompt], plain, grammar_tokenizer=llm.grammar_tokenizer).token_ids[0]


def prompts(llm: LLM) -> list[list[int]]:
    tok = llm.tokenizer
    return [tok.encode(t) for t in ("def add(a, b):", "import os\n", "class Stack:", '{"name":"x","age":1}')]


def test_default_decoding_stays_verified_under_a_grammar():
    params = SamplingParams.from_defaults(GEN, grammar=schema_grammar(SCHEMAS["flat"]))
    assert params.decoding == "verified"


def test_greedy_equals_constrained_next_token_decoding_batched(hybrid_llm):
    """Rows with different prompts, schemas and budgets in one batch: each equals constrained next-token greedy
    decoding token for token, ends by "stop" and validates."""
    ps = prompts(hybrid_llm)
    for shift in range(2):  # every schema meets two different prompts
        names = [NAMES[(shift * 3 + i) % len(NAMES)] for i in range(4)]
        rows = [verified(schema_grammar(SCHEMAS[n]), max_tokens=48 + 8 * i) for i, n in enumerate(names)]
        out = generate_verified(hybrid_llm.model, ps, rows, grammar_tokenizer=hybrid_llm.grammar_tokenizer)
        for prompt, params, name, got in zip(ps, rows, names, out.token_ids, strict=True):
            assert got == reference(hybrid_llm, prompt, params), name
            jsonschema.validate(json.loads(hybrid_llm.tokenizer.decode(got)), SCHEMAS[name])


class OracleDecoder(VerifiedDecoder):
    """Drafts the true constrained answer, wrong at every third draft: drafts are accepted and rejected (the
    wrong token is often one the grammar rejects, sometimes one it accepts but the head does not pick)."""

    def __init__(self, model, answers, *a):
        super().__init__(model, *a)
        self.answers, self.calls = answers, 0

    def draft(self, row: DraftRow, slot_logits):
        truth = self.answers[tuple(row.prompt_ids)]
        nxt = len(row.answer)
        out = []
        for j in range(self.k):
            self.calls += 1
            tok = truth[nxt + j] if nxt + j < len(truth) else 0
            out.append(tok if self.calls % 3 else (tok + 7) % 256)
        return out, []


def test_drafts_accepted_and_rejected_under_a_grammar_with_staggered_arrivals(hybrid_llm):
    model = hybrid_llm.model
    ps = prompts(hybrid_llm)
    grammar = schema_grammar(SCHEMAS["nested"])
    params = verified(grammar, max_tokens=48, draft_source="slots", early_exit=True)
    truth = {tuple(p): reference(hybrid_llm, p, params) for p in ps}
    dec = OracleDecoder(model, truth, len(ps), 128)
    handles, done = {}, {}
    for step in range(200):
        if step < len(ps):  # one new row per step, while the others decode
            p = ps[step]
            handles[tuple(p)] = dec.add(p, params, constraint=row_constraints([params], hybrid_llm.grammar_tokenizer)[0])
        if not dec.rows:
            break
        for row, _ in dec.step():
            if row.finished:
                done[tuple(row.prompt_ids)] = row.answer
                dec.remove(row)
    eos = model.config.eos_token_id
    for key, answer in done.items():
        assert [t for t in answer if t != eos] == truth[key]
    assert len(done) == len(ps)
    assert 0 < sum(dec.accepted) < sum(dec.drafted)  # some drafts held, some were rejected
    assert sum(len(a) for a in done.values()) > sum(h.passes for h in handles.values())  # > 1 token per pass


def test_engine_under_a_grammar_equals_reference_with_staggered_requests(hybrid_llm):
    """The engine (continuous batching, requests joining mid-flight) under verified decoding and a grammar: the
    reference's tokens, "stop", valid; a tool-call grammar too."""
    tok = hybrid_llm.tokenizer
    engine = Engine(hybrid_llm.model, end_ids=[tok.eos_token_id], grammar_tokenizer=hybrid_llm.grammar_tokenizer)
    tools = {"get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                             "required": ["city"], "additionalProperties": False}}
    grammars = [schema_grammar(SCHEMAS[n]) for n in ("flat", "refs", "array")] + [tool_call_grammar(tools, False)]
    jobs = list(zip(prompts(hybrid_llm), grammars, strict=True))
    requests = []
    while jobs or engine.has_unfinished():
        if jobs:
            p, g = jobs.pop(0)
            requests.append((p, engine.add_request(p, verified(g, max_tokens=96))))
        engine.step()
    for p, r in requests:
        assert r.finish_reason == "stop"
        assert r.final_prefix() == reference(hybrid_llm, p, r.params)
    for (_, r), name in zip(requests[:3], ("flat", "refs", "array"), strict=True):
        jsonschema.validate(json.loads(tok.decode(r.final_prefix())), SCHEMAS[name])


def test_prefix_cache_under_a_grammar_keeps_the_reference_answers(hybrid_llm):
    """Requests with one long prompt and different schemas arrive while others decode (structured_eval's
    pattern): the later ones reuse the prompt's cached blocks, and each answer is still the reference's."""
    tok = hybrid_llm.tokenizer
    prompt = tok.encode("Reply in JSON matching the schema. " * 3)
    assert len(prompt) > 32
    engine = Engine(hybrid_llm.model, end_ids=[tok.eos_token_id], grammar_tokenizer=hybrid_llm.grammar_tokenizer)
    jobs = [verified(schema_grammar(SCHEMAS[n]), max_tokens=64) for n in ("flat", "enum", "flat", "anyof")]
    requests = []
    while jobs or engine.has_unfinished():
        if jobs:
            requests.append(engine.add_request(prompt, jobs.pop(0)))
        engine.step()
    for r in requests:
        assert r.final_prefix() == reference(hybrid_llm, prompt, r.params)
    cache = engine.drafter.prefix_cache
    assert cache.hit_tokens == 3 * ((len(prompt) - 1) // 16 * 16)  # every request after the first


def test_sampled_answers_validate_and_close_within_the_budget(hybrid_llm):
    for name in NAMES:
        rows = [verified(schema_grammar(SCHEMAS[name]), max_tokens=40, temperature=0.7, seed=s) for s in range(3)]
        out = generate_verified(hybrid_llm.model, prompts(hybrid_llm)[:3], rows,
                                grammar_tokenizer=hybrid_llm.grammar_tokenizer)
        for ids in out.token_ids:
            jsonschema.validate(json.loads(hybrid_llm.tokenizer.decode(ids)), SCHEMAS[name])


def test_lookup_drafts_are_cut_where_the_grammar_rejects(hybrid_llm):
    tok = hybrid_llm.tokenizer
    c = Constraint(schema_grammar(SCHEMAS["enum"]), hybrid_llm.grammar_tokenizer)
    good = tok.encode('{"color":"red"')
    assert grammar_lookup_drafts(c, good + tok.encode("}")) == good  # "}" before "ok" is missing
    assert grammar_lookup_drafts(c, tok.encode("[1]")) == []


def test_speculative_sampling_under_a_grammar_keeps_the_masked_distribution(hybrid_llm):
    """Drafts from a distribution q that puts most mass on tokens the grammar rejects: the first committed token
    is distributed as the grammar-masked, renormalised next-token distribution p' (total variation below 0.05 over
    4,000 draws), and never a rejected token."""
    tok = hybrid_llm.tokenizer
    grammar = schema_grammar({"type": "object", "properties": {"d": {"enum": ["a", "b", "c"]}}, "required": ["d"],
                              "additionalProperties": False})
    prefix = tok.encode('{"d":"')
    vocab = hybrid_llm.model.config.vocab_size
    torch.manual_seed(0)
    p_logits = torch.randn(2, vocab) * 2  # (m + 1, V): logits at pending and after the draft
    base = Constraint(grammar, hybrid_llm.grammar_tokenizer)
    for t in prefix:
        assert base.consume(t)
    allowed = base.allowed(vocab)
    target = p_logits[0].masked_fill(~allowed, float("-inf")).softmax(-1).double()  # p'
    q = torch.full((vocab,), 0.5 / vocab, dtype=torch.float64)
    q[~allowed] += 0.5 / int((~allowed).sum())  # half the mass on rejected tokens
    q = q / q.sum()
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=1.0, top_p=1.0)
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(4000):
        draft = int(torch.multinomial(q, 1, generator=gen))
        _, new = verify_under_grammar(base, p_logits, [draft], [q], params, gen, remaining=1000)  # no budget rule
        counts[new[0]] += 1
        base.matcher.rollback(len(new))  # back to the state after the prefix
    assert bool((counts[~allowed] == 0).all())
    assert 0.5 * float((counts / counts.sum() - target).abs().sum()) < 0.05


@pytest.mark.parametrize("decoding", ["verified", "fixed"])
def test_stop_token_ids_never_cut_constrained_json(hybrid_llm, decoding):
    """A stop token id the grammar allows (here '"' and ':') does not end a constrained answer early."""
    tok = hybrid_llm.tokenizer
    engine = Engine(hybrid_llm.model, end_ids=[tok.eos_token_id], grammar_tokenizer=hybrid_llm.grammar_tokenizer)
    grammar = schema_grammar(SCHEMAS["flat"])
    stops = [i for t in ('"', ":") for i in tok.encode(t)]
    prompt = prompts(hybrid_llm)[0]
    plain = engine.add_request(prompt, verified(grammar, decoding=decoding))
    stopped = engine.add_request(prompt, verified(grammar, decoding=decoding, stop_token_ids=stops))
    while engine.has_unfinished():
        engine.step()
    assert stopped.finish_reason == "stop" and stopped.final_prefix() == plain.final_prefix()
    jsonschema.validate(json.loads(tok.decode(stopped.final_prefix())), SCHEMAS["flat"])
