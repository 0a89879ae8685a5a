"""Automatic prefix caching for causal prefill: keys/values of prompt prefixes, reused across requests.

A causal model's keys and values at column c depend only on the tokens at columns <= c (and on c itself, the RoPE
position), so a prompt that starts with tokens another prompt already prefilled can copy their keys/values and
prefill only the rest. As vLLM's automatic prefix caching (Kwon et al., "Efficient Memory Management for Large
Language Model Serving with PagedAttention", SOSP 2023; vLLM docs "Automatic Prefix Caching"), prompts are cut into
blocks of ``BLOCK_SIZE`` tokens and a block is keyed by every token up to its end, so a hit on block j implies the
whole prefix up to it matches. Keys here are the token tuples themselves (exact: no hash collision can give a
wrong hit). The cache is bounded by a number of tokens and evicts the least recently used block first; a hit
refreshes its blocks deepest first, so a prefix's first blocks are evicted after its later ones.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

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
