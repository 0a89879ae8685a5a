"""The engine's KV memory: ``KVPool`` (the running requests' keys/values, one row each) and ``PrefixCache``
(keys/values of prompt prefixes, reused across requests).

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
from celeris.models.layers import KVCache

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

    def lookup(self, prompt_ids: list[int]) -> tuple[int, torch.Tensor | None]:
        """The longest cached prefix of ``prompt_ids`` that leaves at least its last token to compute.

        Returns:
            (n, kv): n cached tokens (a multiple of ``BLOCK_SIZE``, < len(prompt_ids)) and their keys/values
            (2 * num_layers, H, n, D), or (0, None) on a miss. Counts the query and its hit tokens.
        """
        found: list[tuple[int, ...]] = []
        # never the last prompt token: the first pass needs its logits, so it must be computed
        for end in range(BLOCK_SIZE, len(prompt_ids), BLOCK_SIZE):
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


class KVPool:
    """Keys/values of the running requests that use a KV cache, one row per request
    (plus one for a CFG request's unconditional row).

    Per layer a (capacity rows, H_kv, capacity T, head_dim) tensor. Row r holds
    its canvas's keys/values at columns [0, n_r) (left-aligned, so RoPE positions
    equal columns); the columns after n_r are masked. A row is allocated when the
    request's first full pass stores its cache, rewritten by later full passes
    (refreshes), updated in place by window passes, and freed when the request
    leaves by moving the last live row into the hole. So the live rows are always
    [0, R): one contiguous view that a window pass reads and writes in place,
    with no per-step copying (the paged/slot cache of vLLM, in its simplest form).
    """

    def __init__(self, row_block: int = 8, col_block: int = 64) -> None:
        self.row_block, self.col_block = row_block, col_block
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.owners: list[Row] = []
        self._index: dict[Row, int] = {}

    @property
    def num_rows(self) -> int:
        return len(self.owners)

    @property
    def capacity_length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def nbytes(self) -> int:
        """Bytes of key/value storage the pool holds now (its capacity, live rows or not; 0 when empty)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def row(self, request: Request, kind: str = "cond") -> int | None:
        return self._index.get((request, kind))

    def store(self, request: Request, kind: str, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Write a full pass's keys/values for one row: per layer (H_kv, n, D), n = the request's canvas length."""
        n = keys[0].shape[1]
        row = self._index.get((request, kind))
        if row is None:
            row = len(self.owners)
            self.owners.append((request, kind))
            self._index[(request, kind)] = row
        self._reserve(len(self.owners), n, keys)
        for layer in range(len(keys)):
            self.keys[layer][row, :, :n] = keys[layer]
            self.values[layer][row, :, :n] = values[layer]

    def _reserve(self, rows: int, length: int, like: list[torch.Tensor]) -> None:
        """Grow the capacity (rounded up to blocks) to hold ``rows`` rows of ``length`` columns."""
        if self.keys and self.keys[0].shape[0] >= rows and self.capacity_length >= length:
            return
        old_rows = self.keys[0].shape[0] if self.keys else 0
        cap_rows = -(-max(rows, old_rows) // self.row_block) * self.row_block
        cap_len = -(-max(length, self.capacity_length) // self.col_block) * self.col_block
        live = min(self.num_rows, old_rows)
        for tensors in (self.keys, self.values):
            fresh = not tensors
            for layer, t in enumerate(like if fresh else list(tensors)):
                grown = t.new_zeros((cap_rows, t.shape[-3], cap_len, t.shape[-1]))
                if fresh:
                    tensors.append(grown)
                else:
                    grown[:live, :, : t.shape[2]] = t[:live]
                    tensors[layer] = grown

    def release(self, keep: set[Request]) -> None:
        """Free the rows of requests not in ``keep`` (finished or aborted); with no row left, the storage too."""
        row = 0
        while row < self.num_rows:
            if self.owners[row][0] in keep:
                row += 1
                continue
            del self._index[self.owners[row]]
            last = self.num_rows - 1
            if row != last:  # move the last live row into the hole
                for t in (*self.keys, *self.values):
                    t[row] = t[last]
                self.owners[row] = self.owners[last]
                self._index[self.owners[row]] = row
            self.owners.pop()
        if not self.owners:  # nothing live: give the memory back rather than keep the largest batch's capacity
            self.keys, self.values = [], []

    def view(self) -> KVCache:
        """The live rows as a KVCache of (R, H_kv, capacity T, D) views (no copy)."""
        r = self.num_rows
        return KVCache([k[:r] for k in self.keys], [v[:r] for v in self.values])
