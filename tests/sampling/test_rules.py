"""The commit rules (``celeris.sampling.rules``) on hand-made confidences and brute force, and the registry: a
rule registered by a test, reusing an existing setting, runs through the reference sampler, the engine, a CLI flag
and an HTTP field with no other edit (issue 16's acceptance test: the CLI choices, the HTTP validation and
SamplingParams read the registry at call time)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from celeris.cli import main
from celeris.llm import LLM
from celeris.reference.masked import generate
from celeris.sampling.params import SamplingParams, register_commit_rule, rule_settings, unregister_commit_rule
from celeris.sampling.rules import (
    COMMIT_RULES,
    CommitRule,
    commit_entropy,
    commit_factor,
    commit_fixed,
    commit_threshold,
)
from celeris.sampling.select import NEG_INF, rank_desc
from celeris.serve.app import BackgroundServer, create_app
from celeris.serve.serving import OpenAIServing
from tests.conftest import PYTHON_SNIPPETS, build_tiny_checkpoint

PROMPT = "def fibonacci(n):"
# 16 answer tokens in blocks of 8 and 16 steps: 'fixed' commits one token per step (16 passes), the toy rule
# at threshold 1 (no confidence exceeds it) exactly two (8 passes).
FIELDS = {"max_tokens": 16, "steps": 16, "block_length": 8}


def conf_of(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_fixed_commits_top_k_masked_positions():
    conf = conf_of([[0.2, 0.9, NEG_INF, 0.5, 0.7], [0.1, NEG_INF, NEG_INF, 0.3, 0.2]])
    chosen = commit_fixed(conf, num_tokens=torch.tensor([2, 3]))
    assert chosen.tolist() == [[False, True, False, False, True], [True, False, False, True, True]]
    # asking for more than are masked commits only masked positions
    chosen = commit_fixed(conf, num_tokens=torch.tensor([5, 5]))
    assert chosen.tolist() == (conf > NEG_INF).tolist()
    assert not commit_fixed(conf, num_tokens=torch.tensor([0, 0])).any()


def test_threshold_commits_exactly_those_above():
    conf = conf_of([[0.95, 0.5, 0.91, NEG_INF, 0.9], [0.3, 0.2, NEG_INF, 0.6, 0.1]])
    chosen = commit_threshold(conf, threshold=0.9)
    # strictly greater than the threshold: 0.9 itself is not committed
    assert chosen[0].tolist() == [True, False, True, False, False]
    # nothing above: exactly one, the most confident
    assert chosen[1].tolist() == [False, False, False, True, False]


def test_threshold_per_row_tensor():
    conf = conf_of([[0.8, 0.6, 0.4], [0.8, 0.6, 0.4]])
    chosen = commit_threshold(conf, threshold=torch.tensor([[0.5], [0.7]], dtype=torch.float64))
    assert chosen.tolist() == [[True, True, False], [True, False, False]]


def test_threshold_never_commits_unmasked():
    conf = conf_of([[NEG_INF, NEG_INF, NEG_INF]])
    assert not commit_threshold(conf, threshold=0.5).any()


def test_factor_rule():
    # factor 1: the j-th most confident needs c_j >= 1 - 1 / (j + 1): 0.5, 0.667, 0.75, 0.8 ...
    conf = conf_of([[0.9, 0.7, 0.76, 0.3, NEG_INF], [0.4, 0.2, NEG_INF, 0.1, 0.3], [0.99, 0.98, 0.97, 0.96, 0.95]])
    chosen = commit_factor(conf, factor=1.0)
    assert chosen[0].tolist() == [True, False, True, False, False]  # 0.9 >= .5, 0.76 >= .667, 0.7 < .75
    assert chosen[1].tolist() == [True, False, False, False, False]  # none qualifies: the best one
    assert chosen[2].all()
    # a larger factor lowers the bar: with factor 2, 0.7 >= 1 - 2/4 = 0.5 and 0.3 < 1 - 2/5
    assert commit_factor(conf[:1], factor=2.0)[0].tolist() == [True, True, True, False, False]


def test_factor_rule_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    conf = torch.rand(50, 6, generator=gen, dtype=torch.float64)
    conf[torch.rand(50, 6, generator=gen) < 0.3] = NEG_INF
    for factor in (0.5, 1.0, 1.5):
        chosen = commit_factor(conf, factor=factor)
        for row, got in zip(conf.tolist(), chosen.tolist(), strict=True):
            order = sorted((c, -i, i) for i, c in enumerate(row) if c > NEG_INF)[::-1]
            n = 0
            while n < len(order) and order[n][0] >= 1 - factor / (n + 2):
                n += 1
            n = max(n, 1) if order else 0
            expected = {i for _, _, i in order[:n]}
            assert {i for i, g in enumerate(got) if g} == expected


def test_entropy_bound():
    conf = conf_of([[0.9, 0.8, 0.7, 0.6], [0.9, 0.8, 0.7, NEG_INF], [0.5, 0.6, NEG_INF, NEG_INF]])
    entropy = conf_of([[0.1, 0.2, 0.3, 0.05], [2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    chosen = commit_entropy(conf, entropy=entropy, entropy_bound=0.35)
    assert chosen[0].tolist() == [True, True, False, False]  # 0.1 + 0.2 <= 0.35 < 0.6
    assert chosen[1].tolist() == [True, False, False, False]  # first already over: still commit one
    assert chosen[2].tolist() == [True, True, False, False]  # unmasked never, however low the entropy
    everything = commit_entropy(conf, entropy=entropy, entropy_bound=1e9)
    assert everything.tolist() == (conf > NEG_INF).tolist()


def commit_at_least_two(conf: torch.Tensor, threshold: torch.Tensor, **_: object) -> torch.Tensor:
    """Toy rule: every masked position with confidence > threshold, and at least the two most confident."""
    return (conf > threshold) | ((rank_desc(conf) < 2) & (conf > NEG_INF))


@pytest.fixture
def toy_rule():
    register_commit_rule("toy", CommitRule(commit_at_least_two, "threshold, at least two", params=("threshold",)))
    yield "toy"
    unregister_commit_rule("toy")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    config = {"max_tokens": 16, "steps": 16, "block_length": 8, "temperature": 0.0}
    return build_tiny_checkpoint(tmp_path_factory.mktemp("rules"), PYTHON_SNIPPETS, "tiny-rules", 64, config)


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder, device="cpu")


def test_registered_rule_is_validated_and_declares_its_settings(toy_rule):
    assert rule_settings()["threshold"] == ("decoding", ("threshold", "low_confidence_dynamic", "toy"))
    assert "toy" in rule_settings()["remasking"][1]  # a denoising rule reads the remasking and top_k settings
    with pytest.raises(ValueError, match="^factor applies to decoding='factor' only; got decoding='toy'"):
        SamplingParams(decoding="toy", factor=2.0)
    with pytest.raises(ValueError, match="already registered"):
        register_commit_rule("toy", COMMIT_RULES["toy"])
    with pytest.raises(ValueError, match="unknown settings or needs: no_such_field"):
        register_commit_rule("other", CommitRule(commit_at_least_two, "x", params=("no_such_field",)))


def test_unregistered_rule_is_refused():
    with pytest.raises(ValueError, match="^decoding must be one of fixed, threshold"):
        SamplingParams(decoding="toy")


def test_toy_rule_through_sampler_engine_cli_and_http(toy_rule, llm, folder, capsys):
    params = SamplingParams(decoding="toy", threshold=1.0, **FIELDS)
    prompt_ids = llm.tokenizer.encode(PROMPT)
    filled = []
    reference = generate(llm.model, [prompt_ids], params,
                         on_step=lambda answer: filled.append(int((answer != llm.model.config.mask_token_id).sum())))
    assert reference.nfe == 8 and filled[:2] == [2, 4]  # two positions per step, where fixed would commit one
    fixed = generate(llm.model, [prompt_ids], SamplingParams(**FIELDS))
    assert fixed.nfe == 16

    engine = llm.generate([prompt_ids], params)[0]  # the engine: same tokens, same passes
    assert engine.token_ids == reference.token_ids[0] and engine.nfe == 8

    code = main(["generate", PROMPT, "--model", str(folder), "--device", "cpu", "--json", "--max-tokens", "16",
                 "--steps", "16", "--block-length", "8", "--decoding", "toy", "--threshold", "1.0"])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and record["nfe"] == 8 and record["token_ids"] == engine.token_ids
    assert main(["generate", PROMPT, "--model", str(folder), "--decoding", "toy", "--factor", "2"]) == 2
    assert "factor applies to decoding='factor' only; got decoding='toy'" in capsys.readouterr().err

    serving = OpenAIServing(llm, served_model_name="tiny-rules")
    with BackgroundServer(create_app(serving)) as server:
        body = {"prompt": PROMPT, "max_tokens": 16, "steps": 16, "block_length": 8, "temperature": 0.0,
                "decoding": "toy", "threshold": 1.0}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["nfe"] == 8 and reply.json()["choices"][0]["text"] == engine.text
        unregister_commit_rule("toy")  # gone from the registry: the same request is refused, naming the field
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "decoding"


def test_a_block_of_one_commits_as_the_ranked_rules_do_without_their_confidences():
    """``commit_single`` (a block of one column, the fixed rule by probability) gives what ranking the confidences
    gives (``rank_and_commit``), greedy and sampled, with penalties and filters; a row whose logits are NaN, +inf or
    all -inf (its confidence is NaN) is left to the ranking, where it commits nothing."""
    from celeris.sampling.select import sample_tokens
    from celeris.sampling.step import History, RowSettings, commit_single, denoise_step, prepare_logits, rank_and_commit

    mask, vocab = 0, 40
    rows = [SamplingParams(temperature=0.0, frequency_penalty=0.5), SamplingParams(temperature=0.8, top_p=0.9),
            SamplingParams(temperature=0.0, repetition_penalty=1.3), SamplingParams(temperature=1.2, top_k=5)]
    settings = RowSettings.from_params(rows, torch.device("cpu"))
    history = History.of(settings, [torch.tensor([3, 4, 5])] * 4, [torch.tensor([4, 4])] * 4, vocab, mask,
                         torch.device("cpu"))
    block = torch.tensor([[mask], [mask], [7], [mask]])  # row 2 holds a committed token: nothing to commit there
    for seed in range(5):
        logits = torch.randn(4, 1, vocab, generator=torch.Generator().manual_seed(seed)) * 3
        if seed == 4:
            logits[1, 0, 5] = float("nan")
            logits[3] = float("-inf")
        args = (block, mask, [mask], torch.ones(4, dtype=torch.long), settings)
        got = denoise_step(logits, *args, [torch.Generator().manual_seed(1) for _ in rows], history)
        filtered, _ = prepare_logits(logits, settings, [mask], history)
        gens = [torch.Generator().manual_seed(1) for _ in rows]
        x0 = sample_tokens(filtered, settings.temperature, gens)
        want = rank_and_commit(filtered, None, x0, block, mask, torch.ones(4, dtype=torch.long), settings, gens, None,
                               None)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), seed
        single = commit_single(filtered, x0, block, mask, torch.ones(4, dtype=torch.long), settings, "filtered")
        assert (single is None) == (seed == 4)  # the NaN and -inf rows go to the ranking
        if seed == 4:
            assert want[1][[1, 3]].sum() == 0  # where it commits nothing
