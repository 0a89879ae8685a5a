"""The server pieces behind the playground (fast, no browser): the denoise stream's canvas fields, several models
behind one server (``ModelRouter`` / ``--also-serve``) with a ``model`` metrics label, model cards with their
generation defaults, and the page itself served at ``/`` without the API key."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from celeris.serve.app import BackgroundServer, create_app
from celeris.serve.metrics import ServerMetrics
from celeris.serve.models_router import ModelRouter
from celeris.serve.serving import OpenAIServing
from tests.serve.conftest import GENERATION_CONFIG, MODEL_NAME
from tests.serve.test_openai_client import sse_events

PROMPT = "def fibonacci(n):"


def denoise_chunks(url: str, body: dict, headers: dict | None = None) -> list[dict]:
    body = {**body, "stream": True, "stream_mode": "denoise"}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        return [json.loads(e) for e in sse_events(resp)[:-1]]


def test_denoise_chunks_carry_token_pieces_and_the_step_that_committed_each(server):
    body = {"prompt": PROMPT, "max_tokens": 16, "steps": 8, "block_length": 8, "seed": 3, "temperature": 1.0}
    chunks = denoise_chunks(server.url, body)
    details = [c["choices"][0]["celeris"] for c in chunks]
    assert all(len(d["tokens"]) == len(d["token_steps"]) == 16 and d["drafts"] == [] for d in details)
    previous = [None] * 16
    for d in details:
        for i, (piece, step) in enumerate(zip(d["tokens"], d["token_steps"], strict=True)):
            assert (piece is None) == (step is None)  # a piece exactly where a commit step is
            if previous[i] is None and step is not None:
                assert step == d["steps"]  # newly committed positions carry this chunk's step
            elif previous[i] is not None:
                assert step == previous[i]  # a commit step never changes
        previous = d["token_steps"]
    assert sorted({s for s in previous if s is not None}) == list(range(1, details[-1]["steps"] + 1))
    final = chunks[-1]["choices"][0]
    assert final["finish_reason"] is not None and None not in final["celeris"]["tokens"]
    full = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()["choices"][0]
    assert final["text"] == full["text"]
    assert final["celeris"]["nfe"] == full["celeris"]["nfe"] and final["celeris"]["steps"] == full["celeris"]["steps"]
    pieces = final["celeris"]["tokens"]
    end = pieces.index("") if "" in pieces else len(pieces)  # end-of-text decodes to ""
    assert "".join(pieces[:end]) == full["text"]  # each piece is its token decoded alone


def test_model_cards_carry_the_generation_defaults(server):
    card = httpx.get(f"{server.url}/v1/models/{MODEL_NAME}", timeout=10).json()
    assert card["decoding_kind"] == "diffusion"
    assert card["generation_config"]["steps"] == GENERATION_CONFIG["steps"]
    listed = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert [{**c, "created": 0} for c in listed] == [{**card, "created": 0}]  # "created" is each answer's clock


def test_the_page_is_served_without_the_key_while_the_api_needs_it(serve_llm):
    from tests.serve.conftest import make_serving

    with BackgroundServer(create_app(make_serving(serve_llm), api_key="k1")) as srv:
        page = httpx.get(f"{srv.url}/", timeout=10)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "Celeris" in page.text and "/static/playground.js" in page.text
        for name in ("playground.js", "playground.css"):
            assert httpx.get(f"{srv.url}/static/{name}", timeout=10).status_code == 200
        assert httpx.get(f"{srv.url}/static/missing.js", timeout=10).status_code == 404
        assert httpx.get(f"{srv.url}/v1/models", timeout=10).status_code == 401
        assert httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer k1"}, timeout=10).status_code == 200


@pytest.fixture(scope="module")
def two_models(serve_llm):
    from celeris.config import EngineConfig

    shared = ServerMetrics()
    servings = [OpenAIServing(serve_llm, served_model_name=name, metrics=shared,
                              engine_config=EngineConfig(max_num_seqs=2, max_waiting=4)) for name in ("m-a", "m-b")]
    with BackgroundServer(create_app(ModelRouter(servings))) as srv:
        yield srv


def test_requests_choose_their_model_and_metrics_carry_a_model_label(two_models):
    url = two_models.url
    assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]] == ["m-a", "m-b"]
    assert httpx.get(f"{url}/v1/models/m-b", timeout=10).json()["id"] == "m-b"
    body = {"prompt": PROMPT, "max_tokens": 4, "steps": 4}
    for model, expected in ((None, "m-a"), ("m-a", "m-a"), ("m-b", "m-b")):
        resp = httpx.post(f"{url}/v1/completions", json={**body, "model": model}, timeout=30).json()
        assert resp["model"] == expected
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "model": "m-b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).json()
    assert chat["model"] == "m-b"
    missing = httpx.post(f"{url}/v1/completions", json={**body, "model": "nope"}, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert "'m-a', 'm-b'" in missing.json()["error"]["message"]
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    for model, count in (("m-a", 2), ("m-b", 2)):
        line = next(x for x in metrics.splitlines() if x.startswith(f'celeris_request_nfe_count{{model="{model}"}}'))
        assert float(line.split()[-1]) == count
    assert 'celeris_spec_decode_num_draft_tokens_total{model="m-b"}' in metrics
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}


def test_a_router_refuses_two_models_of_one_name(serve_llm):
    from celeris.config import EngineConfig

    servings = [OpenAIServing(serve_llm, served_model_name="same", engine_config=EngineConfig(max_num_seqs=1))
                for _ in range(2)]
    with pytest.raises(ValueError, match="same name"):
        ModelRouter(servings)
    servings[1].model_name = "other"
    with pytest.raises(ValueError, match="share one registry"):
        ModelRouter(servings)


def test_also_serve_options_are_checked(capsys):
    from celeris.cli import main

    for args, message in ((["--also-serve", "/no/such/folder"], "does not exist"),
                          (["--model", "celeris-code-6m", "--also-serve", "celeris-code-6m"], "the same name")):
        assert main(["serve", *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_the_page_forbids_inline_scripts_and_framing_and_has_none(server):
    """A Content-Security-Policy on ``/`` (scripts only from this server, no inline script or handler, never
    framed) and ``nosniff`` on the page and its files; the page itself needs nothing the policy forbids."""
    from html.parser import HTMLParser

    page = httpx.get(f"{server.url}/", timeout=10)
    policy = {d.split()[0]: d.split()[1:] for d in page.headers["content-security-policy"].split(";") if d.strip()}
    assert policy["script-src"] == ["'self'"] and policy["frame-ancestors"] == ["'none'"]
    assert policy["default-src"] == ["'self'"] and policy["object-src"] == ["'none'"]
    assert page.headers["x-content-type-options"] == "nosniff"
    for name in ("playground.js", "playground.css"):
        assert httpx.get(f"{server.url}/static/{name}", timeout=10).headers["x-content-type-options"] == "nosniff"

    class Inline(HTMLParser):
        found: list[str] = []
        in_script = False

        def handle_starttag(self, tag, attrs):
            self.in_script = tag == "script"
            if tag == "script" and not dict(attrs).get("src"):
                self.found.append("script without src")
            self.found += [f"{tag} {name}" for name, value in attrs
                           if name.startswith("on") or name == "style" or "javascript:" in (value or "")]

        def handle_data(self, data):
            if self.in_script and data.strip():
                self.found.append("inline script text")

    parser = Inline()
    parser.feed(page.text)
    assert parser.found == []
    script = httpx.get(f"{server.url}/static/playground.js", timeout=10).text
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function", script)
