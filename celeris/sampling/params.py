"""SamplingParams: the single declaration of a request's generation settings.

Each field declares, next to its default, its help text, its range or choices, whether rows of one batch may
differ in it (``per_row``) and how it reaches the command line and HTTP (``Setting``). From that one declaration
come: the validation in ``__post_init__``, the CLI flags (``celeris.cli``), the HTTP extension fields
(``celeris.serve.protocol``), the serving layer's mapping (``celeris.serve.serving``) and ``structure_key``.
Choices come from the registries (``celeris.sampling.rules.COMMIT_RULES`` and ``REMASKING``,
``celeris.sampling.cache.CACHE_MODES``), read at call time, so a rule registered after import is a valid choice
everywhere. A setting that only some rules read (``rule_settings``) is refused, naming both, when the request
chose another rule (HTTP 400, CLI exit 2). What decides is where the value came from, not what it equals: a value
the caller gave counts even when it equals the default (``threshold`` 0.9), except a value that turns its setting
off (``Setting.unset_means_off``); a default from the model's ``generation_config.json`` or block contract never
causes that error.

Names follow vLLM where vLLM has the concept (``max_tokens``, ``top_k``, ``top_p``, ``repetition_penalty``,
``stop_token_ids``, ...) and LLaDA / Fast-dLLM for the diffusion settings. ``max_new_tokens`` is a deprecated
alias of ``max_tokens`` (keyword, attribute, ``generation_config.json`` key, ``--max-new-tokens``).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from types import MappingProxyType

from celeris.sampling.cache import CACHE_MODES
from celeris.sampling.rules import COMMIT_RULES, DRAFT_SOURCES, NEEDS, REMASKING, CommitRule

# Settings whose provenance ``explicit_settings`` records besides the rule settings: a default answer length (not
# the caller's) is lowered to what fits the context, with its steps (``celeris.llm.LLM.fit_max_tokens``); a default
# ``block_length`` a block model cannot use becomes its contract's (``celeris.sampling.block.with_block_defaults``).
TRACKED_SETTINGS = ("max_tokens", "steps", "block_length")
MAX_SEED = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Setting:
    """How one ``SamplingParams`` field is declared to users.

    Attributes:
        help: one line for ``--help``, the HTTP schema and the docs.
        low / high: closed range of a number (``open_low``: the low end excluded); every float must also be
            finite. The float bounds keep the sampler's float32 arithmetic finite: a ``cfg_scale``,
            ``repetition_penalty`` or ``top_p`` that float32 cannot hold (1e308 -> inf, 1e-300 -> 0) turns every
            confidence into NaN.
        choices: the valid strings, or a function returning them (a registry's keys, read at call time).
        per_row: rows of one batch may differ in it; the others form ``structure_key``.
        unset: what None becomes for a rule setting (one some rule declares in its ``params``).
        unset_means_off: the ``unset`` value turns the setting off (``top_k`` 0, ``min_p`` 0, ``cache_refresh`` 0,
            the default ``remasking``): a caller who sends it asks for nothing, so it is no setting of an unchosen
            rule. Every other value the caller gives counts, whatever it equals (``threshold`` 0.9 included).
        cli: True: a flag ``--name-with-dashes`` of the field's type; a dict: argparse keyword overrides
            (``flags``, ``action``, ...); False: no flag.
        http: a Celeris extension field of the HTTP requests (OpenAI's own fields are declared there by hand).
    """

    help: str
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    choices: tuple[str, ...] | Callable[[], Mapping[str, object]] | None = None
    per_row: bool = False
    unset: object = None
    unset_means_off: bool = False
    cli: dict | bool = True
    http: bool = True

    def valid_choices(self) -> tuple[str, ...] | None:
        """The choices now (a registry's current keys), or None."""
        if self.choices is None:
            return None
        return tuple(self.choices()) if callable(self.choices) else self.choices


DRY_SEQUENCE_BREAKERS = ("\n", ":", '"', "*")  # DRY's default breakers, llama.cpp's (common/common.h; sampling/dry.py)


def setting(default: object = MISSING, *, default_factory: Callable[[], object] | object = MISSING,
            **spec: object) -> object:
    """A dataclass field carrying its ``Setting`` (``spec``) as metadata."""
    return field(default=default, default_factory=default_factory, metadata={"setting": Setting(**spec)})


def _registry(table: str) -> Callable[[], Mapping[str, object]]:
    """The registry ``table`` as a function, so choices are read at call time."""
    return {"decoding": lambda: COMMIT_RULES, "remasking": lambda: REMASKING, "cache": lambda: CACHE_MODES,
            "draft_source": lambda: DRAFT_SOURCES}[table]


@dataclass(slots=True)
class SamplingParams:
    """Settings of one generation request; each field's meaning is its ``help`` (``Setting``).

    The decoding rules, remasking confidences and cache modes, with their sources, are documented where they
    are registered (``celeris.sampling.rules``, ``celeris.sampling.cache``). Rule settings (``rule_settings``)
    default to None, "not set": construction fills in their ``unset`` value and records the ones the caller set
    in ``explicit_settings``, with ``TRACKED_SETTINGS`` (``max_tokens``, ``steps``, ``block_length``) when the
    caller gave them (defaults the model cannot use are adapted, values the caller gave are kept or refused);
    ``from_defaults`` counts only its overrides as set.

    Raises (construction):
        ValueError: a value out of its range or choices, or a rule setting for a rule the request did not choose
            (the message starts with the field's name).
    """

    max_tokens: int = setting(128, low=1, help="answer length in tokens (the masked canvas)", http=False,
                              cli={"flags": ("--max-tokens", "--max-new-tokens")})
    steps: int = setting(128, low=1, help="denoising steps for the whole answer (fixed decoding; steps that do "
                         "not divide over the blocks are rounded as celeris.sampling.schedule.block_plan says); "
                         "for a block-diffusion model (celeris.sampling.block), steps per sub-block")
    block_length: int = setting(32, low=1, help="tokens per semi-autoregressive block (capped at max_tokens); "
                                "an autoregressive (causal) model needs 1; for a block-diffusion model, the "
                                "denoising sub-block, which must divide the model's trained block size")
    temperature: float = setting(0.0, low=0.0, high=2.0, per_row=True, http=False,
                                 help="0 = greedy; > 0 samples by Gumbel-max in float64 (arXiv:2409.02908)")
    top_p: float = setting(1.0, low=1e-6, high=1.0, per_row=True, http=False, help="nucleus mass (arXiv:1904.09751)")
    top_k: int | None = setting(None, low=0, unset=0, unset_means_off=True, per_row=True,
                                help="keep the k most likely tokens, ties with the k-th kept (0, or vLLM's -1: all); "
                                "applied "
                                "after top_p, as Dream's sample_tokens, also to the confidences")
    min_p: float | None = setting(None, low=0.0, high=1.0, unset=0.0, unset_means_off=True, per_row=True,
                                  help="drop tokens below min_p times the top token's probability (vLLM; "
                                  "arXiv:2407.01082; 0 = off); after top_k")
    remasking: str | None = setting(None, choices=_registry("remasking"), unset="low_confidence", unset_means_off=True,
                                    help="the confidence that ranks masked positions (celeris.sampling.rules."
                                    "REMASKING; margin and entropy are Dream's rules, not decoding 'entropy')")
    decoding: str = setting("fixed", choices=_registry("decoding"),
                            help="how many positions a step commits (celeris.sampling.rules.COMMIT_RULES; 'entropy' is "
                            "the EB-sampler, not remasking 'entropy'; 'verified' is for hybrid models)")
    threshold: float | None = setting(None, low=0.0, high=1.0, open_low=True, unset=0.9,
                                      help="confidence threshold of decoding 'threshold' (Fast-dLLM)")
    factor: float | None = setting(None, low=0.0, high=1e12, open_low=True, unset=1.0,
                                   help="factor of decoding 'factor' (Fast-dLLM)")
    entropy_bound: float | None = setting(None, low=0.0, high=1e12, unset=0.5,
                                          help="summed entropy bound in nats of decoding 'entropy' (EB-sampler)")
    cfg_scale: float = setting(0.0, low=0.0, high=100.0, per_row=True,
                               help="classifier-free guidance scale (LLaDA Eq. 16; 0 = off; not with decoding "
                               "'verified')")
    repetition_penalty: float = setting(1.0, low=0.01, high=100.0, per_row=True,
                                        help="CTRL repetition penalty (arXiv:1909.05858; 1 = off): the logits of tokens "
                                        "already in the prompt or answer divided by it (multiplied when negative)")
    frequency_penalty: float = setting(0.0, low=-2.0, high=2.0, per_row=True,
                                       help="OpenAI's frequency penalty (0 = off): each answer token's logit minus "
                                       "this times how often the answer holds it so far (the prompt not counted)")
    presence_penalty: float = setting(0.0, low=-2.0, high=2.0, per_row=True,
                                      help="OpenAI's presence penalty (0 = off): the logit of every token the answer "
                                      "holds so far minus this (the prompt not counted)")
    dry_multiplier: float = setting(0.0, low=0.0, high=100.0, per_row=True,
                                    help="DRY's strength (llama.cpp's dry_multiplier; 0 = off; 0.8 is the usual value): "
                                    "a token that would extend a repeat of L >= dry_allowed_length earlier tokens loses "
                                    "dry_multiplier * dry_base ** (L - dry_allowed_length) (celeris.sampling.dry)")
    dry_base: float = setting(1.75, low=1.0, high=100.0, per_row=True, help="DRY's base (llama.cpp's dry_base)")
    dry_allowed_length: int = setting(2, low=0, high=1_000_000, per_row=True,
                                      help="DRY: repeats of at most this many tokens are not penalized")
    dry_penalty_last_n: int = setting(-1, low=-1, high=1_000_000_000, per_row=True,
                                      help="DRY: tokens of the context (prompt and answer) it looks at (-1: all, 0: off)")
    dry_sequence_breakers: list[str] = setting(default_factory=lambda: list(DRY_SEQUENCE_BREAKERS), per_row=True,
                                               cli=False, help="DRY: strings that end every repeat (each token whose "
                                               "text contains one; llama.cpp's defaults)")
    seed: int | None = setting(None, low=0, high=MAX_SEED, per_row=True, http=False,
                               help="per-request RNG seed (None: a fresh one)")
    stop: list[str] = setting(default_factory=list, per_row=True, http=False, cli={"action": "append"},
                              help="stop string (repeatable), taken literally: no escapes are read, so for a newline "
                              "write one (bash: --stop $'\\ndef ', not \"\\ndef \", which is a backslash and an n); "
                              "one that is exactly a special token ends the answer at that token")
    stop_token_ids: list[int] = setting(default_factory=list, per_row=True,
                                        cli={"flags": ("--stop-token-id",), "action": "append", "type": int},
                                        help="token id that ends the answer, besides the model's end ids (vLLM)")
    ignore_eos: bool = setting(False, per_row=True, cli={"action": "store_true"},
                               help="do not end at the model's end-of-text / end-of-turn ids (vLLM)")
    skip_special_tokens: bool = setting(True, per_row=True,
                                        cli={"flags": ("--keep-special-tokens",), "action": "store_false"},
                                        help="leave special tokens out of the text (vLLM); the flag keeps them")
    include_stop_str_in_output: bool = setting(False, per_row=True,
                                               cli={"flags": ("--include-stop-str",), "action": "store_true"},
                                               help="keep the matched stop string at the end of the text (vLLM)")
    early_exit: bool = setting(True, cli=False, http=False,
                               help="stop denoising once every answer holds an end-of-text token with all positions "
                               "before it filled (same text)")
    cache: str = setting("none", choices=_registry("cache"),
                         help="KV cache policy (celeris.sampling.cache.CACHE_MODES, with a table of what each "
                         "recomputes)")
    cache_refresh: int | None = setting(None, low=0, unset=0, unset_means_off=True,
                                        help="with a delayed cache: also a full refresh every N blocks (0 = never)")
    suffix_window: int = setting(0, low=0, help="passes see only this many masked columns past the block (DPad, "
                                 "arXiv:2508.14148; 0 = the whole canvas)")
    draft_source: str | None = setting(None, choices=_registry("draft_source"), unset="lookup_first", per_row=True,
                                       help="verified decoding's drafts: prompt lookup first (then the drafter or "
                                       "the mask slots), the model's mask slots, prompt lookup only, or the DFlash "
                                       "drafter only (--speculative-config)")
    num_speculative_tokens: int | None = setting(None, low=1, high=16, per_row=True,
                                                 help="verified decoding: drafts checked per pass, k (vLLM's name); "
                                                 "unset: the model's draft block size (the drafter's block_size - 1 "
                                                 "with a DFlash drafter; 4 for prompt lookup on a plain causal "
                                                 "model); mask-slot drafts are at most that size")
    grammar: str | None = setting(None, per_row=True, cli=False, http=False,
                                  help="an llguidance grammar (celeris.structured): every committed token is one it "
                                  "accepts")
    logprobs: int | None = setting(None, low=0, high=20, per_row=True, cli=False, http=False,
                                   help="return each answer token's log-probability and this many most likely "
                                   "alternatives at its position (vLLM; celeris.sampling.logprobs; None: none)")
    prompt_logprobs: int | None = setting(None, low=0, high=20, per_row=True, cli=False, http=False,
                                          help="also score the prompt, with this many alternatives per token (vLLM; "
                                          "causal models only; None: no)")
    # Which rule settings (and TRACKED_SETTINGS) the caller set; filled at construction from the arguments
    # given a value other than None. Kept by ``dataclasses.replace`` (it passes the field on), so replacing
    # ``seed`` does not turn the filled-in defaults into settings of the caller.
    explicit_settings: frozenset[str] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:  # vLLM's "disabled"
            self.top_k = 0
        rules = rule_settings()
        if self.explicit_settings is None:  # the dataclass __init__ called without _init: the rule settings set
            self.explicit_settings = frozenset(n for n in rules if getattr(self, n) is not None)
        # a value the caller gave counts whatever it equals, except a setting's "off" (Setting.unset_means_off)
        self.explicit_settings = frozenset(n for n in self.explicit_settings if not _is_off_value(n, getattr(self, n)))
        for name, spec in declared().items():
            if spec.unset is not None and getattr(self, name) is None:
                setattr(self, name, spec.unset)
        for name, spec in declared().items():
            message = check_setting(name, getattr(self, name), spec)
            if message:
                raise ValueError(message)
        checks = [
            (all(isinstance(s, str) and s for s in self.stop), "stop must be a non-empty string or a list of them"),
            (isinstance(self.stop_token_ids, list) and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}"),
            (self.suffix_window == 0 or CACHE_MODES[self.cache].recomputes_suffix,
             f"suffix_window cannot be used with cache='{self.cache}' (it never recomputes the suffix); use "
             f"'dual_delayed'"),
        ]
        checks += [(getattr(self, picker) in choices, _unread_message(name, picker, choices, getattr(self, picker)))
                   for name, (picker, choices) in rules.items() if name in self.explicit_settings]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def max_new_tokens(self) -> int:
        """Deprecated alias of ``max_tokens``."""
        return self.max_tokens

    @classmethod
    def from_defaults(cls, defaults: dict | None = None, per_answer_steps: bool = True,
                      **overrides: object) -> SamplingParams:
        """Build from a model's ``generation_config.json`` dict, then apply non-None overrides.

        A default ``steps`` goes with the default ``max_tokens``: when only the length is overridden, steps are
        scaled to keep the default's tokens per step, ``ceil(max_tokens * steps / default max_tokens)``, so a
        longer answer is not decoded with more tokens per step (the quality knob) than the model's defaults were
        chosen at. An explicit ``steps`` is used as given. ``per_answer_steps=False`` (a block-diffusion model,
        whose ``steps`` count per block, ``celeris.sampling.block``) never scales them. ``max_new_tokens`` (in
        ``defaults`` or as an override) is read as ``max_tokens``.

        Raises:
            ValueError: an invalid setting (see ``__post_init__``).
        """
        defaults = rename_deprecated(dict(defaults or {}))
        known = set(declared())
        merged = {k: v for k, v in defaults.items() if k in known}
        given = {k: v for k, v in rename_deprecated(overrides, warn=True).items() if v is not None}
        merged.update(given)
        merged["explicit_settings"] = frozenset(given).intersection({*rule_settings(), *TRACKED_SETTINGS})
        d_len, d_steps = defaults.get("max_tokens"), defaults.get("steps")
        length = given.get("max_tokens")
        if "steps" not in given and isinstance(length, int) and length >= 1 and d_len and d_steps and per_answer_steps:
            merged["steps"] = -(-length * d_steps // d_len)
        return cls(**merged)

    def structure_key(self) -> tuple:
        """Settings that must be equal for requests to share one batched sampler call: every field that is not
        ``per_row``, and whether classifier-free guidance is on."""
        return (*(getattr(self, name) for name, spec in declared().items() if not spec.per_row), self.cfg_scale > 0)


_dataclass_init = SamplingParams.__init__


def _init(self: SamplingParams, *args: object, max_new_tokens: int | None = None, **kwargs: object) -> None:
    """The dataclass ``__init__``, also taking the deprecated ``max_new_tokens`` keyword and recording which rule
    settings and ``TRACKED_SETTINGS`` the caller gave (``explicit_settings``), unless it is passed on (as
    ``dataclasses.replace`` and ``from_defaults`` do)."""
    if max_new_tokens is not None:
        if "max_tokens" in kwargs:
            raise TypeError("give max_tokens or its deprecated alias max_new_tokens, not both")
        warnings.warn("SamplingParams(max_new_tokens=...) is deprecated; use max_tokens", DeprecationWarning,
                      stacklevel=2)
        kwargs["max_tokens"] = max_new_tokens
    names = _field_names()
    if kwargs.get("explicit_settings") is None and len(args) <= names.index("explicit_settings"):
        given = {*names[:len(args)], *(k for k, v in kwargs.items() if v is not None)}
        kwargs["explicit_settings"] = frozenset(given).intersection({*rule_settings(), *TRACKED_SETTINGS})
    _dataclass_init(self, *args, **kwargs)


@functools.cache
def _field_names() -> tuple[str, ...]:
    """The dataclass fields of ``SamplingParams`` in order (its positional arguments)."""
    return tuple(f.name for f in fields(SamplingParams))


_init.__signature__ = inspect.signature(_dataclass_init)
SamplingParams.__init__ = _init


def rename_deprecated(values: dict, warn: bool = False) -> dict:
    """``values`` with the deprecated key ``max_new_tokens`` read as ``max_tokens`` (a given ``max_tokens``
    wins)."""
    if "max_new_tokens" not in values:
        return values
    values = dict(values)
    old = values.pop("max_new_tokens")
    if warn and old is not None:
        warnings.warn("max_new_tokens is deprecated; use max_tokens", DeprecationWarning, stacklevel=3)
    if values.get("max_tokens") is None:
        values["max_tokens"] = old
    return values


def _is_off_value(name: str, value: object) -> bool:
    """Whether ``value`` turns the declared setting ``name`` off (``Setting.unset_means_off``: top_k 0, min_p 0,
    cache_refresh 0, the default remasking); a value that merely equals another setting's default is not."""
    spec = declared()[name]
    return spec.unset_means_off and value == spec.unset and type(value) is not bool


@functools.cache
def declared() -> Mapping[str, Setting]:
    """Every ``SamplingParams`` field with its ``Setting``, in declaration order (read-only; built once: the
    fields are fixed, and ``structure_key`` and validation read it for every request)."""
    return MappingProxyType({f.name: f.metadata["setting"] for f in fields(SamplingParams) if "setting" in f.metadata})


def field_type(name: str) -> type:
    """The value type of a declared field: int, float, bool, str, or list (``stop``, ``stop_token_ids``)."""
    annotation = SamplingParams.__dataclass_fields__[name].type
    for kind in ("list", "bool", "float", "int", "str"):
        if annotation.startswith(kind):
            return {"list": list, "bool": bool, "float": float, "int": int, "str": str}[kind]
    raise TypeError(f"{name}: no setting type for {annotation}")


def rule_settings() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Settings only some rules read: setting -> (the field that picks the rule, the choices that read it), from
    what the registries declare now (``CommitRule.reads``, ``CachePolicy.reads``, ``Confidence.params``)."""
    out: dict[str, tuple[str, list[str]]] = {}
    for picker in ("decoding", "remasking", "cache"):
        for choice, entry in _registry(picker)().items():
            for name in getattr(entry, "reads", getattr(entry, "params", ())):
                out.setdefault(name, (picker, []))[1].append(choice)
    return {name: (picker, tuple(choices)) for name, (picker, choices) in out.items()}


def check_setting(name: str, value: object, spec: Setting) -> str | None:
    """None when ``value`` is valid for the declared field ``name``, else the message (it starts with ``name``)."""
    kind = field_type(name)
    choices = spec.valid_choices()
    if choices is not None:
        return None if value in choices else f"{name} must be one of {', '.join(choices)}; got '{value}'"
    if kind is float:
        return check_float(name, value)
    if kind is int and spec.low is not None:
        if value is None and spec.unset is None and SamplingParams.__dataclass_fields__[name].default is None:
            return None  # an optional integer such as seed
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= spec.low and (
            spec.high is None or value <= spec.high)
        where = f">= {spec.low:g}" if spec.high is None else f"in [{spec.low:g}, {spec.high}]"
        return None if ok else f"{name} must be an integer {where}, got {value!r}"
    return None


def check_float(name: str, value: object) -> str | None:
    """None when ``value`` is a finite number within the declared range of float field ``name``, else a message
    naming the range."""
    spec = declared()[name]
    low, high = spec.low, spec.high
    left = "(" if spec.open_low else "["
    ok = (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
          and (value > low if spec.open_low else value >= low) and value <= high)
    return None if ok else f"{name} must be a finite number in {left}{low:g}, {high:g}], got {value!r}"


def _unread_message(name: str, picker: str, choices: tuple[str, ...], chosen: str) -> str:
    """The error for a setting the request's rule does not read, naming both (the setting first: the HTTP
    layer reports the first word as the parameter)."""
    others = [c for c in declared()[picker].valid_choices() if c not in choices]
    need = " or ".join(f"{picker}='{c}'" for c in choices) if len(choices) < 3 else \
        f"{picker} other than " + ", ".join(f"'{c}'" for c in others)
    return (f"{name} applies to {need} only; got {picker}='{chosen}' (set {picker} accordingly, or leave {name} "
            f"unset)")


def add_setting_flags(parser: argparse.ArgumentParser, names: Iterable[str] | None = None) -> None:
    """One argparse flag per declared setting (``names``: those only; None: every one with a ``Setting.cli``):
    ``--name-with-dashes`` of the field's type with its help and, for a choice, the choices the registries hold
    now. A flag not given is None, so ``SamplingParams.from_defaults`` keeps the model's default."""
    for name, spec in declared().items():
        if spec.cli is False or (names is not None and name not in names):
            continue
        options = dict(spec.cli) if isinstance(spec.cli, dict) else {}
        flags = options.pop("flags", (f"--{name.replace('_', '-')}",))
        options.setdefault("dest", name)
        options.setdefault("help", spec.help)
        if options.get("action") in ("store_true", "store_false"):
            options.setdefault("default", None)
        elif field_type(name) is not list:  # a list's flag repeats (its cli declares the items' type)
            options.setdefault("type", field_type(name))
        choices = spec.valid_choices()
        if choices is not None:
            options["choices"] = list(choices)
        parser.add_argument(*flags, **options)


def causal_defaults(generation_config: dict) -> dict:
    """An autoregressive (causal) model's defaults: blocks of one token, and the ``delayed`` cache unless the
    file asks for another mode a causal model can use (``CachePolicy.exact_for_causal``;
    ``celeris.sampling.modes.check_request`` refuses the others for such a model)."""
    cache = generation_config.get("cache", "delayed")
    ok = cache in CACHE_MODES and CACHE_MODES[cache].exact_for_causal
    return {**generation_config, "block_length": 1, "cache": cache if ok else "delayed"}


def register_commit_rule(name: str, rule: CommitRule) -> None:
    """Add a ``decoding`` choice. Its params must be ``SamplingParams`` fields and its needs keys of ``NEEDS``.

    Raises:
        ValueError: ``name`` is taken, or the rule declares an unknown field or need.
    """
    if name in COMMIT_RULES:
        raise ValueError(f"decoding rule '{name}' is already registered")
    unknown = [p for p in rule.params if p not in SamplingParams.__dataclass_fields__]
    unknown += [n for n in rule.needs if n not in NEEDS]
    if unknown:
        raise ValueError(f"decoding rule '{name}' declares unknown settings or needs: {', '.join(unknown)}")
    COMMIT_RULES[name] = rule


def unregister_commit_rule(name: str) -> None:
    """Remove a rule added by ``register_commit_rule`` (tests)."""
    COMMIT_RULES.pop(name, None)
