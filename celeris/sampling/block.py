"""Block diffusion: the rules shared by the engine's block path and the reference sampler.

A block-diffusion model (``model.block_contract``, ``celeris.models.contract``) denoises the answer one
attention block of ``block_size`` tokens at a time, left to right; the block's queries attend to the committed
history and bidirectionally to their own block, never to what follows (SDAR arXiv:2510.06303, Fast-dLLM v2
arXiv:2509.26328, BD3-LM arXiv:2503.09573). What the request settings mean here:

- blocks are aligned as the contract says (``absolute``: multiples of ``block_size`` from position 0, so the
  prompt's last partial block is denoised together with the first answer tokens);
- ``block_length`` is the denoising sub-block: it must divide ``block_size`` (else ValueError naming both);
  within an attention block the sub-blocks are denoised left to right (Fast-dLLM v2's ``small_block_size``),
  the whole attention block staying visible;
- the canvas is padded with mask tokens to a whole last block (``padded_length``), as the published samplers
  do: those columns are attended and denoised like the answer, then cut from it;
- ``steps`` counts denoising steps per sub-block (SDAR's and LMDeploy's ``denoising_steps``), at most
  ``block_length``; ``fixed``/``low_confidence_static``/``low_confidence_dynamic``/``sequential`` read the linear
  schedule of ``block_length`` tokens over those steps (``unit_schedule``: SDAR's and LLaDA2.0's
  ``get_num_transfer_tokens``), every other rule (``threshold``, ``factor``, ``entropy``) works per sub-block;
- under ``commit_first`` (Fast-dLLM v2, the Celeris hybrids) a block's first token is committed alone, from the
  history's next-token prediction, in a pass before the block is denoised (``first_token_pending``: Fast-dLLM
  v2's ``generate``); under ``steps_within_answer`` (LLaDA2.0) ``steps`` are capped at ``max_tokens``
  (``block_steps``);
- with ``early_exit`` the answer stops as soon as an end id is committed with every position before it filled
  (``end_reached``, Fast-dLLM v2), mid-block if need be: the same tokens as stopping after the block, fewer NFE;
- ``cache``, ``suffix_window``, a suffix (infilling), ``cfg_scale`` and ``verified`` do not apply and are
  refused naming the parameter (the history's KV cache is exact and always on in the engine).

The plain, slow, obviously correct reference is ``celeris.reference.block.generate_block``: every step
recomputes the whole canvas up to the current block's end with the layout mask, one row at a time. The engine's
block path (``celeris.engine.blocks``) must give the same tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import torch

from celeris.models.contract import DecodingContract
from celeris.sampling.params import SamplingParams
from celeris.sampling.rules import COMMIT_RULES
from celeris.sampling.schedule import num_transfer_tokens

Unit = tuple[int, int, int, int]
"""(attention block start, attention block end, sub-block start, sub-block end) canvas columns."""


def contract_of(model: torch.nn.Module) -> DecodingContract | None:
    """The model's block-diffusion contract, or None for a full-attention or causal model."""
    contract = getattr(model, "block_contract", None)
    return contract if isinstance(contract, DecodingContract) and contract.attention != "full" else None


def block_mode(model: torch.nn.Module, params: SamplingParams) -> DecodingContract | None:
    """The contract when ``params`` decode ``model`` by block diffusion, else None. A published block model
    (SDAR, Fast-dLLM v2) always does; a Celeris hybrid model (causal, ``draft_block_size`` > 0) does when the
    request asks for blocks (``block_length`` > 1) with a commit rule that denoises, not a ``decoding`` value that
    names a mode of its own (``verified``, a plug-in's: ``CommitRule.denoises`` False): with ``block_length`` 1 it
    decodes token by token as its autoregressive twin does."""
    contract = contract_of(model)
    if contract is None or not getattr(model.config, "is_causal", False):
        return contract
    return contract if COMMIT_RULES[params.decoding].denoises and params.block_length > 1 else None


DEFAULT_BLOCK_LENGTH: int = next(f.default for f in dataclasses.fields(SamplingParams) if f.name == "block_length")


def with_block_defaults(model: torch.nn.Module, params: SamplingParams) -> SamplingParams:
    """``params`` for a block-diffusion model: a ``block_length`` left at ``SamplingParams``' generic default (32,
    not given by the caller) that does not divide the model's block size takes the contract's default
    ``block_length`` (else the block size), so ``LLM(block_folder).generate(prompts, SamplingParams(max_tokens=8))``
    decodes with the model's sub-block; a ``block_length`` the caller gave, whatever it equals (32 included), is
    kept, and refused by ``check_block_support`` if it does not fit. Other models: ``params`` unchanged."""
    contract = block_mode(model, params)
    if contract is None or "block_length" in params.explicit_settings or params.block_length != DEFAULT_BLOCK_LENGTH \
            or contract.block_size % DEFAULT_BLOCK_LENGTH == 0:
        return params
    return replace(params, block_length=contract.defaults.get("block_length", contract.block_size))


def check_block_support(contract: DecodingContract, params: SamplingParams, has_suffix: bool = False) -> None:
    """Raise ValueError (first word: the parameter) for settings a block-diffusion model cannot use."""
    if params.block_length < 1 or contract.block_size % params.block_length:
        raise ValueError(f"block_length {params.block_length} must divide this model's trained block size "
                         f"{contract.block_size} (it is the denoising sub-block; the trained block never changes)")
    # a causal history's keys/values written once, a step after commit: what cache='delayed' means for a causal model
    allowed_cache = ("none", "delayed") if contract.attention == "causal_history" else ("none",)
    own_mode = ("'verified' needs a causal model's next-token head (a hybrid or autoregressive model)"
                if params.decoding == "verified" else f"'{params.decoding}' is a decoding mode of its own")
    refused = [
        ("decoding", not COMMIT_RULES[params.decoding].denoises, f"{own_mode}; a block-diffusion model denoises "
                                                                 "blocks"),
        ("cache", params.cache not in allowed_cache, f"'{params.cache}' does not apply: the committed history has an "
                                                    f"exact KV cache, always on; use cache='none'"),
        ("suffix_window", params.suffix_window != 0, "does not apply: nothing after the current block is attended"),
        ("suffix", has_suffix, "(infilling) needs a full-attention model: a block model never sees what follows"),
        ("cfg_scale", params.cfg_scale > 0, "(classifier-free guidance) is not supported for block-diffusion models"),
        # over HTTP the serving layer names the field the grammar came from (response_format or tool_choice)
        ("grammar", params.grammar is not None, "(structured output: response_format, tools that force a call, "
                                                "--json-schema) is not supported for block-diffusion models yet"),
    ]
    for name, bad, why in refused:
        if bad:
            raise ValueError(f"{name} {why}")


def padded_length(prompt_len: int, max_tokens: int, contract: DecodingContract,
                  context_length: int | None = None) -> int:
    """The canvas length a request is denoised on: prompt + answer padded with mask tokens to a whole attention
    block, as the published samplers do (SDAR's ``generate.py`` and LLaDA2.0's ``generate``: ``total_length =
    num_blocks * block_length``; Fast-dLLM v2 appends whole blocks). The pad columns are attended and denoised
    like the answer and cut from it. Capped at ``context_length`` (the model's position window) when given."""
    origin = 0 if contract.alignment == "absolute" else prompt_len
    bs, end = contract.block_size, prompt_len + max_tokens
    total = origin + -(-(end - origin) // bs) * bs
    return max(end, min(total, context_length)) if context_length else total


def block_units(prompt_len: int, max_tokens: int, contract: DecodingContract, block_length: int,
                context_length: int | None = None) -> list[Unit]:
    """The sub-blocks an answer is denoised in, in order, each with its attention block.

    Attention blocks start at ``origin + k * block_size`` (origin 0 for ``absolute`` alignment, the prompt
    length for ``answer``) and end ``block_size`` later: the last one too, past ``max_tokens``, up to
    ``padded_length`` (published samplers); sub-blocks split them into ``block_length`` pieces aligned the same
    way, keeping only the answer's columns (empty ones are skipped).
    """
    origin = 0 if contract.alignment == "absolute" else prompt_len
    bs, total = contract.block_size, padded_length(prompt_len, max_tokens, contract, context_length)
    units: list[Unit] = []
    a = origin + (prompt_len - origin) // bs * bs
    while a < total:
        e = min(a + bs, total)
        for s in range(a, e, block_length):
            lo, hi = max(s, prompt_len), min(s + block_length, e)
            if lo < hi:
                units.append((a, e, lo, hi))
        a = e
    return units


def unit_schedule(steps: int, block_length: int) -> tuple[torch.Tensor, int]:
    """The linear schedule of a sub-block: (S,) int64 tokens per step and S = min(``steps``, ``block_length``).

    As SDAR's and LLaDA2.0's ``get_num_transfer_tokens(block_length, steps)``, the counts spread the whole
    sub-block's width, not its masked positions: a sub-block that starts with prompt tokens is filled in fewer
    steps (a count larger than the masked positions commits them all).
    """
    num_steps = max(1, min(steps, block_length))
    return num_transfer_tokens(torch.tensor([block_length]), num_steps)[0], num_steps


def end_reached(answer: list[int], ends: frozenset[int], mask_id: int) -> bool:
    """Whether an id of ``ends`` is committed in ``answer`` with every position before it committed: the answer
    is then final up to its end, so early exit stops here (Fast-dLLM v2's ``generate`` stops once the end
    token's prefix is complete) instead of finishing the sub-block."""
    for tok in answer:
        if tok == mask_id:
            return False
        if tok in ends:
            return True
    return False


def first_token_pending(contract: DecodingContract, unit: Unit, canvas: torch.Tensor, mask_id: int) -> bool:
    """Whether ``unit`` must first commit its attention block's first position alone (``commit_first``: Fast-dLLM
    v2's ``generate`` appends the argmax of the finished history's last logits before it denoises the next
    block): the sub-block starts the attention block and that position (a masked answer column) is open.
    ``canvas`` (T,) int64. Such a pass scores that one position, from the history's last hidden state
    (``logits_shift`` 1), and the sub-block's denoising steps follow with it committed."""
    a, _, s, _ = unit
    return contract.commit_first and s == a and bool(canvas[s] == mask_id)


def block_steps(contract: DecodingContract, params: SamplingParams) -> int:
    """Denoising steps per sub-block: ``params.steps``, capped at the answer length where the published loop
    caps them (``steps_within_answer``: LLaDA2.0's ``steps = min(steps, gen_length // minimal_topk)``, with
    ``minimal_topk`` 1), which matters for answers shorter than a block; ``unit_schedule`` caps them at the
    sub-block too."""
    return min(params.steps, params.max_tokens) if contract.steps_within_answer else params.steps


def answer_ends(params: SamplingParams, end_ids: list[int]) -> frozenset[int]:
    """The ids that end an answer: the model's end ids (unless ``ignore_eos``) and ``stop_token_ids``."""
    return (frozenset() if params.ignore_eos else frozenset(end_ids)) | frozenset(params.stop_token_ids)
