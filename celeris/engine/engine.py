"""Engine: ``step()`` = schedule, then each request through the path of its mode, then emit and free.

A request's mode (a key of the registry ``celeris.sampling.modes.MODES``) is decided once, in ``add_request``
(``check_request``), and stored as ``Request.mode``; ``Engine.paths`` maps each mode to its path
(``celeris.engine.path.ModePath``: for the built-in modes ``engine/verified.py``, ``engine/blocks.py``,
``engine/masked.py``), made from the mode's registered factory at its first request, which owns the request's
cursor as ``request.state`` and counts each step with ``Request.record_step``. Every path takes its KV rows from
the runner's one store (``celeris.engine.kv.KVStore``); the scheduler admits a request while the store has the
rows its path says it takes (``kv_rows``), and prefills a long prompt in chunks where its path can
(``prefill_columns``; ``celeris.engine.scheduler``'s docstring). The engine's step names no mode; ``drafter`` and
``block_decoder`` are read-only handles on the verified and block paths for the counters ``stats()`` reports and for tests.

Offline ``LLM.generate``, the HTTP server and batch jobs all drive this same
``step()``. Every running request moves one denoising step per call, whatever
its own settings; new requests join at step boundaries (continuous batching).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from celeris.config import EngineConfig
from celeris.engine.blocks import BlockDecoder
from celeris.engine.kv import PREFIX_CACHE_TOKENS
from celeris.engine.masked import MaskedPath
from celeris.engine.path import ModePath, PathContext, PathFactory
from celeris.engine.request import Request
from celeris.engine.runner import ModelRunner
from celeris.engine.scheduler import Scheduler
from celeris.engine.verified import VerifiedDecoder
from celeris.engine.verified_path import VerifiedPath
from celeris.sampling.block import with_block_defaults
from celeris.sampling.dry import DrySettings
from celeris.sampling.logprobs import prompt_entries
from celeris.sampling.modes import MODES, check_fits_context, check_request
from celeris.sampling.params import SamplingParams
from celeris.structured.grammar import row_constraints

# the built-in modes' paths (``celeris.sampling.modes`` registers their checks on the floor below, without them)
BUILTIN_PATHS: dict[str, PathFactory] = {"block": BlockDecoder, "verified": VerifiedPath, "masked": MaskedPath}


def path_factory(mode: str) -> PathFactory:
    """The factory of ``mode``'s path: the one its registration gives, else the built-in table's.

    Raises:
        ValueError: a mode registered without a path that is not a built-in one.
    """
    registered = MODES[mode].path
    if registered is not None:
        return registered
    if mode not in BUILTIN_PATHS:
        raise ValueError(f"decoding mode '{mode}' was registered without a path (give DecodingMode.path a factory)")
    return BUILTIN_PATHS[mode]


@dataclass(slots=True)
class StepOutput:
    """What one step did for one request.

    Attributes:
        request: the request (its canvas, timings and counters are up to date).
        new_token_ids: answer tokens that became final (the committed
            left-to-right prefix, cut before end-of-text) during this step.
        finished: the request is done (``request.finish_reason`` says why).
    """

    request: Request
    new_token_ids: list[int]
    finished: bool


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What an engine holds and has done, read by the server's metrics and the bench (``Engine.stats``).

    Attributes:
        num_waiting / num_running: requests in the scheduler's queues.
        num_steps: ``Engine.step`` calls that ran a batch.
        kv_bytes: bytes of the engine's one KV store (``celeris.engine.kv.KVStore``: 0 until a request first takes
            rows, then its whole allocation, a DFlash drafter's layers included; prefix caches not included): the
            one KV figure.
        prefix_cache_queries / prefix_cache_hits: prompt tokens looked up in the engine's prefix cache (the KV
            store's, ``celeris.engine.kv.PrefixCache``: the verified path's and the masked path's causal prefills),
            and of those the tokens whose keys/values came from it (vLLM's ``prefix_cache_queries``/``_hits``).
        drafted / accepted: per draft position j = 1..k, drafts checked and accepted under verified decoding.
    """

    num_waiting: int = 0
    num_running: int = 0
    num_steps: int = 0
    kv_bytes: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    drafted: tuple[int, ...] = ()
    accepted: tuple[int, ...] = ()


class Engine:
    """Owns a Scheduler and a ModelRunner for one model.

    Args:
        model: a model with ``config.mask_token_id / eos_token_id / pad_token_id``
            whose forward takes (ids, bool attention mask, logits_slice).
        config: batching budgets and queue length.
        end_ids: every id that ends an answer (``Tokenizer.end_token_ids``: end-of-text, the generation
            config's ``eos_token_id`` list, end-of-turn tokens); default: the model config's end-of-text id.
        grammar_tokenizer: llguidance's tokenizer (``celeris.structured.grammar_tokenizer``), needed for
            requests with a ``grammar`` (constrained decoding, the reference sampler's rule).
        grammar_tokenizer_loader: instead, a function returning it (or None), called at the first request with a
            grammar (building it takes about 0.2 s for a 49,152-token vocabulary: a load that serves no grammar
            never pays it).
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None,
                 end_ids: list[int] | None = None, grammar_tokenizer: object | None = None, *,
                 grammar_tokenizer_loader: Callable[[], object | None] | None = None) -> None:
        self.config = config or EngineConfig()
        self.scheduler = Scheduler(self.config)
        config = model.config
        # the most tokens a request holds (EngineConfig.max_model_len, else the model's window): sizes the KV store
        self.max_model_len = self.config.max_model_len or getattr(config, "max_position_embeddings", None)
        # padding canvases to buckets only saves compiles: eager passes compute their own width (up to 31 wasted
        # columns per row of a full pass otherwise: a 40-token prompt's prefill cost 64 columns)
        bucket = 1 if self.config.enforce_eager else self.config.length_bucket
        self.runner = ModelRunner(model, self.config.enforce_eager, bucket, self.config.max_num_seqs,
                                  self.max_model_len,
                                  PREFIX_CACHE_TOKENS if self.config.enable_prefix_caching else 0)
        self.mask_id, self.eos_id = config.mask_token_id, config.eos_token_id
        self.end_ids = frozenset(end_ids if end_ids is not None else [self.eos_id])
        self.model = model
        self._grammar_tokenizer, self._grammar_loader = grammar_tokenizer, grammar_tokenizer_loader
        self._ids = itertools.count()
        self.num_steps = 0
        self.context = PathContext(model, self.runner, self.config, self.max_model_len, self.eos_id)
        # mode -> its path, made at the mode's first request from the factory it registered (``path``)
        self.paths: dict[str, ModePath] = {}
        self.scheduler.cost = self.batch_tokens
        self.scheduler.kv_rows = self.kv_rows
        self.scheduler.prefill_columns = self.prefill_columns

    def path(self, mode: str) -> ModePath:
        """The path of ``mode`` (a key of ``celeris.sampling.modes.MODES``), made from its factory (``path_factory``)
        with this engine's shared parts (``PathContext``) the first time it is asked for."""
        if mode not in self.paths:
            self.paths[mode] = path_factory(mode)(self.context)
        return self.paths[mode]

    def _groups(self, requests: list[Request]) -> list[tuple[str, list[Request]]]:
        """``requests`` grouped by mode, in the registry's order (the order a step runs the paths)."""
        order = [*MODES, *(m for m in self.paths if m not in MODES)]
        order += sorted({r.mode for r in requests} - set(order))
        return [(mode, group) for mode in order if (group := [r for r in requests if r.mode == mode])]

    def batch_tokens(self, requests: list[Request]) -> int:
        """Columns one step over ``requests`` computes, each mode's group counted by its path (``token_cost``):
        the scheduler's ``max_num_batched_tokens`` budget."""
        return sum(self.path(mode).token_cost(group) for mode, group in self._groups(requests))

    def kv_rows(self, requests: list[Request]) -> int:
        """Rows of the KV store (``runner.kv``) ``requests`` hold once running, each counted by its path
        (``kv_rows``): the scheduler admits no more than the store has."""
        return sum(self.path(r.mode).kv_rows(r) for r in requests)

    def prefill_columns(self, request: Request) -> int:
        """Prompt columns ``request``'s path can prefill in chunks ahead of its first step (its optional
        ``prefill_columns``; 0: none, its prompt is prefilled whole): the scheduler's chunked prefill."""
        columns = getattr(self.path(request.mode), "prefill_columns", None)
        return columns(request) if columns is not None else 0

    @property
    def drafter(self) -> VerifiedDecoder | None:
        """The verified path's decoder (made at the first verified request), else None."""
        path = self.paths.get("verified")
        return path.decoder if isinstance(path, VerifiedPath) else None

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix caches (vLLM's ``reset_prefix_cache``): the next prompts are prefilled in full. Running
        requests are unaffected (a row copies the cached keys/values it uses). Returns True."""
        if self.runner.kv.prefix_cache is not None:
            self.runner.kv.prefix_cache.clear()
        if self.drafter is not None:
            self.drafter.reset_prefix_cache()
        return True

    @property
    def block_decoder(self) -> BlockDecoder | None:
        """The block path (made at the first block request), else None."""
        path = self.paths.get("block")
        return path if isinstance(path, BlockDecoder) else None

    @property
    def grammar_tokenizer(self) -> object | None:
        """llguidance's tokenizer for requests with a grammar (built now if the engine was given its builder)."""
        if self._grammar_loader is not None:
            self._grammar_tokenizer, self._grammar_loader = self._grammar_loader(), None
        return self._grammar_tokenizer

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        suffix_ids: list[int] | None = None,
        request_id: str | None = None,
        score_only: bool = False,
    ) -> Request:
        """Queue a request. ``score_only``: score the prompt (``params.prompt_logprobs``) and finish with no answer
        token (OpenAI's ``echo`` with ``max_tokens`` 0).

        Raises:
            ValueError: empty prompt, or settings the model cannot decode (``check_request``: an
                unsupported cache; for an autoregressive model, blocks longer than one token, CFG, a suffix;
                a grammar without ``grammar_tokenizer``, or one that does not compile); ``prompt_logprobs`` on a
                model that is not causal; more KV rows than the store has (``_check_kv``).
            ContextLengthError: a request that takes KV rows does not fit ``max_model_len``.
            QueueFullError: the waiting queue is full.
        """
        params = with_block_defaults(self.model, params)  # a block model's sub-block when left at the default
        mode = check_request(self.model, params, bool(suffix_ids))
        if params.prompt_logprobs is not None and not getattr(self.model.config, "is_causal", False):
            raise ValueError("prompt_logprobs needs a causal (autoregressive or hybrid) model; a diffusion model has "
                             "no left-to-right likelihood of its prompt")
        request = Request(request_id or f"req-{next(self._ids)}", list(prompt_ids), params, self.mask_id,
                          list(suffix_ids or []), score_only=score_only, mode=mode)
        self._check_kv(request)
        # under a grammar the answer ends where the grammar lets it end: a stop token id inside the constrained text
        # (a JSON character) would cut it invalid, so stop_token_ids apply only without a grammar
        stops = frozenset(params.stop_token_ids) if params.grammar is None else frozenset()
        request.stop_ids = (frozenset() if params.ignore_eos else self.end_ids) | stops
        request.constraint = row_constraints([params], self.grammar_tokenizer if params.grammar is not None else None)[0]
        request.dry = DrySettings.of(params, self.model)
        self.scheduler.add(request)
        return request

    def _check_kv(self, request: Request) -> None:
        """Refuse a request whose keys/values the KV store cannot hold: a row per ``max_model_len`` tokens, and
        more rows than the store has (a CFG request with a cache takes two).

        Raises:
            ContextLengthError: prompt + answer (+ suffix) exceed ``max_model_len`` for a request that takes rows.
            ValueError: it takes more rows than the store has (the message starts with ``cfg_scale``), or no
                ``max_model_len`` is known to size the store's rows.
        """
        rows = self.path(request.mode).kv_rows(request)
        if rows == 0:
            return
        if not self.max_model_len:
            raise ValueError("max_model_len is not known for this model (no max_position_embeddings): give "
                             "EngineConfig(max_model_len=...) to size the KV store its cache needs")
        check_fits_context(len(request.prompt_ids), len(request.suffix_ids), request.params.max_tokens,
                           self.max_model_len)
        if rows > self.runner.kv.num_rows:
            raise ValueError(f"cfg_scale with cache='{request.params.cache}' needs {rows} rows of the KV store, which "
                             f"has {self.runner.kv.num_rows} (max_num_seqs); raise max_num_seqs or use cache='none'")

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request; it takes no further steps. Returns whether one was found."""
        found = self.scheduler.abort(request_id) is not None
        if found:
            self._free_finished()
        return found

    def _free_finished(self) -> None:
        """Free the KV rows of finished or aborted requests in every mode path at once, so no memory outlives a
        request even when no further step runs."""
        for path in self.paths.values():
            path.release()

    def stats(self) -> EngineStats:
        """The engine's counters and its one KV figure (``EngineStats``), without reaching into its paths."""
        drafter, cache = self.drafter, self.runner.kv.prefix_cache
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=sum(not r.is_finished for r in self.scheduler.running),
            num_steps=self.num_steps, kv_bytes=self.runner.kv.nbytes,
            prefix_cache_queries=cache.query_tokens if cache else 0, prefix_cache_hits=cache.hit_tokens if cache else 0,
            drafted=tuple(drafter.drafted) if drafter else (), accepted=tuple(drafter.accepted) if drafter else ())

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def pending_drafts(self, request: Request) -> list[int]:
        """Under verified decoding, the drafts the request's next pass checks (token ids for the answer positions
        right after its committed tokens); [] for other requests and after the last pass."""
        return VerifiedPath.pending_drafts(request)

    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """Run one step for every scheduled request, each through the path of its mode (``self.paths``: one
        verified pass, one block pass, one masked-diffusion step); returns one StepOutput each."""
        batch = self.scheduler.schedule()
        if not batch:
            self._free_finished()  # e.g. every request was aborted since the last step
            return []
        outputs = self._score_prompts(batch)
        if outputs:
            batch = [r for r in batch if not r.is_finished]
        for mode, group in self._groups(batch):
            outputs += [self._emit(r) for r in self.path(mode).step(group)]
        self._free_finished()  # a finished request's keys/values go now, not at a later step
        self.num_steps += 1
        return outputs

    def _score_prompts(self, batch: list[Request]) -> list[StepOutput]:
        """Score the prompts of newly scheduled requests that ask (``prompt_logprobs``: one causal pass each,
        ``celeris.sampling.logprobs.prompt_entries``), and finish the ``score_only`` ones; their StepOutputs."""
        outputs = []
        for r in batch:
            if r.params.prompt_logprobs is not None and r.prompt_logprob_entries is None:
                r.prompt_logprob_entries = prompt_entries(self.model, r.prompt_ids, r.params.prompt_logprobs)
                r.nfe += 1
            if r.score_only and not r.is_finished:
                r.finish("length")
                outputs.append(self._emit(r))
        return outputs

    def _emit(self, request: Request) -> StepOutput:
        """The answer tokens that became final since the request's last StepOutput (streaming)."""
        prefix = request.final_prefix(self.eos_id)
        new_ids = prefix[request.num_emitted :]
        request.num_emitted = len(prefix)
        return StepOutput(request, new_ids, request.is_finished)
