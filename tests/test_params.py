"""SamplingParams validation: every bad value is a ValueError that names the parameter."""

from __future__ import annotations

import dataclasses

import pytest

from celeris.sampling.params import SamplingParams


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("steps", 0),
        ("steps", -1),
        ("block_length", 0),
        ("temperature", -0.1),
        ("temperature", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.2),
        ("remasking", "bogus"),
        ("remasking", ""),
        ("decoding", "beam"),
        ("threshold", 0.0),
        ("threshold", 1.2),
        ("factor", 0.0),
        ("entropy_bound", -0.5),
        ("cfg_scale", -1.0),
        ("repetition_penalty", 0.0),
    ],
)
def test_bad_value_names_the_parameter(name, value):
    with pytest.raises(ValueError, match=name) as info:
        SamplingParams(**{name: value})
    assert str(value) in str(info.value)


@pytest.mark.parametrize("stop", [[""], ["ok", ""], [3]])
def test_bad_stop(stop):
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=stop)


def test_stop_string_becomes_list():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams().stop == []
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop="")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},  # greedy is allowed
        {"top_p": 1.0},
        {"top_p": 1e-3},
        {"decoding": "threshold", "threshold": 1.0},
        {"max_tokens": 1, "steps": 1, "block_length": 1},
        {"max_tokens": 7, "steps": 100, "block_length": 3},  # uneven lengths are legal, not asserted away
        {"remasking": "random", "decoding": "entropy", "entropy_bound": 0.0},
    ],
)
def test_valid_values(kwargs):
    p = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        assert getattr(p, k) == v


def test_defaults_then_overrides():
    defaults = {"max_tokens": 64, "steps": 32, "temperature": 0.5, "unknown_key": 1}
    p = SamplingParams.from_defaults(defaults, steps=8, temperature=None)
    assert (p.max_tokens, p.steps, p.temperature) == (64, 8, 0.5)  # None overrides are ignored
    with pytest.raises(ValueError, match="steps"):
        SamplingParams.from_defaults(defaults, steps=0)
    assert SamplingParams.from_defaults(None).max_tokens == SamplingParams().max_tokens


def test_default_steps_keep_the_default_tokens_per_step():
    """The model's steps go with its max_tokens: another length keeps the same tokens per step."""
    one_per_step = {"max_tokens": 128, "steps": 128}
    assert SamplingParams.from_defaults(one_per_step, max_tokens=256).steps == 256
    assert SamplingParams.from_defaults(one_per_step, max_tokens=5).steps == 5
    assert SamplingParams.from_defaults(one_per_step).steps == 128
    assert SamplingParams.from_defaults(one_per_step, max_tokens=256, steps=64).steps == 64  # explicit wins
    two_per_step = {"max_tokens": 64, "steps": 32}
    assert SamplingParams.from_defaults(two_per_step, max_tokens=7).steps == 4  # ceil(7 / 2)
    assert SamplingParams.from_defaults({"steps": 32}, max_tokens=256).steps == 32  # no default length: as given
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams.from_defaults(one_per_step, max_tokens=0)


def test_zero_is_not_treated_as_unset():
    """`max_tokens: 0` treated as unset is a known bug: an explicit 0 must be rejected, not replaced."""
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams.from_defaults({"max_tokens": 64}, max_tokens=0)
    assert SamplingParams.from_defaults({"temperature": 0.8}, temperature=0.0).temperature == 0.0


def test_structure_key_separates_batchable_settings():
    a = SamplingParams(temperature=0.0, seed=1, top_p=0.9, stop=["x"])
    b = SamplingParams(temperature=1.0, seed=2)
    assert a.structure_key() == b.structure_key()  # per-row settings may differ inside one batch
    assert a.structure_key() != SamplingParams(steps=64).structure_key()
    assert a.structure_key() != SamplingParams(remasking="random").structure_key()


@pytest.mark.parametrize("kwargs", [{"cache": "delayed", "cache_refresh": -1}, {"cache": "delayed", "cache_refresh": 1.5},
                                    {"cache": "delayed", "cache_refresh": True}, {"cache": "dual", "cache_refresh": 2}])
def test_cache_refresh_is_a_whole_number_of_blocks_for_the_delayed_cache(kwargs):
    with pytest.raises(ValueError, match="cache_refresh"):
        SamplingParams(**kwargs)
    assert SamplingParams(cache="delayed", cache_refresh=4).cache_refresh == 4
    assert SamplingParams(cache="dual_delayed", cache_refresh=2).cache_refresh == 2


@pytest.mark.parametrize("value", [-1, 1.5, True, "4"])
def test_suffix_window_is_a_whole_number_of_columns(value):
    with pytest.raises(ValueError, match="suffix_window must be an integer >= 0"):
        SamplingParams(suffix_window=value)
    assert SamplingParams(suffix_window=0).suffix_window == 0 and SamplingParams(suffix_window=16).suffix_window == 16
    assert SamplingParams(suffix_window=4).structure_key() != SamplingParams().structure_key()  # never batched together
    with pytest.raises(ValueError, match="suffix_window cannot be used with cache='delayed'"):
        SamplingParams(cache="delayed", suffix_window=4)
    assert SamplingParams(cache="dual_delayed", suffix_window=4).suffix_window == 4


@pytest.mark.parametrize(("name", "value", "valid"), [
    ("cfg_scale", 1e308, "[0, 100]"),
    ("cfg_scale", float("inf"), "[0, 100]"),
    ("cfg_scale", float("nan"), "[0, 100]"),
    ("repetition_penalty", 1e-300, "[0.01, 100]"),
    ("repetition_penalty", 1e300, "[0.01, 100]"),
    ("top_p", 1e-50, "[1e-06, 1]"),
    ("temperature", float("inf"), "[0, 2]"),
    ("factor", float("inf"), "(0, 1e+12]"),
    ("entropy_bound", float("nan"), "[0, 1e+12]"),
    ("threshold", float("nan"), "(0, 1]"),
])
def test_values_that_break_float32_arithmetic_are_refused_with_the_range(name, value, valid):
    """Issue 13 item 1: each of these once made a request that never finished."""
    with pytest.raises(ValueError, match=name) as info:
        SamplingParams(**{name: value})
    assert valid in str(info.value) and "finite" in str(info.value)


@pytest.mark.parametrize("seed", [-1, 2**63, True])
def test_seed_range(seed):
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)


def test_bounds_edges_are_accepted():
    SamplingParams(cfg_scale=100.0, repetition_penalty=0.01, top_p=1e-6, temperature=2.0, seed=2**63 - 1)
    SamplingParams(cfg_scale=0, repetition_penalty=100, top_p=1)


# ---------------------------------------------------------------------------------------------
# Settings only some rules read (issue 16 item 3): never silently ignored

RULE_VALUES = {"threshold": 0.2, "factor": 2.0, "entropy_bound": 1.0, "draft_source": "lookup",
               "remasking": "margin", "top_k": 5, "min_p": 0.1, "cache_refresh": 2, "num_speculative_tokens": 2}


def unread_choice(name: str) -> tuple[str, str]:
    """(picker field, a choice of it whose rule does not read ``name``)."""
    from celeris.sampling.params import declared, rule_settings

    picker, choices = rule_settings()[name]
    return picker, next(c for c in declared()[picker].valid_choices() if c not in choices)


def test_every_rule_setting_is_checked():
    from celeris.sampling.params import rule_settings

    assert set(RULE_VALUES) == set(rule_settings())


@pytest.mark.parametrize("name", list(RULE_VALUES))
def test_setting_for_an_unchosen_rule_is_an_error_naming_both(name):
    from celeris.sampling.params import rule_settings

    picker, unread = unread_choice(name)
    with pytest.raises(ValueError, match=rf"^{name} applies to .*got {picker}='{unread}'"):
        SamplingParams(**{name: RULE_VALUES[name], picker: unread})
    with pytest.raises(ValueError, match=rf"^{name} applies to"):  # an override of from_defaults counts too
        SamplingParams.from_defaults({picker: unread}, **{name: RULE_VALUES[name]})
    chosen = rule_settings()[name][1][0]
    assert getattr(SamplingParams(**{name: RULE_VALUES[name], picker: chosen}), name) == RULE_VALUES[name]


def test_threshold_without_threshold_decoding_is_refused():
    """The issue's example: threshold 0.2 and 0.95 used to give the same output under the default fixed rule."""
    with pytest.raises(ValueError, match="threshold applies to decoding='threshold' or decoding='low_confidence_dynamic' "
                                         "only; got decoding='fixed'"):
        SamplingParams(threshold=0.2)
    assert SamplingParams(decoding="threshold", threshold=0.2).threshold == 0.2


@pytest.mark.parametrize("name", list(RULE_VALUES))
def test_a_model_default_never_causes_the_error(name):
    """A generation_config.json default for a rule the caller switches away from is not the caller's setting."""
    from celeris.sampling.params import rule_settings

    picker, unread = unread_choice(name)
    defaults = {name: RULE_VALUES[name], picker: rule_settings()[name][1][0]}
    p = SamplingParams.from_defaults(defaults, **{picker: unread}, seed=1)
    assert getattr(p, picker) == unread and name not in p.explicit_settings
    assert dataclasses.replace(p, seed=2).seed == 2  # replace keeps the record: still not the caller's


def test_unset_rule_settings_take_their_defaults_and_replace_keeps_the_record():
    from celeris.sampling.params import declared, rule_settings

    p = SamplingParams()
    unset = {n: declared()[n].unset for n in rule_settings()}
    assert unset == {"threshold": 0.9, "factor": 1.0, "entropy_bound": 0.5, "draft_source": "lookup_first",
                     "remasking": "low_confidence", "top_k": 0, "min_p": 0.0, "cache_refresh": 0,
                     "num_speculative_tokens": None}  # None: the model's draft block size
    assert {n: getattr(p, n) for n in unset} == unset and p.explicit_settings == frozenset()
    assert dataclasses.replace(p, decoding="verified").decoding == "verified"  # the filled-in remasking is no setting
    mine = SamplingParams(decoding="threshold", threshold=0.2)
    with pytest.raises(ValueError, match="threshold applies"):
        dataclasses.replace(mine, decoding="fixed")


# The unset value of each rule setting: only these turn their setting off (issue 28 item 4).
OFF_VALUES = {"remasking": "low_confidence", "top_k": 0, "min_p": 0.0, "cache_refresh": 0}


def test_only_the_off_values_are_exempt():
    """Every rule setting's unset value is either an "off" (exempt when sent) or a default that counts when sent."""
    from celeris.sampling.params import declared, rule_settings

    off = {n: declared()[n].unset for n in rule_settings() if declared()[n].unset_means_off}
    assert off == OFF_VALUES


@pytest.mark.parametrize("name", [n for n in RULE_VALUES if n not in OFF_VALUES and n != "num_speculative_tokens"])
def test_a_rule_setting_given_at_its_default_value_counts(name):
    """Issue 28 item 4: threshold 0.9, factor 1.0, entropy_bound 0.5 (and draft_source 'lookup_first') without
    their rule were accepted and ignored because they equal the unset value; a value the caller gave counts."""
    from celeris.sampling.params import declared

    picker, unread = unread_choice(name)
    value = declared()[name].unset
    with pytest.raises(ValueError, match=rf"^{name} applies to .*got {picker}='{unread}'"):
        SamplingParams(**{name: value, picker: unread})
    with pytest.raises(ValueError, match=rf"^{name} applies to"):
        SamplingParams.from_defaults({}, **{name: value, picker: unread})
    # the same value as a model default (generation_config.json or the contract) is no setting of the caller
    p = SamplingParams.from_defaults({name: value}, **{picker: unread})
    assert getattr(p, name) == value and p.explicit_settings == frozenset()


@pytest.mark.parametrize("top_k", [-2, 1.5, True])
def test_top_k_is_a_whole_number_at_least_zero_or_vllms_minus_one(top_k):
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=top_k)


def test_a_default_verified_decoding_stays_under_a_grammar():
    """Verified decoding checks its drafts against the grammar (celeris.sampling.verified.verify_under_grammar):
    no switch."""
    from celeris.sampling.modes import check_request
    from tests.conftest import tiny_model

    defaults = {"decoding": "verified", "draft_source": "lookup_first", "block_length": 1}
    params = SamplingParams.from_defaults(defaults, grammar="start: x")
    assert params.decoding == "verified"
    assert check_request(tiny_model(is_causal=True, draft_block_size=2), params) == "verified"


# ---------------------------------------------------------------------------------------------
# vLLM's names, with the old ones as deprecated aliases (issue 16 item 2)


def test_max_new_tokens_is_a_deprecated_alias_of_max_tokens():
    with pytest.warns(DeprecationWarning, match="max_new_tokens"):
        p = SamplingParams(max_new_tokens=7)
    assert p.max_tokens == 7 and p.max_new_tokens == 7
    with pytest.raises(TypeError, match="not both"):
        SamplingParams(max_tokens=3, max_new_tokens=7)
    with pytest.warns(DeprecationWarning):
        assert SamplingParams.from_defaults({}, max_new_tokens=5).max_tokens == 5
    # a generation_config.json with the old key: read as max_tokens, and steps scale with it
    p = SamplingParams.from_defaults({"max_new_tokens": 8, "steps": 4}, max_tokens=16)
    assert (p.max_tokens, p.steps) == (16, 8)
    with pytest.raises(ValueError, match="^max_tokens must be an integer >= 1, got 0"):
        SamplingParams(max_tokens=0)


def test_structure_key_is_every_setting_rows_cannot_differ_in():
    base = SamplingParams()
    for change in ({"temperature": 0.5}, {"seed": 3}, {"top_k": 4}, {"stop": ["x"]}, {"cfg_scale": 2.0}):
        assert dataclasses.replace(base, cfg_scale=1.0, **{k: v for k, v in change.items() if k != "cfg_scale"}) \
            .structure_key() == dataclasses.replace(base, cfg_scale=1.0).structure_key()
    for change in ({"steps": 3}, {"block_length": 4}, {"cache": "dual"}, {"cfg_scale": 1.0}):
        assert dataclasses.replace(base, **change).structure_key() != base.structure_key()


def test_off_values_are_no_setting_of_an_unchosen_rule():
    """top_k 0, min_p 0 and the default remasking are what those settings are when unset: sending them with
    decoding 'verified' (a client's explicit "off") is accepted; vLLM's top_k -1 means off too. A value that
    would change the answer is still an error naming both."""
    p = SamplingParams(decoding="verified", top_k=0, min_p=0.0, remasking="low_confidence")
    assert p.explicit_settings == frozenset() and p.top_k == 0
    assert SamplingParams(decoding="verified", top_k=-1).top_k == 0
    assert SamplingParams.from_defaults({"decoding": "verified"}, top_k=0, min_p=0.0).top_k == 0
    with pytest.raises(ValueError, match="top_k applies"):
        SamplingParams(decoding="verified", top_k=5)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)
