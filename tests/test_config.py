"""EngineConfig declared once: the CLI flags, LLM(...), the server and Ray Serve's ServeArgs all read its fields."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from celeris.cli import build_parser
from celeris.config import SERVER_MAX_WAITING, EngineConfig, engine_fields

# every engine flag each command had before the flags were derived from EngineConfig, with its default then
# (written out by hand: a flag renamed or a default changed by the builder fails here)
FLAGS_BEFORE = {
    ("serve",): {"--device": None, "--dtype": None, "--compile": False, "--max-model-len": None,
                 "--quantization": None, "--quantize-lm-head": False, "--speculative-config": None,
                 "--max-num-seqs": 8, "--max-waiting": 64, "--no-enable-prefix-caching": True,
                 "--logprobs-mode": "raw_logprobs"},
    ("generate",): {"--device": None, "--dtype": None, "--compile": False, "--max-model-len": None,
                    "--quantization": None, "--quantize-lm-head": False, "--speculative-config": None},
    ("batch", "run"): {"--device": None, "--dtype": None, "--max-num-seqs": 8, "--max-model-len": None,
                       "--quantization": None, "--speculative-config": None},
    ("bench",): {"--dtype": None, "--max-model-len": None, "--quantization": None, "--speculative-config": None},
}


def _subparser(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: action for action in parser._actions for flag in action.option_strings}


def test_every_engine_setting_is_declared_once_with_its_help():
    assert set(engine_fields()) >= {"max_num_seqs", "max_waiting", "device", "dtype", "enforce_eager",
                                    "enable_prefix_caching", "max_model_len", "quantization", "quantize_lm_head",
                                    "logprobs_mode", "speculative_config", "length_bucket"}
    for name, spec in engine_fields().items():
        assert spec.metadata["help"].strip(), name


@pytest.mark.parametrize("path", list(FLAGS_BEFORE))
def test_engine_flags_keep_their_names_and_defaults(path):
    options = _options(_subparser(path))
    for flag, before in FLAGS_BEFORE[path].items():
        action = options[flag]
        if flag == "--compile":  # now stored the field's way round: --compile sets enforce_eager False
            assert (action.dest, action.default, action.const) == ("enforce_eager", True, False)
        else:
            assert action.default == before, flag


def test_engine_flags_read_the_fields_help_and_land_on_their_names():
    options = _options(_subparser(("serve",)))
    for name, spec in engine_fields().items():
        flag = spec.metadata.get("flag", "--" + name.replace("_", "-"))
        if flag in options:
            assert options[flag].dest == name
            assert options[flag].help == spec.metadata["help"]
    args = build_parser().parse_args(["serve", "--compile", "--max-num-seqs", "3", "--no-enable-prefix-caching",
                                      "--logprobs-mode", "processed_logprobs"])
    config = EngineConfig.from_kwargs(**{n: getattr(args, n) for n in engine_fields() if hasattr(args, n)})
    assert (config.enforce_eager, config.max_num_seqs, config.max_waiting, config.enable_prefix_caching,
            config.logprobs_mode) == (False, 3, SERVER_MAX_WAITING, False, "processed_logprobs")


def test_from_kwargs_refuses_a_name_that_is_no_engine_setting():
    with pytest.raises(TypeError, match="max_num_seq\\b.*EngineConfig has max_num_seqs"):
        EngineConfig.from_kwargs(max_num_seq=4)
    with pytest.raises(ValueError, match="max_waiting must be >= 1"):
        EngineConfig.from_kwargs(max_waiting=0)
    assert EngineConfig.from_kwargs(max_num_seqs=2) == dataclasses.replace(EngineConfig(), max_num_seqs=2)


def test_llm_refuses_an_unknown_setting_before_loading():
    from celeris.llm import LLM

    with pytest.raises(TypeError, match="unknown engine setting"):
        LLM("no/such/folder/is/read", max_num_seq=4)


def test_ray_serve_args_hold_every_engine_field_with_its_default():
    pytest.importorskip("ray.serve")
    from pydantic import ValidationError

    from celeris.serve.ray import ServeArgs

    args = ServeArgs()
    for name, spec in engine_fields().items():
        assert getattr(args, name) == (SERVER_MAX_WAITING if name == "max_waiting" else spec.default), name
        assert ServeArgs.model_fields[name].description.endswith(spec.metadata["help"])
    assert ServeArgs.model_fields["enforce_eager"].description.startswith("False is --compile: ")
    assert ServeArgs.model_validate({"length_bucket": "16"}).engine_kwargs()["length_bucket"] == 16
    with pytest.raises(ValidationError, match="max_model_len must be >= 1"):
        ServeArgs(max_model_len=0)
