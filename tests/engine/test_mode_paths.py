"""The mode is decided once, at admission (``Request.mode``), and ``Engine.step`` dispatches through
``Engine.paths``: each path owns its request's cursor as ``request.state`` and counts steps with
``Request.record_step``."""

from __future__ import annotations

import pytest

from celeris.config import EngineConfig
from celeris.engine.blocks import BlockRow
from celeris.engine.engine import Engine
from celeris.engine.verified import DraftRow
from celeris.sampling.params import SamplingParams

SETTINGS = {
    "masked": SamplingParams(max_tokens=6, block_length=1, steps=6, cache="delayed", early_exit=False),
    "block": SamplingParams(max_tokens=8, block_length=4, steps=4, early_exit=False),
    "verified": SamplingParams(max_tokens=8, steps=8, block_length=1, decoding="verified", early_exit=False),
}


def test_the_mode_is_decided_once_and_each_path_owns_its_state(hybrid, monkeypatch):
    engine = Engine(hybrid, EngineConfig(max_num_seqs=3))
    requests = {mode: engine.add_request([5 + i, 6, 7], params) for i, (mode, params) in enumerate(SETTINGS.items())}
    assert {mode: r.mode for mode, r in requests.items()} == {mode: mode for mode in SETTINGS}

    def refuse(*args, **kwargs):
        raise AssertionError("a mode was derived again after admission")

    import celeris.engine.engine as engine_module
    import celeris.sampling.modes as modes

    for module in (modes, engine_module):  # wherever a step could ask for the mode again
        for name in ("mode_of", "check_request", "block_mode"):
            monkeypatch.setattr(module, name, refuse, raising=False)
    engine.step()
    kinds = {mode: type(r.state) for mode, r in requests.items()}
    assert kinds == {"masked": type(None), "block": BlockRow, "verified": DraftRow}
    while engine.has_unfinished():
        engine.step()
    for mode, r in requests.items():
        assert r.finish_reason == "length" and r.first_token_time is not None, mode
        assert r.first_token_time >= r.arrival_time
        assert r.nfe == r.num_steps >= 1, mode  # one pass per step in every mode (no CFG here)
    assert requests["masked"].num_steps == 6  # one token per step, block_length 1
    assert requests["verified"].state is None  # its pool row was freed with it
    assert engine.stats().kv_bytes == engine.drafter.pool_bytes == engine.runner.kv.nbytes  # the one store


def test_a_requests_token_cost_comes_from_its_mode(hybrid):
    """The budget counts the columns each mode computes, not rows x the longest canvas: two verified requests
    with long answers fit a budget of their prefills (prompt + 2 x MAX_DRAFTS columns each), and a masked request
    costs its whole padded canvas."""
    from celeris.sampling.verified import MAX_DRAFTS

    long = SamplingParams(max_tokens=60, steps=60, block_length=1, decoding="verified", early_exit=False)
    prompts = [[5, 6, 7], [8, 9, 10]]
    budget = 2 * (3 + 2 * MAX_DRAFTS)  # < 2 x (3 + 60), the old padded count
    engine = Engine(hybrid, EngineConfig(max_num_seqs=4, max_num_batched_tokens=budget))
    requests = [engine.add_request(p, long) for p in prompts]
    assert engine.batch_tokens(requests) == budget < 2 * requests[0].num_tokens
    engine.step()
    assert all(r.state is not None for r in requests)  # both were admitted in the first step
    assert engine.batch_tokens(requests) == 2 * len(requests[0].state.columns) < budget  # decoding costs less
    masked = engine.add_request([11, 12], SETTINGS["masked"])
    assert engine.batch_tokens([masked]) == masked.num_tokens  # one row, padded to its canvas
    while engine.has_unfinished():
        engine.step()
    for p, r in zip(prompts, requests, strict=True):
        alone = Engine(hybrid, EngineConfig(max_num_seqs=1))
        solo = alone.add_request(p, long)
        while alone.has_unfinished():
            alone.step()
        assert r.answer.tolist() == solo.answer.tolist()


def test_every_registered_mode_has_a_path_the_engine_can_make(hybrid):
    """The built-in modes register no path (the engine's floor is above the registry's): the engine's own table
    holds them, no class named by a string; the engine makes each path once, at the mode's first request."""
    from celeris.engine.blocks import BlockDecoder
    from celeris.engine.engine import BUILTIN_PATHS, path_factory
    from celeris.engine.masked import MaskedPath
    from celeris.engine.verified_path import VerifiedPath
    from celeris.sampling.modes import DEFAULT_MODE, MODES, DecodingMode, register_mode, unregister_mode

    assert list(MODES)[:3] == ["block", "verified", "masked"] and DEFAULT_MODE == "masked"
    classes = {"block": BlockDecoder, "verified": VerifiedPath, "masked": MaskedPath}
    assert all(MODES[name].path is None for name in classes) and BUILTIN_PATHS == classes
    assert {name: path_factory(name) for name in classes} == classes
    engine = Engine(hybrid, EngineConfig(max_num_seqs=3))
    assert engine.paths == {}  # nothing is made before a request of its mode arrives
    for i, params in enumerate(SETTINGS.values()):
        engine.add_request([5 + i, 6, 7], params)
    engine.step()
    assert {mode: type(path) for mode, path in engine.paths.items()} == classes
    first = dict(engine.paths)
    engine.add_request([9, 9], SETTINGS["block"])
    engine.step()
    assert all(engine.paths[mode] is path for mode, path in first.items())  # made once
    register_mode(DecodingMode("pathless", lambda *a: None, lambda *a: False, None))
    try:
        with pytest.raises(ValueError, match="registered without a path"):
            path_factory("pathless")
    finally:
        unregister_mode("pathless")


def test_a_mode_is_registered_once_and_its_decoding_value_goes_with_it():
    from celeris.sampling.modes import DecodingMode, decoding_is, register_mode, unregister_mode
    from celeris.sampling.rules import COMMIT_RULES, CommitRule

    def check(model, params, has_suffix):
        return None

    with pytest.raises(ValueError, match="'verified' is already registered"):
        register_mode(DecodingMode("verified", check, decoding_is("verified"), "x:y"))
    with pytest.raises(ValueError, match="'fixed' is already registered"):  # a commit rule's value is taken
        register_mode(DecodingMode("fixed", check, decoding_is("fixed"), "x:y", rule=CommitRule(None, "?")))
    with pytest.raises(ValueError, match="fn None"):
        register_mode(DecodingMode("spare", check, decoding_is("spare"), "x:y", rule=COMMIT_RULES["fixed"]))
    with pytest.raises(ValueError, match="spare"):
        SamplingParams(decoding="spare")
    register_mode(DecodingMode("spare", check, decoding_is("spare"), "x:y", rule=CommitRule(None, "a spare mode")))
    try:
        assert SamplingParams(decoding="spare").decoding == "spare"
    finally:
        unregister_mode("spare")
    assert "spare" not in COMMIT_RULES
    with pytest.raises(ValueError, match="decoding must be one of"):
        SamplingParams(decoding="spare")
