"""The engine's KV memory: ``KVStore`` (the one allocation every mode path takes rows from, as a ``KVSegment``;
why rows, its docstring), ``KVPool`` (the masked and block paths' rows: one per running request) and
``PrefixCache`` (keys/values of prompt prefixes, reused across requests).

Automatic prefix caching for causal prefill (``PrefixCache``): a causal model's keys and values at column c depend
only on the tokens at columns <= c (and on c itself, the RoPE position), so a prompt that starts with tokens another
prompt already prefilled can copy their keys/values and prefill only the rest. As vLLM's automatic prefix caching
(Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention", SOSP 2023; vLLM
docs "Automatic Prefix Caching"), prompts are cut into blocks of ``BLOCK_SIZE`` tokens and a block is keyed by every
token up to its end, so a hit on block j implies the whole prefix up to it matches. Keys here are the token tuples
themselves (exact: no hash collision can give a wrong hit). The cache is bounded by a number of tokens and evicts
the least recently used block first; a hit refreshes its blocks deepest first, so a prefix's first blocks are
evicted after its later ones.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from celeris.engine.request import Request
from celeris.models.layers import KVCache, zeros_on_demand
from celeris.sampling.drafter import proposer_of
from celeris.sampling.verified import MAX_DRAFTS

ROW_SLACK = 2 * MAX_DRAFTS + 2  # columns past max_model_len a verified pass's drafts and mask slots may write
PREFIX_CACHE_TOKENS = 16384  # default bound of the prefix cache, prompt tokens
BLOCK_SIZE = 16  # tokens per cached block (vLLM's default block size)


class PrefixCache:
    """Keys/values of full prompt blocks, LRU-bounded by ``max_tokens``.

    A block is stored as one tensor (2 * num_layers, H, ``BLOCK_SIZE``, D): the layers' keys, then their values.

    Attributes:
        query_tokens: prompt tokens looked up (each prompt's whole length), vLLM's ``prefix_cache_queries``.
        hit_tokens: of those, tokens whose keys/values came from the cache, vLLM's ``prefix_cache_hits``.
    """

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < BLOCK_SIZE:
            raise ValueError(f"a prefix cache needs room for at least one block ({BLOCK_SIZE} tokens), got {max_tokens}")
        self.max_blocks = max_tokens // BLOCK_SIZE
        self.blocks: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        self.query_tokens = 0
        self.hit_tokens = 0

    def lookup(self, prompt_ids: list[int], max_tokens: int | None = None) -> tuple[int, torch.Tensor | None]:
        """The longest cached prefix of ``prompt_ids`` that leaves at least its last token to compute.

        Args:
            prompt_ids: the prompt's token ids.
            max_tokens: take at most this many tokens (the caller can use no more: the verified decoder with a
                drafter reuses only as far as its feature cache reaches); None: no bound.

        Returns:
            (n, kv): n cached tokens (a multiple of ``BLOCK_SIZE``, < len(prompt_ids)) and their keys/values
            (2 * num_layers, H, n, D), or (0, None) on a miss. Counts the query and the n tokens it serves.
        """
        found: list[tuple[int, ...]] = []
        # never the last prompt token: the first pass needs its logits, so it must be computed
        stop = len(prompt_ids) if max_tokens is None else min(len(prompt_ids), max_tokens + 1)
        for end in range(BLOCK_SIZE, stop, BLOCK_SIZE):
            key = tuple(prompt_ids[:end])
            if key not in self.blocks:
                break
            found.append(key)
        self.query_tokens += len(prompt_ids)
        if not found:
            return 0, None
        for key in reversed(found):  # deepest first: the first blocks end up the most recently used
            self.blocks.move_to_end(key)
        n = len(found) * BLOCK_SIZE
        self.hit_tokens += n
        return n, torch.cat([self.blocks[key] for key in found], dim=2)  # (2 * layers, H, n, D)

    def clear(self) -> None:
        """Drop every stored block (the counters stay: they count lookups since the cache was made)."""
        self.blocks.clear()

    def insert_row(self, prompt_ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor], row: int,
                   start: int, end: int) -> None:
        """``insert`` the blocks of columns [start, end) of ``prompt_ids`` (multiples of ``BLOCK_SIZE``) from row
        ``row`` of a cache's per-layer ``keys``/``values`` (rows, H, T, D), stacked in this cache's layout."""
        kv = torch.stack([t[row, :, start:end] for t in (*keys, *values)])  # (2 * layers, H, end - start, D)
        self.insert(prompt_ids[:end], kv, start)

    def insert(self, prompt_ids: list[int], kv: torch.Tensor, start: int = 0) -> None:
        """Store the full blocks of ``prompt_ids`` from column ``start`` on (a multiple of ``BLOCK_SIZE``).

        ``kv`` (2 * num_layers, H, n, D): the row's keys/values at columns start, start + 1, ... up to at least
        the prompt's last full block's end (each stored block is a copy). Evicts the least recently
        used blocks past the bound (a prompt's earlier blocks, stored or refreshed last, go last).
        """
        keys = [tuple(prompt_ids[:end]) for end in range(start + BLOCK_SIZE, len(prompt_ids) + 1, BLOCK_SIZE)]
        for key in reversed(keys):  # deepest first, as in ``lookup``
            if key not in self.blocks:
                end = len(key)
                self.blocks[key] = kv[:, :, end - BLOCK_SIZE - start : end - start].clone()  # (2 * layers, H, BLOCK_SIZE, D)
            self.blocks.move_to_end(key)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)


Row = tuple[Request, str]  # (request, "cond" | "uncond"): a CFG request owns an unconditional row too


class KVStoreFullError(RuntimeError):
    """The KV store has no free row for a request's keys/values (the scheduler's ``kv_rows`` budget prevents it)."""


class KVSegment:
    """The rows of one ``KVStore`` that one mode path holds: rows [start, start + num_rows) of the store, always
    contiguous, so a pass reads and writes them as one view. The path keeps its live rows at [0, num_rows) of the
    segment (it moves its last row into a freed one, then ``shrink``s) and asks ``grow`` for more."""

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.start = 0
        self.num_rows = 0
        self._views: dict[str, tuple[list[torch.Tensor], int, int, list[torch.Tensor]]] = {}

    def _rows(self, name: str) -> list[torch.Tensor]:
        """The segment's rows of each tensor of the store's list ``name``, as views, made again only when the rows
        or the store's list changed (a pass asks for them several times, 30-odd slices each time)."""
        tensors = getattr(self.store, name)
        made = self._views.get(name)
        if made is not None and made[0] is tensors and made[1:3] == (self.start, self.num_rows) \
                and len(made[3]) == len(tensors):
            return list(made[3])  # a list of its own: a caller may clear or extend it (a KVCache over it)
        views = [t[self.start : self.start + self.num_rows] for t in tensors]
        self._views[name] = (tensors, self.start, self.num_rows, views)
        return list(views)

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per layer the segment's rows of the store, (num_rows, H_kv, row_len, D) views ([] before allocation)."""
        return self._rows("keys")

    @property
    def values(self) -> list[torch.Tensor]:
        """Per layer the segment's rows of the store's values, as ``keys``."""
        return self._rows("values")

    @property
    def draft_keys(self) -> list[torch.Tensor]:
        """Per drafter layer the segment's rows of the store's drafter keys, (num_rows, H_kv', draft_len, D')
        views ([] without a drafter)."""
        return self._rows("draft_keys")

    @property
    def draft_values(self) -> list[torch.Tensor]:
        """Per drafter layer the segment's rows of the store's drafter values, as ``draft_keys``."""
        return self._rows("draft_values")

    @property
    def layers(self) -> list[torch.Tensor]:
        """Every tensor of the segment's rows: the target's keys and values, then the drafter's (what moves with a
        row)."""
        return [*self.keys, *self.values, *self.draft_keys, *self.draft_values]

    def grow(self, n: int = 1) -> None:
        """Take ``n`` more rows (at the segment's end); the store allocates itself at the first rows taken.

        Raises:
            KVStoreFullError: fewer than ``n`` rows are free.
        """
        self.store.grow(self, n)

    def shrink(self, n: int = 1) -> None:
        """Give the segment's last ``n`` rows back to the store (their contents are left as they are)."""
        if not 0 <= n <= self.num_rows:
            raise ValueError(f"cannot give back {n} of a segment's {self.num_rows} rows")
        self.num_rows -= n


class KVStore:
    """The engine's one KV allocation: per layer a keys and a values tensor (num_rows, H_kv, row_len, D), H_kv the
    model's key/value heads (before grouped-query sharing), in the model's dtype on its device; sized once (rows:
    ``EngineConfig.max_num_seqs``; row_len: ``max_model_len`` plus ``ROW_SLACK`` columns a verified pass may write
    past the answer) and allocated, zeros, at the first rows a path takes (on a CPU the zeros are pages the
    OS maps on first write, ``zeros_on_demand``: resident memory grows with the columns rows hold, not
    ``row_len``). Every mode path takes rows from it as a ``KVSegment`` and gives them back when its requests finish.

    Rows, not pages: every pass of every mode (the masked window pass, the block pass, the verified pass) reads a
    dense (R, H_kv, T, D) cache in place, with per-row column windows, and writes its new columns into it; a row per
    request gives each path its rows as one view, with no per-pass gather (a paged store would need one, or a paged
    attention kernel the eager and compiled runners do not have). The price is a row of ``row_len`` columns per
    request whatever its length: the bound the loader's memory check counts (``kv_cache_bytes``). A path's rows
    stay contiguous: a segment that needs a row and has no free row right after it gets one by packing the
    segments (each row that moves is copied once, whole, order kept: at most ``num_rows`` row copies, at a
    request's admission, about the cost of one pass over the store's rows); giving a row back copies nothing, so
    the free rows may sit between segments until the next packing.

    A DFlash drafter beside the model (``celeris.sampling.drafter``) keeps per request the keys/values of its
    context features (``celeris.models.dflash.DraftKVCache``); the store holds them too: with a drafter, every row
    also has the drafter's layers (``draft_keys``/``draft_values``: per drafter layer (num_rows, its K/V heads,
    ``draft_len``, its head_dim), in its compute dtype), so a verified row holds the target's and the drafter's
    keys/values in the same row index, moved and given back together, and ``nbytes`` counts both. Those columns are
    the row's own: a masked or block row leaves them unused (the store is sized once, for every row alike).

    Args:
        model: the model whose keys/values it holds (``arch.num_kv_heads``, ``arch.head_dim``, ``layers``; the
            dtype and device of its first floating-point parameter); read at allocation.
        num_rows: rows in all (the most requests holding keys/values at once; a CFG request takes two).
        row_len: columns per row (None: unknown, and any row taken raises).
        drafter: a DFlash drafter (``DFlashDraftModel``) whose layers every row holds too; None: the drafter of
            the proposer attached to ``model`` at allocation (``proposer_of``), if any.
        prefix_cache_tokens: bound of the engine's one ``PrefixCache`` (``prefix_cache``), prompt tokens; 0: none.
            Every path whose prefill is causal and exact reads and fills it (the verified path, the masked path's
            causal decoding under the ``delayed`` cache), so a prompt prefilled by one mode serves the others.
    """

    def __init__(self, model: torch.nn.Module, num_rows: int, row_len: int | None,
                 drafter: torch.nn.Module | None = None, prefix_cache_tokens: int = 0) -> None:
        self.model, self.num_rows, self.row_len, self.drafter = model, num_rows, row_len, drafter
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.draft_keys: list[torch.Tensor] = []
        self.draft_values: list[torch.Tensor] = []
        self.segments: list[KVSegment] = []

    def segment(self) -> KVSegment:
        """A new, empty segment for one path, after the existing ones."""
        segment = KVSegment(self)
        segment.start = self.segments[-1].start + self.segments[-1].num_rows if self.segments else 0
        self.segments.append(segment)
        return segment

    @property
    def num_free_rows(self) -> int:
        return self.num_rows - sum(s.num_rows for s in self.segments)

    @property
    def layers(self) -> list[torch.Tensor]:
        """Every tensor of the store: the target's keys and values, then the drafter's ([] before allocation)."""
        return [*self.keys, *self.values, *self.draft_keys, *self.draft_values]

    @property
    def nbytes(self) -> int:
        """Bytes the store holds: 0 before its first row is taken, then its whole allocation (the drafter's
        layers included)."""
        return sum(t.numel() * t.element_size() for t in self.layers)

    @property
    def draft_len(self) -> int | None:
        """Columns per row of the drafter's layers: ``row_len``, plus what a drafter block longer than the
        ``ROW_SLACK`` columns needs (a block starts at most at the row's last answer column and writes
        ``block_size`` columns); None before a drafter is known or with no ``row_len``."""
        if self.drafter is None or self.row_len is None:
            return None
        return self.row_len + max(0, self.drafter.config.block_size - ROW_SLACK)

    def _like(self) -> torch.Tensor:
        """The model's first floating-point parameter: the activations' dtype and device (a quantized layer's
        codes are integers)."""
        return next(t for t in (*self.model.parameters(), *self.model.buffers()) if t.is_floating_point())

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the keys/values it holds (the model's activations')."""
        return self.keys[0].dtype if self.keys else self._like().dtype

    def _allocate(self) -> None:
        if self.row_len is None:
            raise KVStoreFullError("the KV store has no row length: give the engine a max_model_len")
        arch, p = self.model.arch, self._like()
        shape = (self.num_rows, arch.num_kv_heads, self.row_len, arch.head_dim)  # K/V heads, not the query heads
        self.keys = [zeros_on_demand(shape, p.dtype, p.device) for _ in self.model.layers]  # resident as written
        self.values = [zeros_on_demand(shape, p.dtype, p.device) for _ in self.model.layers]
        if self.drafter is None and (proposer := proposer_of(self.model)) is not None:
            self.drafter = proposer.drafter
        if self.drafter is not None:
            self.draft_keys, self.draft_values = self.drafter.cache_buffers(self.num_rows, self.draft_len)

    def grow(self, segment: KVSegment, n: int) -> None:
        """Give ``segment`` ``n`` more rows at its end, moving the segments after it when it has none free there
        (``KVSegment.grow``)."""
        if n > self.num_free_rows:
            raise KVStoreFullError(f"the KV store's {self.num_rows} rows are all taken (max_num_seqs rows; a CFG "
                                   f"request with a cache takes two)")
        if not self.keys:
            self._allocate()
        i = self.segments.index(segment)
        end = self.segments[i + 1].start if i + 1 < len(self.segments) else self.num_rows
        if segment.start + segment.num_rows + n > end:  # pack every segment, this one n rows longer
            starts, at = [], 0
            for s in self.segments:
                starts.append(at)
                at += s.num_rows + (n if s is segment else 0)
            self._move(starts)
        segment.num_rows += n

    def _move(self, starts: list[int]) -> None:
        """Move each segment's rows to start at ``starts`` (same order): those moving left first, front to back,
        then those moving right, back to front, so no row is overwritten before it is copied."""
        order = [s for s in self.segments if starts[self.segments.index(s)] < s.start]
        order += [s for s in reversed(self.segments) if starts[self.segments.index(s)] > s.start]
        for segment in order:
            new = starts[self.segments.index(segment)]
            rows = range(segment.num_rows) if new < segment.start else reversed(range(segment.num_rows))
            for r in rows:
                for t in self.layers:
                    t[new + r] = t[segment.start + r]
            segment.start = new


class KVPool:
    """Keys/values of the running requests of one path, one row per request (plus one for a CFG request's
    unconditional row), in a ``KVSegment`` of the engine's ``KVStore``.

    Row r holds its canvas's keys/values at columns [0, n_r) (left-aligned, so RoPE positions equal columns); the
    columns after n_r are masked. A row is taken when the request's first full pass stores its cache (or at its
    first step, when it copies a prefix-cache hit in), rewritten by later full passes (refreshes), updated in place
    by window passes, and given back when the request leaves by moving the last live row into the hole. So the live
    rows are always [0, R): one contiguous view that a window pass reads and writes in place, with no per-step
    copying (the paged/slot cache of vLLM, in its simplest form).
    A pass sees the first ``capacity_length`` columns: the longest canvas stored since the pool was last empty,
    rounded up to ``col_block`` (so passes keep few shapes), at most the store's ``row_len``.
    """

    def __init__(self, store: KVStore, col_block: int = 64) -> None:
        self.segment = store.segment()
        self.col_block = col_block
        self.capacity_length = 0
        self.owners: list[Row] = []
        self._index: dict[Row, int] = {}
        self._views: dict[str, tuple[int, list[torch.Tensor], list[torch.Tensor]]] = {}

    @property
    def num_rows(self) -> int:
        return len(self.owners)

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per layer (R, H_kv, capacity_length, D) views of the live rows' keys ([] with no live row)."""
        return self._columns("keys")

    @property
    def values(self) -> list[torch.Tensor]:
        """Per layer the live rows' values, as ``keys``."""
        return self._columns("values")

    def _columns(self, name: str) -> list[torch.Tensor]:
        """The first ``capacity_length`` columns of the segment's rows of ``name``, as views made again only when
        the rows or the length changed (a step asks for them each pass: 30-odd slices a time)."""
        if not self.owners:
            return []
        rows = getattr(self.segment, name)  # the segment's own cache of row views: the same objects until they move
        made = self._views.get(name)
        if made is not None and made[0] == self.capacity_length and len(made[1]) == len(rows) \
                and all(a is b for a, b in zip(made[1], rows, strict=True)):
            return list(made[2])
        views = [t[:, :, : self.capacity_length] for t in rows]
        self._views[name] = (self.capacity_length, rows, views)
        return list(views)

    @property
    def nbytes(self) -> int:
        """Bytes of the store's rows this pool holds now (0 when it holds none)."""
        store = self.segment.store
        return store.nbytes * self.segment.num_rows // store.num_rows

    def row(self, request: Request, kind: str = "cond") -> int | None:
        return self._index.get((request, kind))

    def store(self, request: Request, kind: str, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Write a full pass's keys/values for one row: per layer (H_kv, n, D), n = the request's canvas length.

        Raises:
            ValueError: n exceeds the store's row length (``max_model_len`` + ``ROW_SLACK``).
            KVStoreFullError: a new row and no free row in the store.
            TypeError: the keys' dtype is not the store's.
        """
        n = keys[0].shape[1]
        row_len = self.segment.store.row_len
        if row_len is not None and n > row_len:
            raise ValueError(f"a canvas of {n} tokens does not fit the KV store's rows of {row_len} tokens; "
                             f"raise max_model_len")
        if self.segment.store.dtype != keys[0].dtype:  # never a silent cast of the keys/values
            raise TypeError(f"keys of dtype {keys[0].dtype} for a KV store of {self.segment.store.dtype}")
        row = self.reserve(request, kind, n)
        for layer, (k, v) in enumerate(zip(self.segment.keys, self.segment.values, strict=True)):
            k[row, :, :n] = keys[layer]
            v[row, :, :n] = values[layer]

    def reserve(self, request: Request, kind: str, n: int) -> int:
        """The request's row (taken from the store when it has none, its contents left as they are) with passes
        seeing at least ``n`` columns; a chunked prefill fills it column by column. Returns the row.

        Raises:
            KVStoreFullError: a new row and no free row in the store.
        """
        row = self._index.get((request, kind))
        if row is None:
            self.segment.grow(1)
            row = len(self.owners)
            self.owners.append((request, kind))
            self._index[(request, kind)] = row
        row_len = self.segment.store.row_len
        grown = -(-max(n, self.capacity_length) // self.col_block) * self.col_block
        self.capacity_length = grown if row_len is None else min(grown, row_len)
        return row

    def release(self, keep: set[Request]) -> None:
        """Give back the rows of requests not in ``keep`` (finished or aborted) to the store."""
        row = 0
        while row < self.num_rows:
            if self.owners[row][0] in keep:
                row += 1
                continue
            del self._index[self.owners[row]]
            last = self.num_rows - 1
            if row != last:  # move the last live row into the hole: the columns passes see, not the whole row
                for t in (*self.segment.keys, *self.segment.values):
                    t[row, :, : self.capacity_length] = t[last, :, : self.capacity_length]
                self.owners[row] = self.owners[last]
                self._index[self.owners[row]] = row
            self.owners.pop()
            self.segment.shrink(1)
        if not self.owners:  # passes start again from the shortest shape
            self.capacity_length = 0

    def view(self) -> KVCache:
        """The live rows as a KVCache of (R, H_kv, capacity T, D) views (no copy)."""
        return KVCache(self.keys, self.values)
