"""A draft proposer written here, in this file, and registered from it (``celeris.engine.proposers.register_proposer``):
verified decoding in the engine, the command line and the HTTP server draft with it with no edit anywhere else.

The toy proposer, ``stutter``: it drafts the row's last committed token up to ``STUTTER`` times (so it is accepted
where the target repeats itself), and counts what the target accepted of its drafts (``observe``). The target
verifies every draft, so at temperature 0 the answer is the target's own next-token answer, whoever drafts.
"""

from __future__ import annotations

import json

import httpx
import pytest

from celeris.cli import main
from celeris.config import EngineConfig
from celeris.engine.engine import Engine
from celeris.engine.proposers import DraftAsk, Drafts, Proposer, one_hot, register_proposer, unregister_proposer
from celeris.llm import LLM
from celeris.reference.autoregressive import generate_autoregressive
from celeris.sampling.params import SamplingParams
from celeris.sampling.rules import DRAFT_SOURCES
from celeris.serve.app import BackgroundServer, create_app
from tests.conftest import build_tiny_checkpoint, tiny_model
from tests.serve.conftest import CONTEXT, TEXTS, make_serving

# ---- the toy proposer: its drafts, what it observes and its check (at most 60 lines) ----
STUTTER = 3  # the most drafts it gives


class Stutter(Proposer):
    """Drafts the last committed token ``min(k, STUTTER)`` times; its passes compute no mask slots."""

    given: list[int] = []  # drafts per ask, in order
    accepted: list[int] = []  # what every row's passes accepted of its drafts, in order

    def propose(self, asks: list[DraftAsk]) -> list[Drafts]:
        out = []
        for ask in asks:
            tokens = [ask.last_token] * min(ask.row.k, STUTTER)
            Stutter.given.append(len(tokens))
            out.append(Drafts(tokens, one_hot(tokens, ask.vocab, ask.row.params.temperature)))
        return out

    def observe(self, row: object, accepted: int) -> None:
        Stutter.accepted.append(accepted)


def stutter_check(params: SamplingParams, drafter: object, slots: int) -> None:
    """Refuse, naming the parameter first, more drafts than it ever gives."""
    k = params.num_speculative_tokens
    if k is not None and k > STUTTER:
        raise ValueError(f"num_speculative_tokens must be at most {STUTTER} with draft_source 'stutter', got {k}")
# ---- end of the toy proposer ----


@pytest.fixture(scope="module", autouse=True)
def stutter_registered():
    register_proposer("stutter", Stutter, "the last token again (a test's toy)", stutter_check)
    yield
    unregister_proposer("stutter")
    assert "stutter" not in DRAFT_SOURCES


def greedy(model: object, prompt: list[int], n: int) -> list[int]:
    """The plain next-token loop (the reference sampler), one prompt."""
    return generate_autoregressive(model, [prompt], SamplingParams(max_tokens=n, steps=n)).token_ids[0]


def verified(draft_source: str, n: int = 12, k: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=n, decoding="verified", draft_source=draft_source, early_exit=False,
                          num_speculative_tokens=k)


PROMPTS = [[5, 9, 11, 40], [7, 7, 7], [20, 21, 22, 23, 24], [33, 3, 60]]


def test_stutter_drafts_are_verified_and_observed_in_a_batch_with_prompt_lookup_rows():
    model = tiny_model(seed=5, is_causal=True)
    engine = Engine(model, EngineConfig(max_num_seqs=4))
    Stutter.given.clear(), Stutter.accepted.clear()
    requests = [engine.add_request(p, verified("stutter" if i % 2 == 0 else "lookup")) for i, p in enumerate(PROMPTS)]
    while engine.has_unfinished():
        engine.step()
    for prompt, r in zip(PROMPTS, requests, strict=True):  # every row its own next-token answer
        assert r.final_prefix(model.config.eos_token_id) == greedy(model, prompt, 12)
    assert Stutter.given and set(Stutter.given) == {STUTTER}  # the rows' k is 4: it gave 3 each time
    # each pass of a stutter row was observed once; a pass commits its accepted drafts and one token (the last pass
    # of a row may be cut at max_tokens, all of which it commits), so the accepted drafts cover them less one a pass
    stutter_rows = [r for i, r in enumerate(requests) if i % 2 == 0]
    assert len(Stutter.accepted) == sum(r.nfe for r in stutter_rows)
    assert sum(r.params.max_tokens - r.nfe for r in stutter_rows) <= sum(Stutter.accepted) <= STUTTER * len(
        Stutter.accepted)
    assert sum(Stutter.accepted) > 0  # the stuttering prompt [7, 7, 7] is repeated at least once
    with pytest.raises(ValueError, match="^num_speculative_tokens must be at most 3"):
        engine.add_request([5], verified("stutter", k=4))


@pytest.fixture(scope="module")
def causal_folder(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("stutter"), TEXTS, "tiny-causal", CONTEXT,
                                 {"max_tokens": 8, "temperature": 0.0}, is_causal=True)


def test_stutter_runs_through_the_command_line_and_a_live_server(causal_folder, capsys):
    prompt = "def fibonacci(n):"
    llm = LLM(causal_folder, device="cpu")
    params = llm.default_params(decoding="verified", draft_source="stutter", max_tokens=6)
    prompt_ids, _ = llm.encode_prompt(prompt, params)
    expected = greedy(llm.model, prompt_ids, 6)
    offline = llm.generate(prompt, params)[0]
    assert offline.token_ids == expected[: len(offline.token_ids)] and offline.token_ids

    code = main(["generate", prompt, "--model", str(causal_folder), "--device", "cpu", "--raw", "--json",
                 "--decoding", "verified", "--draft-source", "stutter", "--max-tokens", "6"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["token_ids"] == offline.token_ids

    with BackgroundServer(create_app(make_serving(llm))) as server:
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "decoding": "verified", "draft_source": "stutter"}
        r = httpx.post(f"{server.url}/v1/completions", timeout=30, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == offline.text
        bad = httpx.post(f"{server.url}/v1/completions", timeout=30, json={**body, "num_speculative_tokens": 5})
        assert bad.status_code == 400 and "num_speculative_tokens" in bad.json()["error"]["message"]
