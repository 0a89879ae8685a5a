"""The decoding contract of a block-diffusion checkpoint, as data, and the attention layouts it names.

A block-diffusion model (BD3-LM arXiv:2503.09573; SDAR arXiv:2510.06303; Fast-dLLM v2 arXiv:2509.26328)
denoises one block of ``block_size`` tokens at a time; the block's queries attend bidirectionally to their
own block and to the committed history, so the history's keys/values never change once written (an exact
KV cache, as in autoregressive decoding). What an engine must know to decode such a checkpoint, and what
most published folders do not write into their ``config.json`` (engines keep per-architecture tables:
SGLang's ``dllm/config.py``, LMDeploy's ``dllm_*`` engine settings, JetEngine's ``LLM(block_length=...)``):

- ``block_size``: the trained block (attention unit); it never changes at inference. ``block_length`` (a
  request setting) is the denoising sub-block and must divide it (Fast-dLLM v2 decodes 8-token sub-blocks of
  its 32-token blocks; it reports a quality drop when the inference block itself changes).
- ``mask_token``: the mask token's string (its id comes from ``config.json``, the tokenizer files, or this
  string looked up in ``tokenizer.json``; ``mask_token_id`` is the published id, for the record).
- ``logits_shift``: 1 when the hidden state at i scores token i + 1 (the autoregressive habit kept by
  Fast-dLLM v2 and Dream), 0 when it scores token i (SDAR, LLaDA2.0).
- ``attention``: ``full`` (bidirectional over everything: LLaDA, Dream), ``block_causal`` (query block b
  sees key blocks <= b; SDAR, Fast-dLLM v2, LLaDA2.0) or ``causal_history`` (committed tokens are
  token-causal among themselves, the current block bidirectional over itself and the history).
- ``alignment``: where blocks start: ``absolute`` = multiples of ``block_size`` from position 0, so the
  prompt's last partial block is denoised together with the first answer tokens (SDAR's ``generate.py``,
  Fast-dLLM v2's ``generate``, LLaDA2.0's sampler); ``answer`` = from the answer's first position (the
  prompt is history).
- ``commit_first``: the first position of each block is committed alone, before the block is denoised, from the
  history's next-token prediction (Fast-dLLM v2's ``generate`` appends ``argmax`` of the finished block's
  last logits before denoising the next block; with shifted logits that is the block's first position), in a
  pass of its own that also writes the finished block's keys/values (``celeris.sampling.block.first_token_pending``).
  Needs ``logits_shift`` 1.
- ``steps_within_answer``: ``steps`` are capped at the answer length, as LLaDA2.0's ``generate`` does
  (``steps = min(steps, gen_length // minimal_topk)``; ``celeris.sampling.block.block_steps``).
- ``defaults``: default decoding settings (``SamplingParams`` fields), under the folder's own
  ``generation_config.json``.

The published values (``CONTRACTS``) and where each was read are in ``FORMATS.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer

from celeris.tokenizer import tokenizer_file_ids

ATTENTION_LAYOUTS = ("full", "block_causal", "causal_history")
ALIGNMENTS = ("absolute", "answer")


@dataclass(frozen=True)
class DecodingContract:
    """How a block-diffusion checkpoint must be decoded (see the module docstring for each field)."""

    block_size: int
    mask_token: str
    mask_token_id: int | None
    logits_shift: int
    attention: str
    alignment: str = "absolute"
    commit_first: bool = False
    steps_within_answer: bool = False
    defaults: dict = field(default_factory=dict)
    source: str = ""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.attention not in ATTENTION_LAYOUTS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_LAYOUTS)}; got '{self.attention}'")
        if self.alignment not in ALIGNMENTS:
            raise ValueError(f"alignment must be one of {', '.join(ALIGNMENTS)}; got '{self.alignment}'")
        if self.commit_first and self.logits_shift != 1:
            raise ValueError("commit_first needs logits_shift 1: the history's last hidden state scores a block's "
                             "first position")

    def with_block_size(self, block_size: int | None) -> DecodingContract:
        """This contract with the block size a config states (None: unchanged). The default ``block_length``
        always fits it: one that named the old block size follows it, one that no longer divides it becomes the
        largest divisor of the new size below it (Fast-dLLM v2's 8-token sub-block of a ``bd_size`` 4 folder:
        4); default ``steps`` equal to the old ``block_length`` follow the new one, others are capped by it."""
        if block_size is None or block_size == self.block_size:
            return self
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        defaults = dict(self.defaults)
        old = defaults.get("block_length")
        if old is not None:
            new = block_size if old == self.block_size else max(d for d in range(1, min(old, block_size) + 1)
                                                                 if block_size % d == 0)
            defaults["block_length"] = new
            if "steps" in defaults:
                defaults["steps"] = new if defaults["steps"] == old else min(defaults["steps"], new)
        return replace(self, block_size=block_size, defaults=defaults)


# Published block-diffusion families that do not (all) state their contract in config.json. Sources: FORMATS.md.
CONTRACTS: dict[str, DecodingContract] = {
    "sdar": DecodingContract(
        block_size=4, mask_token="<|MASK|>", mask_token_id=151669, logits_shift=0, attention="block_causal",
        defaults={"block_length": 4, "steps": 4, "decoding": "low_confidence_dynamic", "threshold": 0.9,
                  "max_tokens": 256},
        source="JetAstra/SDAR README and generate.py (block_length 4, denoising_steps 4, low_confidence_dynamic, "
               "threshold 0.9, mask 151669); arXiv:2510.06303",
    ),
    "fast_dllm_v2": DecodingContract(
        block_size=32, mask_token="|<MASK>|", mask_token_id=151665, logits_shift=1, attention="block_causal",
        commit_first=True,
        defaults={"block_length": 8, "steps": 8, "decoding": "threshold", "threshold": 0.9, "max_tokens": 256},
        source="NVlabs/Fast-dLLM v2 modeling (generate: bd_size 32, small_block_size 8, threshold rule, mask "
               "151665, shifted logits, eval_block_diff_mask block_q >= block_kv); arXiv:2509.26328",
    ),
    "llada2": DecodingContract(
        block_size=32, mask_token="<|mask|>", mask_token_id=156895, logits_shift=0, attention="block_causal",
        steps_within_answer=True,
        defaults={"block_length": 32, "steps": 32, "decoding": "low_confidence_dynamic", "threshold": 0.95,
                  "max_tokens": 256},
        source="modeling_llada2_moe.py generate (block_length 32, steps 32, threshold 0.95 else the static count, "
               "mask 156895, eos 156892, tril block mask); SGLang dllm/config.py; arXiv:2512.15745",
    ),
}


def hybrid_contract(block_size: int, mask_token_id: int) -> DecodingContract:
    """The contract of a Celeris hybrid model (``draft_block_size`` > 0, ``is_causal``; ``celeris train --objective
    hybrid``), read from its training layout (``celeris.train.objective.hybrid_attention_mask``): blocks of
    ``draft_block_size`` at multiples of it from position 0, a token-causal clean history (``causal_history``),
    shifted logits (the hidden state at p scores token p + 1), so a block's first token is the exact next-token
    prediction of the history, which ``commit_first`` commits before the block is denoised."""
    return DecodingContract(block_size=block_size, mask_token="<|mask|>", mask_token_id=mask_token_id,
                            logits_shift=1, attention="causal_history", alignment="absolute", commit_first=True,
                            source="celeris.train.objective.hybrid_attention_mask / hybrid_loss")


def block_index(cols: torch.Tensor, origin: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block number of canvas columns ``cols`` (B, L) int64: ``(c - origin) // block_size`` for c >= origin,
    -1 before ``origin`` (B,) (the prompt under ``answer`` alignment: one block of history)."""
    rel = cols - origin[:, None]
    return torch.where(rel >= 0, torch.div(rel, block_size, rounding_mode="floor"), torch.full_like(rel, -1))


def layout_mask(
    query_cols: torch.Tensor,
    num_keys: int,
    block_start: torch.Tensor,
    block_end: torch.Tensor,
    origin: torch.Tensor,
    block_size: int,
    attention: str,
) -> torch.Tensor:
    """Which keys each query may attend to at inference, for a canvas whose current block is
    [block_start, block_end) (committed history before it, nothing after it is attended).

    Args:
        query_cols: (B, Lq) int64 canvas columns of the queries a pass computes (history columns being written
            and the current block's columns).
        num_keys: T, the key columns (cache width).
        block_start / block_end / origin: (B,) int64 per row: the current block and the alignment origin
            (0 for ``absolute`` alignment, the answer's first column for ``answer``).
        block_size: the trained block size.
        attention: ``block_causal`` or ``causal_history``.

    Returns:
        (B, 1, Lq, T) bool: a current-block query sees every key before ``block_end``; a history query sees
        keys of blocks <= its own (``block_causal``) or keys <= itself (``causal_history``).
    """
    keys = torch.arange(num_keys, device=query_cols.device)[None, :].expand(query_cols.shape[0], -1)  # (B, T)
    q = query_cols[:, :, None]  # (B, Lq, 1)
    current = keys[:, None, :] < block_end[:, None, None]  # (B, 1, T)
    if attention == "causal_history":
        history = keys[:, None, :] <= q
    else:
        qb = block_index(query_cols, origin, block_size)[:, :, None]  # (B, Lq, 1)
        kb = block_index(keys, origin, block_size)[:, None, :]  # (B, 1, T)
        history = kb <= qb
    in_block = q >= block_start[:, None, None]  # (B, Lq, 1)
    return torch.where(in_block, current, history)[:, None]  # (B, 1, Lq, T)


def noisy_clean_mask(length: int, block_size: int, attention: str) -> torch.Tensor:
    """BD3-LM's vectorised training layout (arXiv:2503.09573, Sec. 3.2): the input is the noisy copy x_t
    followed by the clean copy x_0 (2L positions, both copies at RoPE positions 0..L-1).

    A noisy query of block b sees its own noisy block (bidirectional) and clean blocks < b; a clean query sees
    clean keys by the layout: blocks <= its own (``block_causal``; Fast-dLLM v2's ``block_diff_mask``) or
    positions <= its own (``causal_history``). Returns (2L, 2L) bool (query, key).
    """
    pos = torch.arange(length)
    qb, kb = (pos // block_size)[:, None], (pos // block_size)[None, :]
    noisy_noisy = qb == kb
    noisy_clean = kb < qb
    clean_clean = kb <= qb if attention == "block_causal" else pos[None, :] <= pos[:, None]
    top = torch.cat([noisy_noisy, noisy_clean], dim=1)
    bottom = torch.cat([torch.zeros(length, length, dtype=torch.bool), clean_clean], dim=1)
    return torch.cat([top, bottom], dim=0)


def contract_special_ids(raw: dict, folder: Path, contract: DecodingContract) -> dict:
    """``raw`` (a config.json dict) with ``mask_token_id`` filled in where the folder does not state it: from
    tokenizer_config.json's ``mask_token``, else the contract's mask token string looked up in tokenizer.json,
    else the contract's published id
    (``celeris.tokenizer.special_token_ids`` then reads the other ids)."""
    raw = dict(raw)
    if raw.get("mask_token_id") is None:
        found = tokenizer_file_ids(folder).get("mask")
        if found is None and (folder / "tokenizer.json").is_file():
            found = HFTokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(contract.mask_token)
        raw["mask_token_id"] = found if found is not None else contract.mask_token_id
    return raw
