"""SamplingParams: per-request generation settings and their validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

REMASKING = ("low_confidence", "random", "margin", "entropy")
DECODING = ("fixed", "threshold", "factor", "entropy", "verified", "low_confidence_static", "low_confidence_dynamic",
            "sequential")
DRAFT_SOURCES = ("lookup_first", "slots", "lookup")
CACHE = ("none", "prefix", "dual", "delayed", "dual_delayed")

# Settings that only some rules read: setting -> (the field that picks the rule, the choices that read it).
# A caller who sets one of them for a request whose rule does not read it gets a ValueError naming both
# (HTTP 400, CLI exit 2) instead of a setting that is silently ignored. Only values the caller gave count:
# a model's generation_config.json default never causes the error (``SamplingParams.explicit_settings``).
_DIFFUSION_DECODING = tuple(d for d in DECODING if d != "verified")  # verified decoding has its own sampler
RULE_SETTINGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "threshold": ("decoding", ("threshold", "low_confidence_dynamic")),
    "factor": ("decoding", ("factor",)),
    "entropy_bound": ("decoding", ("entropy",)),
    "draft_source": ("decoding", ("verified",)),
    "remasking": ("decoding", _DIFFUSION_DECODING),
    "top_k": ("decoding", _DIFFUSION_DECODING),
    "cache_refresh": ("cache", ("delayed", "dual_delayed")),
}
# What an unset rule setting (None) becomes.
RULE_DEFAULTS: dict[str, object] = {
    "threshold": 0.9, "factor": 1.0, "entropy_bound": 0.5, "draft_source": "lookup_first",
    "remasking": "low_confidence", "top_k": 0, "cache_refresh": 0,
}

# Closed ranges [low, high] of the float settings, the same for Python, the CLI, HTTP and batch jobs
# (the HTTP layer validates through SamplingParams). Every value must also be a finite number. The
# bounds keep the sampler's float32 arithmetic finite: a cfg_scale, repetition_penalty or top_p that
# float32 cannot hold (1e308 -> inf, 1e-300 -> 0, 1e-50 -> 0) turns every confidence into NaN and no
# position could ever be committed. Lower bounds marked open in ``OPEN_LOW`` exclude the low end.
FLOAT_BOUNDS: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),  # OpenAI's range
    "top_p": (1e-6, 1.0),
    "threshold": (0.0, 1.0),
    "factor": (0.0, 1e12),
    "entropy_bound": (0.0, 1e12),
    "cfg_scale": (0.0, 100.0),
    "repetition_penalty": (0.01, 100.0),
}
OPEN_LOW = ("threshold", "factor")  # must be > low, not >= low
MAX_SEED = 2**63 - 1


def check_float(name: str, value: object) -> str | None:
    """None when ``value`` is a finite number within ``FLOAT_BOUNDS[name]``, else a message naming the range."""
    low, high = FLOAT_BOUNDS[name]
    left = "(" if name in OPEN_LOW else "["
    ok = (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
          and (value > low if name in OPEN_LOW else value >= low) and value <= high)
    return None if ok else f"{name} must be a finite number in {left}{low:g}, {high:g}], got {value!r}"


def _unread_message(name: str, picker: str, choices: tuple[str, ...], chosen: str) -> str:
    """The error for a setting the request's rule does not read, naming both (the setting first: the HTTP
    layer reports the first word as the parameter)."""
    need = " or ".join(f"{picker}='{c}'" for c in choices) if len(choices) < 3 else \
        f"{picker} other than " + ", ".join(f"'{c}'" for c in (DECODING if picker == "decoding" else CACHE)
                                          if c not in choices)
    return (f"{name} applies to {need} only; got {picker}='{chosen}' (set {picker} accordingly, or leave {name} "
            f"unset)")


@dataclass(slots=True)
class SamplingParams:
    """Settings of one generation request (names follow vLLM and LLaDA).

    Attributes:
        max_new_tokens: answer length in tokens (the masked canvas), >= 1.
        steps: denoising steps for the whole answer (``fixed`` decoding), >= 1.
            See ``celeris.sampling.schedule.block_plan`` for how steps that do not
            divide evenly over the blocks are rounded.
        block_length: tokens per semi-autoregressive block, >= 1; capped at
            ``max_new_tokens``; a last block may be shorter. An autoregressive
            (causal) model needs 1 (``check_model_support``).
        temperature: 0 is greedy; > 0 samples by Gumbel-max in float64.
        top_p: nucleus mass in [1e-6, 1].

    The settings that only some rules read (``RULE_SETTINGS``: ``threshold``, ``factor``, ``entropy_bound``,
    ``draft_source``, ``remasking``, ``top_k``, ``cache_refresh``) default to None, "not set": construction
    fills in ``RULE_DEFAULTS`` and records the ones the caller did set in ``explicit_settings``. Setting one
    for a rule the request did not choose (``threshold=0.2`` with ``decoding="fixed"``) raises ValueError
    naming both. ``from_defaults`` counts only its overrides as set, never the model's defaults.

    Every float setting must be a finite number within ``FLOAT_BOUNDS`` (e.g. ``cfg_scale`` in
    [0, 100], ``repetition_penalty`` in [0.01, 100]); ``seed`` in [0, 2**63 - 1].
        top_k: keep only the k most likely tokens (ties with the k-th kept) before sampling and before
            the confidences are taken (with the filtered distribution, ``confidence_rule``); 0 (default) keeps
            all. Applied after ``top_p``, in the order of Dream's published ``sample_tokens``
            (DreamLM ``generation_utils.py``: ``top_p_logits`` then ``top_k_logits``). Not with ``verified``.
        remasking: the confidence that ranks masked positions (which ones a step commits):
            ``low_confidence`` (probability of the predicted token; LLaDA arXiv:2502.09992, Dream's
            ``maskgit_plus``), ``random`` (uniform scores: random positions; LLaDA), ``margin`` (top-1 minus
            top-2 probability; Dream's ``topk_margin``, arXiv:2508.15487) or ``entropy`` (negative entropy of
            the position's distribution, sum p log p; Dream's ``entropy`` alg). Not the same as
            ``decoding="entropy"``, which is the EB-sampler's commit rule. Not with ``verified``.
        decoding: how many tokens a step commits: ``fixed`` (linear schedule,
            LLaDA), ``threshold`` (confidence > ``threshold``), ``factor``
            (Fast-dLLM factor rule) or ``entropy`` (EB-sampler, summed entropy <=
            ``entropy_bound``); ``verified`` for hybrid models only: a block of mask
            slots drafts the next tokens in the same pass that checks the previous
            drafts with the next-token head (``celeris.sampling.verified``; greedy
            output equals next-token decoding; ``steps``, ``block_length`` and
            ``cache`` do not apply). SDAR's rules (``celeris.sampling.select``):
            ``low_confidence_static`` (= ``fixed``), ``low_confidence_dynamic`` (every position above
            ``threshold`` when there are at least the step's fixed count, else that count) and
            ``sequential`` (the step's count, left to right). For a block-diffusion model
            (``celeris.sampling.block``) ``block_length`` is the denoising sub-block, which must divide the
            model's trained block size, and ``steps`` counts steps per sub-block.
        draft_source: where ``verified`` decoding takes the drafts it checks: ``slots`` (the
            model's mask slots, block diffusion), ``lookup`` (prompt lookup: the tokens that followed
            the last earlier occurrence of the context's last 3 or 2 tokens; Saxena 2023, vLLM's
            ``ngram`` speculator; works for any causal model), ``lookup_first`` (lookup where the
            context has a match, else the slots). The output is the same for each; only speed differs.
        cfg_scale: classifier-free guidance scale s >= 0 (0 disables it).
        repetition_penalty: theta > 0; logits of tokens already in the context (prompt,
            committed answer tokens, suffix) are divided by theta when positive and
            multiplied by it when negative (CTRL, arXiv:1909.05858, Sec. 4.1; the
            ``repetition_penalty`` of transformers and vLLM). 1 disables it.
        seed: per-request RNG seed; None draws a fresh one.
        stop: strings that end the answer (the stop string is not returned unless
            ``include_stop_str_in_output``). A stop string that is exactly a special token (``"<|im_end|>"``)
            ends the answer at that token (``LLM`` and the server add its id to ``stop_token_ids``).
        stop_token_ids: token ids that end the answer, besides the model's end ids (the generation
            config's ``eos_token_id`` list, the tokenizer's end-of-text and end-of-turn tokens). As vLLM.
        ignore_eos: do not end at the model's end ids (``stop_token_ids`` still end it); as vLLM.
        skip_special_tokens: leave special tokens out of the returned text (default); as vLLM.
        include_stop_str_in_output: keep the matched stop string at the end of the text; as vLLM.
        early_exit: stop denoising once every answer holds an end-of-text token
            with all positions before it filled; returns the same text.
        cache: ``none``; ``prefix`` or ``dual`` (Fast-dLLM arXiv:2505.22618): keys
            and values are refreshed by a full pass at the first step of each block;
            later steps recompute only the block and what follows it (prefix) or
            only the block (dual). An approximation for bidirectional models.
            ``delayed``: one full pass (prefill) at the first step, then refreshed only
            as ``cache_refresh`` says; each step recomputes only the block, and a
            block's first step also rewrites the previous block's keys/values with
            its final tokens (the delayed caching of decoded tokens of dKV-Cache,
            arXiv:2505.15781, on top of the dual cache). Cheapest per token; a
            further approximation for a bidirectional model, exact for a causal one.
            ``dual_delayed``: ``delayed`` for what is behind the previous block (the
            prompt and older blocks keep the keys/values they were last computed with),
            the dual cache for the rest: a block's first step recomputes from the
            previous block's first column to the end (that block's final tokens and
            the whole masked suffix), the other steps only the block. Its block-start
            passes shrink as the answer grows; the prompt is never recomputed.
        cache_refresh: with ``cache="delayed"`` or ``"dual_delayed"``, also refill the
            whole cache by a full pass at the first step of every ``cache_refresh``-th
            block (0: only the prefill; 1: every block, i.e. the dual cache). Bounds how
            stale the cached keys/values get (dKV-Cache's refresh interval, arXiv:2505.15781).
        suffix_window: W > 0 lets every pass see only the first W masked answer columns after the
            current block; the rest of the masked suffix is left out of attention (DPad's suffix
            dropping, arXiv:2508.14148, as a fixed window). With a KV cache the passes that recompute
            the suffix then stop at the block's end + W. 0 (default): the whole canvas. Not with a
            suffix to infill (it would shift the suffix's positions), nor with ``cache="delayed"``,
            which never recomputes the suffix (nothing to save) and would read columns coming into
            view from the prefill, where they were computed outside the window.
        grammar: constrained decoding (``celeris.structured``): an llguidance grammar (a JSON Schema's,
            ``json_object``'s or tool calls'); every committed token is one the grammar accepts, and the answer
            ends only where the grammar may end. Each step commits the block's leftmost open position under the
            grammar's mask plus the run of chosen proposals after it that the grammar accepts
            (``celeris.structured.grammar.constrain_commits``). Not with ``verified``.
    """

    max_new_tokens: int = 128
    steps: int = 128
    block_length: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    remasking: str | None = None
    decoding: str = "fixed"
    threshold: float | None = None
    factor: float | None = None
    entropy_bound: float | None = None
    cfg_scale: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    early_exit: bool = True
    cache: str = "none"
    cache_refresh: int | None = None
    suffix_window: int = 0
    draft_source: str | None = None
    grammar: str | None = None
    # Which RULE_SETTINGS the caller set; None at construction: those given a value other than None.
    # Kept by ``dataclasses.replace`` (it passes the field on), so replacing ``seed`` does not turn the
    # filled-in defaults into settings of the caller.
    explicit_settings: frozenset[str] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.explicit_settings is None:
            self.explicit_settings = frozenset(n for n in RULE_SETTINGS if getattr(self, n) is not None)
        for name, default in RULE_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        checks = [(message is None, message) for message in
                  (check_float(name, getattr(self, name)) for name in FLOAT_BOUNDS)]
        checks += [
            (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (self.steps >= 1, f"steps must be >= 1, got {self.steps}"),
            (self.block_length >= 1, f"block_length must be >= 1, got {self.block_length}"),
            (self.remasking in REMASKING, f"remasking must be one of {', '.join(REMASKING)}; got '{self.remasking}'"),
            (self.decoding in DECODING, f"decoding must be one of {', '.join(DECODING)}; got '{self.decoding}'"),
            (self.draft_source in DRAFT_SOURCES,
             f"draft_source must be one of {', '.join(DRAFT_SOURCES)}; got '{self.draft_source}'"),
            (self.cache in CACHE, f"cache must be one of {', '.join(CACHE)}; got '{self.cache}'"),
            (isinstance(self.cache_refresh, int) and not isinstance(self.cache_refresh, bool)
             and self.cache_refresh >= 0, f"cache_refresh must be an integer >= 0, got {self.cache_refresh!r}"),
            (isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0,
             f"top_k must be an integer >= 0 (0 keeps every token), got {self.top_k!r}"),
            (isinstance(self.suffix_window, int) and not isinstance(self.suffix_window, bool)
             and self.suffix_window >= 0, f"suffix_window must be an integer >= 0, got {self.suffix_window!r}"),
            (self.suffix_window == 0 or self.cache != "delayed",
             "suffix_window cannot be used with cache='delayed' (it never recomputes the suffix); use 'dual_delayed'"),
            (self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                   and 0 <= self.seed <= MAX_SEED),
             f"seed must be an integer in [0, {MAX_SEED}], got {self.seed!r}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be a non-empty string or a list of them"),
            (isinstance(self.stop_token_ids, list) and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}"),
        ]
        checks += [(getattr(self, picker) in choices, _unread_message(name, picker, choices, getattr(self, picker)))
                   for name, (picker, choices) in RULE_SETTINGS.items() if name in self.explicit_settings]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @classmethod
    def from_defaults(cls, defaults: dict | None = None, **overrides: object) -> SamplingParams:
        """Build from a model's ``generation_config.json`` dict, then apply non-None overrides.

        A model's default ``decoding="verified"`` becomes ``"fixed"`` (next-token decoding for a causal
        model, the same greedy text) when a ``grammar`` is given: constrained decoding does not run under
        verified decoding; a caller who asks for both gets the error.

        A default ``steps`` goes with the default ``max_new_tokens``: when only the
        length is overridden, steps are scaled to keep the default's tokens per step,
        ``ceil(max_new_tokens * steps / default max_new_tokens)``, so a longer answer
        is not decoded with more tokens per step (the quality knob) than the model's
        defaults were chosen at. An explicit ``steps`` is used as given.

        Raises:
            ValueError: an invalid setting (see ``__post_init__``).
        """
        known = {f.name for f in fields(cls)} - {"explicit_settings"}
        merged = {k: v for k, v in (defaults or {}).items() if k in known}
        given = {k: v for k, v in overrides.items() if v is not None}
        merged.update(given)
        merged["explicit_settings"] = frozenset(given).intersection(RULE_SETTINGS)
        d_len, d_steps = (defaults or {}).get("max_new_tokens"), (defaults or {}).get("steps")
        length = given.get("max_new_tokens")
        if "steps" not in given and isinstance(length, int) and length >= 1 and d_len and d_steps:
            merged["steps"] = -(-length * d_steps // d_len)
        if merged.get("grammar") is not None and merged.get("decoding") == "verified" and "decoding" not in given:
            # a hybrid model's default under a grammar: its next-token decoding (the same greedy text)
            merged["decoding"] = "fixed"
        return cls(**merged)

    def structure_key(self) -> tuple:
        """Settings that must be equal for requests to share one batched sampler call."""
        return (self.max_new_tokens, self.steps, self.block_length, self.remasking, self.decoding,
                self.threshold, self.factor, self.entropy_bound, self.cfg_scale > 0, self.early_exit, self.cache,
                self.cache_refresh, self.suffix_window)
