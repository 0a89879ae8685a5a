"""The verified decoder: ``VerifiedDecoder`` (continuous batching of draft-and-verify passes over rows of a KV
store) and ``generate_verified`` (a whole batch through one decoder); a row's cursor is a ``DraftRow``
(``celeris.engine.draft_rows``, re-exported here). The engine's mode path over a decoder, whose requests' cursors
(``request.state``) are its rows, is ``celeris.engine.verified_path.VerifiedPath``.

What verified decoding is, and the rules it follows (drafts, verification, grammars), is
``celeris.sampling.verified``'s docstring; this module runs the model and owns the keys/values
(``celeris.engine.kv.PrefixCache`` for prompt prefixes; a long prompt's chunks, ``DraftRow.plan_chunk``); the
drafts come from each row's ``draft_source`` proposer (``celeris.engine.proposers``), asked once a step for all
its rows.
"""

from __future__ import annotations

import itertools
import time

import torch

from celeris.engine.draft_rows import DraftRow, VerifiedOutput, forward, pass_mask, row_logprobs
from celeris.engine.kv import BLOCK_SIZE, PREFIX_CACHE_TOKENS, ROW_SLACK, KVStore, PrefixCache
from celeris.engine.path import pad_groups
from celeris.engine.proposers import DraftAsk, Drafts, Proposer, make_proposer
from celeris.models.layers import KVCache
from celeris.sampling.drafter import DFlashProposer, DraftState, proposer_of
from celeris.sampling.dry import DrySettings
from celeris.sampling.params import SamplingParams
from celeris.sampling.select import NEG_INF
from celeris.sampling.step import (
    History,
    RowSettings,
    banned_token_ids,
    check_prompts,
    make_generator,
)
from celeris.sampling.verified import (
    LOOKUP_DRAFTS,
    MAX_DRAFTS,
    check_draft_source,
    check_verified_support,
    greedy_accept,
    greedy_along,
    mask_slots,
    penalize_along,
    verify_drafts,
    verify_under_grammar,
)
from celeris.structured.grammar import Constraint, row_constraints

KEY_BUCKET = 64  # a pass's keys run to a multiple of this many columns (its cache views change once per bucket)


class VerifiedDecoder:
    """Continuous batching for verified decoding: rows join and leave between passes.

    Every row's keys/values live in one row of a ``KVStore`` (per layer (rows, H_kv, max_len, D), H_kv the
    model's key/value heads): the engine's one store, whose rows it takes as a ``KVSegment``, or a store of its
    own (``max_rows`` rows of ``max_tokens`` + the draft columns) when none is given. Rows that are running occupy
    the segment's rows [0, n), so a pass works on views of the store. A step prefills newly added rows in one
    pass (on a fresh cache, copied into their rows) and advances the others in one pass. Finished rows are
    removed by moving the last row into the hole (one row copy) and giving the last row back.

    Each row checks k drafts per pass, its ``num_speculative_tokens`` (default ``draft_length`` of the model,
    or ``LOOKUP_DRAFTS`` without slots); its mask slots are min(k, ``draft_length``).

    Automatic prefix caching (``celeris.engine.kv.PrefixCache``): a new row copies the keys/values of the longest
    cached block-aligned prefix of its prompt into its pool row and prefills only the rest; after its prefill its
    prompt's full blocks are cached. The answer is the same (keys/values of a causal prefix are exact; computed in
    a pass of another shape they may differ by float rounding only).

    With a DFlash drafter (``proposer``, default the one ``attach`` put beside the model), each pass also keeps
    the target's hidden states at the drafter's layers; the prefix cache then also keeps a cached prefix's target
    features (the drafter's context), and a prefix is reused as far as both reach. The drafter's keys/values of a
    row's context live in the same row of the store, in its drafter layers (``KVStore``), and move with the row.

    Args:
        model: a causal model with a KV cache.
        proposer: a DFlash drafter's proposer (``celeris.sampling.drafter``); None: ``proposer_of(model)``.
        max_rows: most rows at once. max_tokens: longest prompt + answer, tokens (the store adds the
            2 * ``MAX_DRAFTS`` + 2 columns the last pass's drafts and slots may need); both are the store's
            when ``store`` is given.
        prefix_cache_tokens: most prompt tokens whose keys/values the prefix cache of its own store keeps (LRU); 0
            turns it off. With ``store`` given, the store's ``prefix_cache`` serves instead (None: off).
        entry: what a pass calls (``layout_hidden_states``, ``logits``): the engine's runner; None: the model.
        store: the engine's KV store to take rows from; None: one of its own.
    """

    def __init__(self, model: torch.nn.Module, max_rows: int, max_tokens: int | None,
                 prefix_cache_tokens: int = PREFIX_CACHE_TOKENS, proposer: DFlashProposer | None = None,
                 entry: object | None = None, store: KVStore | None = None) -> None:
        self.entry = entry or model  # what a pass calls (``layout_hidden_states``, ``logits``): the engine's runner
        self.proposer = proposer or proposer_of(model)
        self.slots = mask_slots(model, self.proposer)  # mask slots the model drafts (0: none)
        self.model = model
        self.k = self.proposer.k if self.proposer else self.slots or LOOKUP_DRAFTS  # the default k
        self.pad = ROW_SLACK  # 2 * MAX_DRAFTS + 2 columns
        store = store or KVStore(model, max_rows, None if max_tokens is None else max_tokens + self.pad,
                                 self.proposer.drafter if self.proposer else None, prefix_cache_tokens)
        if store.row_len is None:
            raise ValueError("verified decoding needs a max_model_len (its rows hold prompt + answer + drafts)")
        self.segment = store.segment()
        max_rows, max_len = store.num_rows, store.row_len
        p = next(model.parameters())
        self.tokens = torch.full((max_rows, max_len), model.config.mask_token_id, dtype=torch.long, device=p.device)
        self.max_rows, self.max_len, self.device = max_rows, max_len, p.device
        self.banned = banned_token_ids(model.config)
        self.rows: list[DraftRow] = []
        self.num_prefilled = 0  # rows [0, num_prefilled) have been through their first pass
        self.drafted, self.accepted = [0] * self.k, [0] * self.k  # grow when a row checks more drafts
        self.nfe = 0
        self.logprobs_mode = "raw_logprobs"  # EngineConfig.logprobs_mode (celeris.sampling.logprobs), set by the engine
        self.raw_logits: torch.Tensor | None = None  # the last pass's logits before the ban, when a row asks
        self.prefix_cache = store.prefix_cache  # the store's (the engine's one, shared with the masked path)
        # with a drafter: the target features of cached prefixes, (1, 1, BLOCK_SIZE, n * d) per block
        self.feature_cache = PrefixCache(self.prefix_cache.max_blocks * BLOCK_SIZE) \
            if self.prefix_cache is not None and self.proposer else None
        self.proposers: dict[str, Proposer] = {}  # draft_source -> its proposer, made at the first row asking
        self._views: tuple | None = None  # the last pass's cache views (``_cache_views``)
        self._keys_index: torch.Tensor | None = None  # key columns of the last length (``_key_columns``)

    def proposer_for(self, source: str) -> Proposer:
        """The proposer of ``draft_source`` ``source`` (``celeris.engine.proposers``), made at its first use."""
        if source not in self.proposers:
            self.proposers[source] = make_proposer(source, self)
        return self.proposers[source]

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per layer the keys of the rows it holds, (rows, H_kv, max_len, D) views of the store."""
        return self.segment.keys

    @property
    def values(self) -> list[torch.Tensor]:
        """Per layer the values of the rows it holds, as ``keys``."""
        return self.segment.values

    @property
    def pool_bytes(self) -> int:
        """Bytes of the KV store it takes rows from (the engine's one store, or its own): 2 x layers x rows x H_kv
        x max_len x head_dim x element size (``celeris.models.loader.kv_cache_bytes`` estimates it before
        loading), plus the same count of a DFlash drafter's layers (``KVStore.draft_len`` columns)."""
        return self.segment.store.nbytes

    def add(self, prompt_ids: list[int], params: SamplingParams, end_ids: frozenset[int] | None = None,
            constraint: Constraint | None = None) -> DraftRow:
        """Queue a row for the next step; ``end_ids`` end its answer (default: the end-of-text id); ``constraint``:
        its grammar state when ``params.grammar`` is set (``celeris.structured.grammar.row_constraints``).

        Raises:
            ValueError: the pool is full, the prompt is empty, the row does not fit ``max_len``, or its draft
                settings cannot draft here (``check_draft_source``, the check admission runs too).
        """
        check_prompts([prompt_ids])
        if len(prompt_ids) + params.max_tokens + self.pad > self.max_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) + "
                             f"{self.pad} draft columns exceed the decoder's {self.max_len}")
        ends = frozenset({self.model.config.eos_token_id}) if end_ids is None else frozenset(end_ids)
        check_draft_source(params, self.proposer, self.slots)
        k = params.num_speculative_tokens or self.k
        if k > MAX_DRAFTS:
            raise ValueError(f"num_speculative_tokens must be <= {MAX_DRAFTS}, got {k}")
        slots = self.proposer_for(params.draft_source).first_slots(k)
        if self.segment.store.num_free_rows < 1:
            raise ValueError(f"the verified decoder's KV store holds at most {self.max_rows} rows, all taken")
        self.segment.grow(1)  # the new row: len(self.rows)
        row = DraftRow(list(prompt_ids), params, make_generator(params.seed), k, ends, constraint=constraint,
                       slot_start=len(prompt_ids), num_slots=slots,
                       draft_state=DraftState() if self.proposer else None)
        settings = RowSettings.from_params([params], self.device)
        row.history = History.of(settings, [torch.tensor(prompt_ids)], [torch.zeros(0, dtype=torch.long)],
                                 self.model.config.vocab_size, self.model.config.mask_token_id, self.device)
        if row.history is not None:  # what its penalties read (``penalize_along``)
            row.penalty_settings = settings
        row.dry = DrySettings.of(params, self.model)
        if self.prefix_cache is not None:  # copy the cached prefix's keys/values into the row's pool row
            reach, feats = None, None  # with a drafter: only as far as its context (features) for the prefix reaches
            if self.feature_cache is not None:
                reach, feats = self.feature_cache.lookup(row.prompt_ids)
            row.num_cached, kv = self.prefix_cache.lookup(row.prompt_ids, reach)
            if feats is not None and row.num_cached:
                self.proposer.queue(row.draft_state, feats[0, 0, : row.num_cached])
            if kv is not None and row.num_cached:
                for t, block in zip((*self.keys, *self.values), kv, strict=True):
                    t[len(self.rows), :, : row.num_cached] = block
        self.tokens[len(self.rows), : len(prompt_ids)] = torch.tensor(prompt_ids, dtype=torch.long)
        self.tokens[len(self.rows), len(prompt_ids) : len(prompt_ids) + slots] = self.model.config.mask_token_id
        self.rows.append(row)
        return row

    def reset_prefix_cache(self) -> None:
        """Empty the prefix cache (its store's: the engine's one, when it has one) and the drafter's feature cache
        (rows already running keep what they copied)."""
        for cache in (self.prefix_cache, self.feature_cache):
            if cache is not None:
                cache.clear()

    def remove(self, row: DraftRow) -> None:
        """Free a row's pool slot (the last row moves into it, its drafter's layers too)."""
        i, last = self.rows.index(row), len(self.rows) - 1
        if i != last:
            n = self.written(self.rows[last])
            for t in self.segment.layers:  # the columns it wrote, not its whole row (pages the OS maps on write)
                t[i, :, :n] = t[last, :, :n]
            self.tokens[i] = self.tokens[last]
            self.rows[i] = self.rows[last]
        self.rows.pop()
        self.segment.shrink(1)
        if i < self.num_prefilled:
            self.num_prefilled -= 1
            if i != last and last >= self.num_prefilled + 1:  # a new row moved into the prefilled range
                self._swap(i, self.num_prefilled)

    @staticmethod
    def written(row: DraftRow) -> int:
        """Columns of its store row that ``row`` may have written: its prompt and answer, and its last pass's
        drafts and slots (what moves with it)."""
        return max(len(row.prompt_ids) + len(row.answer), row.slot_start + row.num_slots) + 1

    def _swap(self, i: int, j: int) -> None:
        n = max(self.written(self.rows[i]), self.written(self.rows[j]))
        for t in self.segment.layers:
            t[[i, j], :, :n] = t[[j, i], :, :n]
        self.tokens[[i, j]] = self.tokens[[j, i]]
        self.rows[i], self.rows[j] = self.rows[j], self.rows[i]

    def _key_columns(self, length: int) -> torch.Tensor:
        """(length,) int64 0 .. length - 1 on the device, kept while the length stays (it changes once a bucket)."""
        if self._keys_index is None or self._keys_index.numel() != length:
            self._keys_index = torch.arange(length, device=self.device)
        return self._keys_index

    def _cache_views(self, lo: int, hi: int, length: int) -> KVCache:
        """The first ``length`` columns of store rows [lo, hi) of every layer, as views made again only when the
        rows, the segment or the length changed (a pass makes 60-odd; the fast pass's layer stack then also reads
        their addresses once, not each pass)."""
        keys, values = self.keys, self.values  # the segment's own row views: the same objects until rows move
        made = self._views
        if made is not None and made[0] == (lo, hi, length) and made[1] is keys[0] and made[2] is values[0]:
            return KVCache(list(made[3]), list(made[4]))
        views = [t[lo:hi, :, :length] for t in keys], [t[lo:hi, :, :length] for t in values]
        self._views = ((lo, hi, length), keys[0], values[0], *views)
        return KVCache(list(views[0]), list(views[1]))

    @torch.no_grad()
    def _run(self, lo: int, hi: int, fresh: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pass over pool rows [lo, hi): (hi - lo, Lw, V) logits of each row's ``columns``, and with a drafter
        the (hi - lo, Lw, n * d) target features of those columns (else None)."""
        rows = self.rows[lo:hi]
        cols = [r.columns for r in rows]
        width = max(len(c) for c in cols)
        columns = torch.tensor([c + c[-1:] * (width - len(c)) for c in cols], device=self.device)
        length = max(c[-1] for c in cols) + 1  # no query sees a key past its row's last column
        if fresh:  # prefill: a cache of just these rows, copied into the pool afterwards
            shape = (hi - lo, *self.keys[0].shape[1:2], length, self.keys[0].shape[3])
            cache = KVCache([torch.zeros(shape, dtype=self.keys[0].dtype, device=self.device) for _ in self.keys],
                            [torch.zeros(shape, dtype=self.keys[0].dtype, device=self.device) for _ in self.keys])
            for j, r in enumerate(rows):  # a cached prefix (copied into the pool row by ``add``)
                for new, pool in zip((*cache.keys, *cache.values), (*self.keys, *self.values), strict=True):
                    new[j, :, : r.num_cached] = pool[lo + j, :, : r.num_cached]
        else:  # the keys run to a multiple of KEY_BUCKET: the same views for many passes (masked past ``length``)
            length = min(-(-length // KEY_BUCKET) * KEY_BUCKET, self.max_len)
            cache = self._cache_views(lo, hi, length)
        if any(r.num_slots for r in rows):
            mask = pass_mask(columns, torch.tensor([r.slot_start for r in rows], device=self.device),
                             torch.tensor([r.num_slots for r in rows], device=self.device), length)
        else:  # no mask slots (drafts of prompt lookup or a drafter): every column causal, ``pass_mask``'s rule
            mask = (self._key_columns(length)[None, None, :] <= columns[:, :, None])[:, None]
        # a prefill reads only its last prompt column and slots (``_advance``; a chunk, none): the head runs on those
        first = [min(len(r.prompt_ids) - 1 - r.num_cached, len(r.columns) - 1) for r in rows] if fresh else None
        capture = self.proposer.capture() if self.proposer else None
        logits = forward(self.entry, self.tokens[lo:hi].gather(1, columns), cache, columns, mask, first,
                          capture, [len(c) - 1 for c in cols] if fresh else None).float()
        feats = DFlashProposer.features(capture) if capture else None  # (hi - lo, Lw, n * d)
        if fresh:
            for pool, new in zip((*self.keys, *self.values), (*cache.keys, *cache.values), strict=True):
                pool[lo:hi, :, :length] = new
            if self.prefix_cache is not None:
                for j, r in enumerate(rows):
                    # the new full blocks, as far as the pass computed (a chunk stops short of the prompt's end)
                    a, b = (n // BLOCK_SIZE * BLOCK_SIZE for n in (r.num_cached, min(len(r.prompt_ids), cols[j][-1] + 1)))
                    if b > a:
                        self.prefix_cache.insert_row(r.prompt_ids, cache.keys, cache.values, j, a, b)
                        if self.feature_cache is not None:  # the features of columns [0, num_cached) are queued
                            known = torch.cat([*r.draft_state.queued, feats[j]])  # columns 0, 1, ..
                            self.feature_cache.insert(r.prompt_ids[:b], known[None, None, a:b], a)
        wants = self.logprobs_mode == "raw_logprobs" and any(r.params.logprobs is not None for r in rows)
        self.raw_logits = logits.clone() if wants else None  # asking for nothing costs nothing
        if self.banned:  # (an empty list still costs an indexing call)
            logits[..., self.banned] = NEG_INF
        self.nfe += 1
        return logits, feats

    def step(self) -> list[tuple[DraftRow, list[int]]]:
        """One pass for the rows already prefilled and one prefill pass for new rows (a chunk, for a row prefilling
        in chunks: ``DraftRow.chunk``; each only if any).

        Returns (row, tokens committed this pass) for every row that ran; a row ends (``finished``) at
        ``max_tokens`` or, with ``early_exit``, at its first end-of-text token. Finished rows stay until
        ``remove``.
        """
        out = []
        n_old = self.num_prefilled
        for lo, hi, fresh in ((0, n_old, False), *self._prefill_groups(n_old)):
            live = [i for i in range(lo, hi) if not self.rows[i].finished]
            if not [i for i in live if self.rows[i].chunk or not self.rows[i].prefilling]:  # none, or all paused
                continue
            logits, feats = self._run(lo, hi, fresh)
            raw = self.raw_logits
            asks = []
            for i in live:
                row = self.rows[i]
                if row.prefilling:  # a chunk of its prompt is in its row now: nothing to verify yet
                    if feats is not None and row.chunk:  # its features enter the drafter at its first call
                        self.proposer.queue(row.draft_state, feats[i - lo, : row.chunk])
                    row.num_cached, row.chunk = row.num_cached + row.chunk, 0
                    continue
                new, ask = self._advance(i, logits[i - lo], None if feats is None else feats[i - lo],
                                         None if raw is None else raw[i - lo])
                out.append((row, new))
                if ask is not None:
                    asks.append(ask)
            self._propose(asks)
        self.num_prefilled = n_old  # rows still prefilling in chunks stay after the prefilled ones
        for i in [i for i in range(n_old, len(self.rows)) if self.rows[i].passes]:
            if i != self.num_prefilled:
                self._swap(i, self.num_prefilled)
            self.num_prefilled += 1
        return out

    def _prefill_groups(self, lo: int) -> list[tuple[int, int, bool]]:
        """The prefill passes of rows [lo, n) (new rows, or chunks): one pass, or on a CPU groups that each pad
        little (``celeris.engine.path.pad_groups`` over each row's columns; 8 GSM8K prompts in one pass padded
        their prefill by about a half), the rows reordered so that each group is a range of rows: (lo, hi, True)
        per pass."""
        n = len(self.rows)
        if n - lo < 2 or self.device.type != "cpu":
            return [(lo, n, True)] if n > lo else []
        groups = pad_groups({i: len(self.rows[i].columns) for i in range(lo, n)})
        if len(groups) == 1:
            return [(lo, n, True)]
        for p, row in enumerate([self.rows[i] for g in groups for i in g]):  # each group's rows side by side
            q = self.rows.index(row, lo)
            if q != lo + p:
                self._swap(lo + p, q)
        bounds = list(itertools.accumulate((len(g) for g in groups), initial=lo))
        return [(a, b, True) for a, b in itertools.pairwise(bounds)]

    @staticmethod
    def verify(row: DraftRow, logits: torch.Tensor) -> tuple[int, list[int]]:
        """Check ``row``'s m drafts with the target's next-token logits (m + 1, V) at its pending token and drafts
        (penalized in place first, when the row has a penalty, as next-token decoding penalizes each position once
        it is committed: ``penalize_along``): (drafts accepted, the tokens to commit, cut at ``max_tokens``)."""
        left = row.params.max_tokens - len(row.answer)
        if row.history is not None and row.dry is None and row.constraint is None and row.params.temperature == 0 \
                and row.params.logprobs is None:  # nothing reads the penalized logits: the kernel's one pass
            greedy = greedy_along(logits, row.history, row.drafts, row.penalty_settings)
            if greedy is not None:
                a, token = greedy_accept(row.drafts, greedy)
                return a, (row.drafts[:a] + [token])[:left]
        if row.history is not None or row.dry is not None:  # DRY: each position after its own tokens and drafts
            logits[:] = penalize_along(logits, row.history, row.drafts, row.penalty_settings,
                                       row.prompt_ids + row.answer, row.dry)
        if row.constraint is not None:  # the grammar-masked head checks the drafts (verify_under_grammar)
            return verify_under_grammar(row.constraint, logits, row.drafts, row.draft_probs, row.params,
                                        row.generator, left)
        a, token = verify_drafts(logits, row.drafts, row.draft_probs, row.params, row.generator)
        return a, (row.drafts[:a] + [token])[:left]

    def _advance(self, i: int, logits: torch.Tensor, feats: torch.Tensor | None = None,
                 raw: torch.Tensor | None = None) -> tuple[list[int], DraftAsk | None]:
        """Verify row i's drafts with its pass's logits (Lw, V) and commit. ``feats`` (Lw, n * d): the target
        features of the pass's columns, with a drafter; ``raw``: the logits before the ban (raw log-probabilities
        asked). Returns the tokens committed and, unless the row finished, its ask for the next pass's drafts."""
        row = self.rows[i]
        cols = row.columns
        row.passes += 1
        c0 = cols.index(row.pending if row.pending >= 0 else len(row.prompt_ids) - 1)
        m = len(row.drafts)
        n = row.params.max_tokens
        a, new = self.verify(row, logits[c0 : c0 + m + 1])
        if m > len(self.drafted):
            self.drafted += [0] * (m - len(self.drafted))
            self.accepted += [0] * (m - len(self.accepted))
        for j in range(m):
            self.drafted[j] += 1
            self.accepted[j] += j < a
        if m:
            row.acceptance_lengths.append(a)
        self.proposer_for(row.params.draft_source).observe(row, a)
        hit = next((j for j, t in enumerate(new) if t in row.end_ids), None)
        if row.params.early_exit and hit is not None:
            new = new[: hit + 1]
            row.hit_eos = True
        if row.params.logprobs is not None:  # token j was chosen from the next-token logits at column c0 + j
            row.new_logprobs = row_logprobs(row, logits if raw is None else raw, c0, new, self.logprobs_mode)
        if feats is not None:  # the accepted columns (the prompt's, or pending and d_1 .. d_a) enter the drafter
            self.proposer.queue(row.draft_state, feats[: c0 + a + 1])
        base = len(row.prompt_ids) + len(row.answer)  # column of the first new token
        self.tokens[i, base : base + len(new)] = torch.tensor(new, device=self.device)
        row.answer.extend(new)
        if row.history is not None and row.counting:  # up to its first end id (``answer_counts``)
            text = new[: hit] if hit is not None else new
            row.history.add(text)
            row.counting = hit is None
        if row.constraint is not None and row.constraint.stopped:  # the grammar allows nothing more
            row.hit_eos = True
        if len(row.answer) >= n or row.hit_eos:
            row.finished = True
            return new, None
        # the slots drafted pending + 1 .. when every draft held (they saw the accepted prefix)
        s = cols.index(row.slot_start) if a == m and row.num_slots else None
        slot_logits = None if s is None else logits[s : s + row.num_slots]
        return new, DraftAsk(i, row, new[-1], base + len(new) - 1, logits.shape[-1], slot_logits)

    def _propose(self, asks: list[DraftAsk]) -> None:
        """The next drafts of every asking row, one proposer call per ``draft_source``, and the next passes' layout:
        pending (the last committed token, whose keys/values the next pass computes), the drafts, the mask slots."""
        by_source: dict[str, list[DraftAsk]] = {}
        for ask in asks:
            by_source.setdefault(ask.row.params.draft_source, []).append(ask)
        for source, group in by_source.items():
            for ask, drafts in zip(group, self.proposer_for(source).propose(group), strict=True):
                self._lay_out(ask, drafts)

    def _lay_out(self, ask: DraftAsk, drafts: Drafts) -> None:
        """Write a row's drafts and mask slots after its pending token (its columns of the next pass)."""
        i, row, pending = ask.index, ask.row, ask.pending
        row.drafts, row.draft_probs = drafts.tokens, drafts.probs
        if row.draft_state is not None:
            row.draft_state.from_drafter = drafts.from_drafter
        self.tokens[i, pending + 1 : pending + 1 + len(row.drafts)] = torch.tensor(row.drafts, dtype=torch.long,
                                                                                   device=self.device)
        row.pending, row.slot_start = pending, pending + 1 + len(row.drafts)
        row.num_slots = drafts.slots
        self.tokens[i, row.slot_start : row.slot_start + row.num_slots] = self.model.config.mask_token_id


@torch.no_grad()
def generate_verified(
    model: torch.nn.Module,
    prompt_ids: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    grammar_tokenizer: object | None = None,
) -> VerifiedOutput:
    """Verified decoding of up to ``max_tokens`` tokens per prompt, all rows in one batch.

    Args:
        model: a hybrid Celeris model (causal, ``draft_block_size`` = k > 0).
        prompt_ids: B non-empty prompts.
        params: one SamplingParams for all rows or one per row (temperature, top_p, seed, max_tokens and
            early_exit and grammar are used; rows may differ in each).
        grammar_tokenizer: llguidance's tokenizer (``celeris.structured.grammar_tokenizer``), needed when a row
            has a ``grammar``: its drafts are then checked against the grammar-masked head
            (``verify_under_grammar``), and it ends where the grammar ends.

    Returns:
        VerifiedOutput; a row stops at its first end-of-text token (``early_exit``) or ``max_tokens``.

    Raises:
        ValueError: the model cannot draft, a prompt is empty, a setting is unsupported
            (``check_verified_support``), or a grammar comes without ``grammar_tokenizer``.
    """
    start = time.perf_counter()
    rows = params if isinstance(params, list) else [params] * len(prompt_ids)
    for r in rows:
        check_verified_support(model, r)
    dec = VerifiedDecoder(model, len(prompt_ids), max(len(p) + r.max_tokens for p, r in zip(
        prompt_ids, rows, strict=True)))
    constraints = row_constraints(rows, grammar_tokenizer)
    handles = [dec.add(p, r, constraint=c) for p, r, c in zip(prompt_ids, rows, constraints, strict=True)]
    ttft_s = None  # every row commits its first token in the first step (its prefill)
    while dec.rows:
        for row, _ in dec.step():
            if row.finished:
                dec.remove(row)
        ttft_s = ttft_s or time.perf_counter() - start
    eos = model.config.eos_token_id
    token_ids = [h.answer[: h.answer.index(eos)] if eos in h.answer else h.answer for h in handles]
    return VerifiedOutput(token_ids=token_ids, nfe=dec.nfe, row_passes=[h.passes for h in handles],
                          drafted=dec.drafted, accepted=dec.accepted, ttft_s=[ttft_s] * len(handles),
                          seconds=time.perf_counter() - start)
