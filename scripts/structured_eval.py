"""Structured-output check on a model: N schema-constrained requests over many JSON Schemas (random seeds,
temperature 0.7): how many parse and validate (answers cut by ``length`` count as failures), and tokens per
forward pass and tokens/s against the same requests without a schema.

    PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/structured_eval.py --requests 200 [--model PATH] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import jsonschema

from celeris.llm import LLM
from celeris.structured.grammar import schema_grammar

FIELDS = [
    ("name", {"type": "string", "maxLength": 12}),
    ("age", {"type": "integer", "minimum": 0, "maximum": 120}),
    ("score", {"type": "number", "minimum": 0, "maximum": 1}),
    ("ok", {"type": "boolean"}),
    ("color", {"enum": ["red", "green", "blue"]}),
    ("tags", {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3}),
    ("zip", {"type": "string", "pattern": "^[0-9]{5}$"}),
    ("point", {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
               "required": ["x", "y"], "additionalProperties": False}),
    ("value", {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 4}]}),
    ("items", {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1, "maxItems": 2}),
    ("note", {"type": "string"}),
    ("count", {"type": "integer"}),
]
CONSTRAINED: dict = {}
ITEM = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                         "label": {"type": "string", "maxLength": 8}},
        "required": ["id"], "additionalProperties": False}


def make_schemas(n: int, seed: int = 0) -> list[dict]:
    """``n`` different object schemas of 1-4 fields from ``FIELDS`` (some optional, some with $defs/$ref)."""
    rng = random.Random(seed)
    schemas, seen = [], set()
    while len(schemas) < n:
        names = tuple(sorted(rng.sample(range(len(FIELDS)), rng.randint(1, 4))))
        if names in seen:
            continue
        seen.add(names)
        props = {FIELDS[i][0]: FIELDS[i][1] for i in names}
        required = [k for k in props if rng.random() < 0.75] or [next(iter(props))]
        schema = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
        if "items" in props:
            schema["$defs"] = {"Item": ITEM}
        schemas.append(schema)
    return schemas


def run_mode(llm: LLM, jobs: list[tuple[int, int]], mode: str, grammars: list[str], schemas: list[dict],
             prompts: dict[int, list[int]]) -> dict:
    """Run ``jobs`` (schema index, seed), all queued at once (the engine runs --batch at a time and refills freed
    slots, as a server does), with or without their schemas: valid / cut counts, tokens, forwards, seconds."""
    valid = cut = tokens = forwards = 0
    start = time.perf_counter()
    reqs = []
    for k, seed in jobs:
        extra = {"grammar": grammars[k], **CONSTRAINED} if mode == "constrained" else {}
        params = llm.default_params(temperature=0.7, seed=seed, **extra)
        reqs.append((k, llm.engine.add_request(prompts[k], params)))
    while any(not r.is_finished for _, r in reqs):
        llm.engine.step()
    seconds = time.perf_counter() - start
    for k, r in reqs:
        out = llm.to_output("", r)
        tokens += int((r.answer != r.mask_id).sum())
        forwards += r.nfe
        cut += out.finish_reason == "length"
        try:
            jsonschema.validate(json.loads(out.text), schemas[k])
            valid += out.finish_reason == "stop"
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    return {"valid": valid, "cut": cut, "tokens": tokens, "forwards": forwards, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--schemas", type=int, default=24)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1, help="split the requests into this many rounds, each running "
                    "the constrained then the unconstrained requests (a fairer comparison on a shared machine)")
    args = ap.parse_args()
    llm = LLM(args.model, device="cpu", max_num_seqs=args.batch)
    schemas = make_schemas(args.schemas)
    grammars = [schema_grammar(s) for s in schemas]
    rng = random.Random(1)
    jobs = [(i % len(schemas), rng.getrandbits(31)) for i in range(args.requests)]
    prompts = {i: llm.tokenizer.encode_chat([{"role": "user", "content": "Reply in JSON matching: "
                                              + json.dumps(s)}]) for i, s in enumerate(schemas)}
    totals = {mode: {"valid": 0, "cut": 0, "tokens": 0, "forwards": 0, "seconds": 0.0}
              for mode in ("constrained", "unconstrained")}
    size = -(-len(jobs) // args.rounds)
    for r in range(args.rounds):  # the modes alternate, so a shared machine's load drifts over both alike
        chunk = jobs[r * size : (r + 1) * size]
        for mode, total in totals.items():
            for key, value in run_mode(llm, chunk, mode, grammars, schemas, prompts).items():
                total[key] += value
    report = {}
    for mode, t in totals.items():
        report[mode] = {"requests": len(jobs), "valid": t["valid"], "cut_by_length": t["cut"],
                        "answer_tokens_mean": round(t["tokens"] / len(jobs), 1),
                        "tokens_per_forward": round(t["tokens"] / t["forwards"], 3),
                        "tokens_per_s": round(t["tokens"] / t["seconds"], 1), "seconds": round(t["seconds"], 1)}
        print(mode, report[mode], flush=True)
    print(json.dumps({"schemas": len(schemas), **report}))


if __name__ == "__main__":
    main()
