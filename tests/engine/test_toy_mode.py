"""A decoding mode written here, in this file, and registered from it (``celeris.sampling.modes.register_mode``):
the engine, the command line and the HTTP server run it with no edit anywhere else.

The toy mode: each pass reads the prompt, the answer committed so far and ``K`` mask slots (on a causal model, no
KV cache) and commits the argmax of the slots' logits, ``K`` answer tokens per pass. It equals the plain loop
``toy_loop`` below, and in one batch with a masked, a block and a verified request each of the four gets the
tokens it gets alone.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from celeris.cli import main
from celeris.config import EngineConfig
from celeris.engine.engine import Engine
from celeris.engine.path import PathContext
from celeris.engine.request import Request
from celeris.llm import LLM
from celeris.sampling.modes import DecodingMode, decoding_is, mode_of, register_mode, unregister_mode
from celeris.sampling.params import SamplingParams
from celeris.sampling.rules import COMMIT_RULES, CommitRule
from celeris.serve.app import BackgroundServer, create_app
from tests.conftest import build_tiny_checkpoint
from tests.serve.conftest import CONTEXT, TEXTS, make_serving

# ---- the toy mode: its check, its pass layout, its commit and its token cost (at most 60 lines) ----
K = 2  # answer tokens a toy pass commits


def toy_check(model: torch.nn.Module, params: SamplingParams, has_suffix: bool) -> None:
    """Refuse, naming the parameter first, what the toy cannot run: a model that is not causal, a suffix, sampling."""
    if not getattr(model.config, "is_causal", False):
        raise ValueError("decoding 'toy' needs a causal model")
    if has_suffix:
        raise ValueError("suffix (infilling) is not supported with decoding 'toy'")
    if params.temperature != 0:
        raise ValueError(f"temperature must be 0 with decoding 'toy' (it commits the argmax); got {params.temperature}")


class ToyPath:
    """The toy's engine path; ``request.state`` is the number of answer tokens it has committed."""

    def __init__(self, context: PathContext) -> None:
        self.runner, self.eos_id = context.runner, context.eos_id
        self.mask_id, self.pad_id = context.model.config.mask_token_id, context.model.config.pad_token_id

    def layout(self, r: Request) -> torch.Tensor:
        """(prompt + committed + K,) int64: the columns of r's next pass, its last K the mask slots."""
        return torch.cat([r.canvas[: r.answer_start + (r.state or 0)], torch.full((K,), self.mask_id)])

    def token_cost(self, requests: list[Request]) -> int:
        return len(requests) * max(len(self.layout(r)) for r in requests)

    def step(self, requests: list[Request]) -> list[Request]:
        rows = [self.layout(r) for r in requests]
        ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=self.pad_id)  # (B, T)
        attn = torch.arange(ids.shape[1])[None] < torch.tensor([len(row) for row in rows])[:, None]  # (B, T)
        logits = self.runner.model(ids.to(self.runner.device), attn.to(self.runner.device))  # (B, T, V)
        for i, r in enumerate(requests):
            start, done = len(rows[i]) - K, r.state or 0
            new = logits[i, start : start + K].argmax(-1)[: r.params.max_tokens - done].cpu()  # the commit
            r.canvas[start : start + len(new)] = new
            r.state = done + len(new)
            r.record_step()
            ended = not r.ends(self.eos_id).isdisjoint(new.tolist())
            if ended or r.state == r.params.max_tokens:
                r.finish("stop" if ended else "length")
        return requests

    def kv_rows(self, r: Request) -> int:
        return 0  # the toy holds no keys/values

    def release(self) -> None:
        """Nothing to free."""


TOY = DecodingMode("toy", toy_check, decoding_is("toy"), ToyPath,
                   rule=CommitRule(None, "toy: the argmax of K mask slots per pass, no KV cache"))
# ---- end of the toy mode ----


@pytest.fixture(scope="module", autouse=True)
def toy_registered():
    register_mode(TOY)
    yield
    unregister_mode("toy")
    assert "toy" not in COMMIT_RULES


def toy_loop(model: torch.nn.Module, prompt: list[int], n: int, ends: set[int]) -> list[int]:
    """The toy mode as a plain loop, one prompt: its answer cut before the first end id."""
    answer: list[int] = []
    while len(answer) < n:
        logits = model(torch.tensor([prompt + answer + [model.config.mask_token_id] * K]))  # (1, T, V)
        answer += logits[0, -K:].argmax(-1).tolist()[: n - len(answer)]
    return next((answer[:i] for i, t in enumerate(answer) if t in ends), answer)


def run_alone(model: torch.nn.Module, prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    engine = Engine(model, EngineConfig(max_num_seqs=1))
    request = engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    return request.final_prefix(model.config.eos_token_id), request.finish_reason


def toy_params() -> SamplingParams:
    """A toy request's settings (built after the fixture registered the mode: ``decoding="toy"`` is valid then)."""
    return SamplingParams(max_tokens=7, decoding="toy", block_length=1)


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]


def test_toy_mode_equals_its_plain_loop_and_is_selected_by_its_decoding_value(hybrid):
    params = toy_params()
    assert mode_of(hybrid, params) == "toy"
    eos = hybrid.config.eos_token_id
    engine = Engine(hybrid, EngineConfig(max_num_seqs=3))
    requests = [engine.add_request(p, params) for p in PROMPTS]
    assert {r.mode for r in requests} == {"toy"}
    while engine.has_unfinished():
        engine.step()
    answers = {tuple(toy_loop(hybrid, p, params.max_tokens, {eos})) for p in PROMPTS}
    assert len(answers) == len(PROMPTS) and all(answers)  # the rows differ: batching cannot hide a mix-up
    for prompt, r in zip(PROMPTS, requests, strict=True):
        assert r.final_prefix(eos) == toy_loop(hybrid, prompt, params.max_tokens, {eos})
        assert r.nfe == r.num_steps == -(-(r.state or 0) // K)  # one pass per K tokens
    with pytest.raises(ValueError, match="^temperature"):
        engine.add_request([5], SamplingParams(max_tokens=4, decoding="toy", temperature=0.5))


def test_a_batch_mixing_the_toy_with_the_built_in_modes_gives_each_its_solo_tokens(hybrid):
    settings = {
        "toy": toy_params(),
        "masked": SamplingParams(max_tokens=6, block_length=1, steps=6, cache="delayed", early_exit=False),
        "block": SamplingParams(max_tokens=8, block_length=4, steps=4, early_exit=False),
        "verified": SamplingParams(max_tokens=8, block_length=1, decoding="verified", early_exit=False),
    }
    engine = Engine(hybrid, EngineConfig(max_num_seqs=4))
    requests = {mode: engine.add_request([5 + i, 6, 7 + i], p) for i, (mode, p) in enumerate(settings.items())}
    engine.step()
    assert {r.mode for r in engine.scheduler.running} == set(settings)  # all four ran in the first step
    while engine.has_unfinished():
        engine.step()
    for i, (mode, params) in enumerate(settings.items()):
        r = requests[mode]
        assert r.mode == mode
        assert (r.final_prefix(hybrid.config.eos_token_id), r.finish_reason) == run_alone(
            hybrid, [5 + i, 6, 7 + i], params), mode


@pytest.fixture(scope="module")
def hybrid_folder(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("toy"), TEXTS, "tiny-hybrid", CONTEXT,
                                 {"max_tokens": 8, "temperature": 0.0}, is_causal=True, draft_block_size=3)


def test_the_toy_runs_through_the_command_line_and_a_live_server(hybrid_folder, capsys):
    prompt = "def fibonacci(n):"
    llm = LLM(hybrid_folder, device="cpu")
    params = llm.default_params(decoding="toy", max_tokens=6)
    prompt_ids, _ = llm.encode_prompt(prompt, params)
    expected = toy_loop(llm.model, prompt_ids, 6, set(llm.end_token_ids))
    offline = llm.generate(prompt, params)[0]
    assert expected and offline.token_ids == expected

    code = main(["generate", prompt, "--model", str(hybrid_folder), "--device", "cpu", "--raw", "--json",
                 "--decoding", "toy", "--max-tokens", "6"])
    out, err = capsys.readouterr()
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert record["decoding"] == "toy" and record["token_ids"] == expected

    with BackgroundServer(create_app(make_serving(llm))) as server:
        r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                       json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "decoding": "toy"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == offline.text
        bad = httpx.post(f"{server.url}/v1/completions", timeout=30,
                         json={"prompt": prompt, "max_tokens": 6, "temperature": 0.5, "decoding": "toy"})
        assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]


def test_the_reference_sampler_refuses_modes_it_does_not_run_naming_decoding(hybrid):
    """The reference sampler runs masked and block diffusion; a request of another mode (the toy, verified) is
    refused with a ValueError naming ``decoding``, not run through a commit rule it does not have."""
    from celeris.reference.masked import generate

    for params in (toy_params(), SamplingParams(max_tokens=4, block_length=1, cache="delayed", decoding="verified")):
        with pytest.raises(ValueError, match=f"^decoding '{params.decoding}' is the {params.decoding} mode"):
            generate(hybrid, [[5, 6, 7]], params)
